"""Self-healing coverage: which experts live peers take over when a holder leaves, and taking them over.

Every peer computes the same takeover plan from the same view (``healing.plan_takeover``) at sync
boundaries; a peer takes its part only once the plan gave it to it at two boundaries in a row, so one
slow heartbeat or late record does not make it take over a live peer's experts.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from dht.records import PeerRecord, VersionRecord
from p2p_spes.config import Config
from p2p_spes.healing import initial_expert, plan_takeover
from p2p_spes.model import MoETransformer
from p2p_spes.swarm.counters import SwarmCounters
from p2p_spes.swarm.membership import Membership
from p2p_spes.swarm.state import Downloader

log = logging.getLogger(__name__)


class Coverage:
    """The takeover plan (same on every peer) and this peer's part of it."""

    def __init__(self, cfg: Config, membership: Membership, downloader: Downloader, stats: SwarmCounters) -> None:
        self.cfg, self.membership, self.downloader, self.stats = cfg, membership, downloader, stats
        self.peer_id = membership.peer_id
        self._planned_before: set[int] = set()  # experts the plan gave us at the last boundary
        self._most_holders: Counter = Counter()  # per expert, the most holders we have seen it have

    def plan(self, last_versions: dict[str, VersionRecord]) -> dict[str, list[int]]:
        """The experts live peers should take on now (the same plan on every peer; see healing.py).

        A peer counts as holding what its live record says and what it averaged in the last round
        (``last_versions``, its published digests): a record that lapsed under load does not make its
        experts look lost.
        """
        cfg = self.cfg
        peers = self.membership.live_peers()
        peers[self.peer_id] = PeerRecord.from_value(self.peer_id, self.membership.record())
        held = {p: set(r.experts) for p, r in peers.items()}
        for p, v in last_versions.items():
            held.setdefault(p, set()).update(v.experts)
        holders = Counter(e for es in held.values() for e in es)
        for e, n in holders.items():
            self._most_holders[e] = max(self._most_holders[e], n)
        experts = [e for e, most in self._most_holders.items() if holders[e] < most]  # lost a holder
        per_peer = cfg.experts_per_partition(partition=0)  # the smallest share a peer is given
        if len(held) * per_peer >= cfg.moe.num_experts * cfg.swarm.replicas:
            experts = list(range(cfg.moe.num_experts))  # enough peers to cover all: a gap is a racing join's
        capacity = {
            p: int(r.extra["max_experts"]) for p, r in peers.items() if isinstance(r.extra.get("max_experts"), int)
        }
        return plan_takeover(
            {p: sorted(es) for p, es in held.items()},
            capacity,
            cfg.moe.num_experts,
            cfg.swarm.replicas,
            experts=experts,
        )

    def experts_to_take(self, local: list[int], last_versions: dict[str, VersionRecord]) -> list[int]:
        """Our part of the plan, once it gave them to us at two sync boundaries in a row."""
        planned = [e for e in self.plan(last_versions).get(self.peer_id, []) if e not in local]
        confirmed = [e for e in planned if e in self._planned_before]
        self._planned_before = set(planned) - set(confirmed)
        return confirmed

    def fetch_copy(self, model: MoETransformer, expert: int) -> list[torch.Tensor] | None:
        """Expert ``expert``'s latest weights from a live holder, else from a full peer's frozen copy.

        When no live peer has any copy at all (a partial swarm whose only holder left, or an expert
        nobody took yet), the expert restarts from its seeded initial value, loudly logged.
        """
        peers = self.membership.others()
        holders = sorted(p for p, r in peers.items() if expert in r.experts)
        copies = sorted(p for p, r in peers.items() if p not in holders and r.extra.get("residency", "full") == "full")
        if not holders and not copies:
            log.warning("no live peer has a copy of expert %d: restarting it from its initial weights", expert)
            self.stats.experts_reinitialised += 1
            return initial_expert(self.cfg, expert)
        store = model.expert_modules()[0]
        like = [
            torch.empty(store.ffn_dim, store.d_model, dtype=store.local_w1.dtype)
            for _ in model.expert_modules()
            for _ in ("w1", "v1", "w2")
        ]
        found = self.downloader.first_of(holders + copies, f"expert:{expert}", like)
        return None if found is None else found[1][1]
