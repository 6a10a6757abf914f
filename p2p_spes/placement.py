"""Expert placement: which experts a peer trains.

The SPES rule gives peer p of P the block ``[p*n, (p+1)*n)``; in an open swarm nobody knows P in
advance, so a joining peer instead reads how many live holders each expert has and takes the
least-covered ones. Ties are broken by a hash of (peer id, expert), so peers that join at the same
moment spread over different experts instead of all picking expert 0.
"""

from __future__ import annotations

import hashlib
from typing import Mapping


def spes_block(peer_index: int, num_peers: int, num_experts: int) -> list[int]:
    per_peer = num_experts // num_peers
    return list(range(peer_index * per_peer, (peer_index + 1) * per_peer))


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
