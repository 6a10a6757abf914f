"""Expert placement and data partitions: which experts and which slice of the data a peer trains.

The SPES rule gives peer p of P the block ``[p*n, (p+1)*n)`` of n = E / P experts. In an open swarm
nobody hands out indices, so a joining peer first claims a *data partition* (the lowest one no live
peer reads; racing claims are settled by claim time) and the partition number plays the part of p:
with ``experts.placement: spes`` the peer trains that partition's block. With least-covered placement
(``auto``/``coverage``) it reads how many live holders each expert has and takes as many of the
least-covered ones as its block would hold; ties are broken by a hash of (peer id, expert), so peers
that join at the same moment spread over different experts instead of all picking expert 0.

Blocks need not divide evenly: 3 peers share 8 experts as 2/3/3, and with more peers than experts
peer p holds expert p mod E, so 16 peers give 8 experts two holders each.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping


def spes_block(peer_index: int, num_peers: int, num_experts: int) -> list[int]:
    """Peer ``peer_index`` of ``num_peers``'s contiguous block: sizes differ by at most one, and equal
    the paper's ``[p*n, (p+1)*n)`` when the peers divide the experts; block 0 is never larger than
    another (callers use it as the smallest share)."""
    if not 0 <= peer_index < num_peers:
        raise ValueError(f"peer index {peer_index} outside [0, {num_peers})")
    if num_peers > num_experts:
        return [peer_index % num_experts]
    return list(range(peer_index * num_experts // num_peers, (peer_index + 1) * num_experts // num_peers))


def free_partition(used: Mapping[int, int], num_partitions: int, preferred: int | None = None) -> int:
    """The data partition a joining peer reads: ``preferred`` if nobody reads it, else the lowest one
    nobody reads, else (more peers than partitions) the least-read one. ``used`` counts live readers."""
    free = [i for i in range(num_partitions) if not used.get(i)]
    if preferred in free:
        return preferred
    return free[0] if free else min(range(num_partitions), key=lambda i: (used.get(i, 0), i))


def _tiebreak(peer_id: str, expert: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{peer_id}/{expert}".encode()).digest()[:8], "big")


def least_covered(
    holders: Mapping[int, int], num_experts: int, count: int, peer_id: str, replicas: int = 1
) -> list[int]:
    """The ``count`` experts with the fewest live holders; uncovered and under-replicated first.

    ``holders`` maps expert id to its number of live holders (missing means none).
    """
    if not 0 < count <= num_experts:
        raise ValueError(f"a peer must hold between 1 and {num_experts} experts, asked for {count}")

    def key(e: int) -> tuple[int, int, int]:
        have = holders.get(e, 0)
        return (have >= replicas, have, _tiebreak(peer_id, e))

    return sorted(sorted(range(num_experts), key=key)[:count])


def under_replicated(holders: Mapping[int, int], num_experts: int, replicas: int) -> list[int]:
    """Experts with fewer live holders than the target, most urgent (fewest holders) first."""
    return sorted((e for e in range(num_experts) if holders.get(e, 0) < replicas), key=lambda e: (holders.get(e, 0), e))
