"""How a peer takes state the others agreed on instead of its own: a group's anchor it lacks, the shared
result of a group it missed, and (a private peer) the agreed version of an expert it trains when its
group for it missed the other holders. Each is fetched by digest from a peer that holds it, and each
resets the anchor and the error feedback that were relative to the old value."""

from __future__ import annotations

import logging

import torch

from dht.records import PeerRecord, VersionRecord
from p2p_spes.averaging import Base, ErrorFeedback
from p2p_spes.model import MoETransformer
from p2p_spes.swarm.agreement import Refresher, adoptable, majority
from p2p_spes.swarm.counters import SwarmCounters
from p2p_spes.swarm.outer import OuterOptimizer, flatten
from p2p_spes.swarm.report import RoundReport
from p2p_spes.swarm.state import Downloader, StateServer

log = logging.getLogger(__name__)


class Adopter:
    """Takes agreed state from other peers into our model, anchors and feedback."""

    def __init__(
        self,
        peer_id: str,
        server: StateServer,
        downloader: Downloader,
        refresher: Refresher,
        outer: OuterOptimizer,
        feedback: ErrorFeedback,
        stats: SwarmCounters,
    ) -> None:
        self.peer_id, self.server, self.downloader, self.refresher = peer_id, server, downloader, refresher
        self.outer, self.feedback, self.stats = outer, feedback, stats

    def rebase(self, uid: str, numel: int):
        """Take the anchor a group agreed on from one of its members that holds it (and, for the
        Nesterov step, its momentum): our own is stale (we missed a round, restarted, or joined)."""

        async def rebase(base: Base, holders: list[str]) -> None:
            for peer in holders:
                try:
                    _, (anchor,) = await self.downloader.fetch(
                        peer, f"anchor:{uid}@{base.digest}", [torch.empty(numel)]
                    )
                    if self.outer.stateful:
                        _, (momentum,) = await self.downloader.fetch(peer, f"momentum:{uid}", [torch.empty(numel)])
                        self.outer.momentum[uid] = momentum
                except Exception as exc:
                    log.info("could not take the anchor of %s from %s: %s", uid, peer, exc)
                    continue
                self.outer.set_anchor(uid, anchor, base.round)
                self.feedback.drop(uid)  # it was relative to our old anchor
                self.stats.anchors_rebased += 1
                log.info("took the agreed anchor of %s (round %d) from %s", uid, base.round, peer)
                return
            raise RuntimeError(f"no member served the agreed anchor of {uid}")

        return rebase

    def adopt_shared(
        self, model: MoETransformer, round_no: int, versions: dict[str, VersionRecord], among: set[str] | None = None
    ) -> str | None:
        """After missing the shared group, take the result the others (of ``among``) agreed on (as a joiner would)."""
        results = adoptable(versions, self.peer_id, among)
        best = majority(v.shared for v in results.values())
        if best is None:
            return None
        like = [p.detach() for _, p in model.shared_parameters()]
        sources = sorted(p for p, v in results.items() if v.shared == best)
        found = self.downloader.first_of(sources, f"shared@{best}", like)
        if found is None:
            return None
        peer, (_, tensors) = found
        model.write_shared(tensors)
        self.outer.fetch_momentum(self.downloader, peer, "shared", sum(t.numel() for t in like))
        self.outer.set_anchor("shared", flatten(tensors), round_no)
        self.feedback.drop("shared")
        self.server.take_snapshot(round_no, self.server.current("shared")["step"], self.outer.momentum)
        return peer

    def take_agreed_own(
        self,
        model: MoETransformer,
        round_no: int,
        peers: dict[str, PeerRecord],
        versions: dict[str, VersionRecord],
        agreed: dict[str, VersionRecord],
        report: RoundReport,
    ) -> int:
        """A private peer whose group for an expert it trains did not hold every holder (it was late, or
        the group failed) takes the version the round agreed on when that is not its own, as its value
        and its anchor: the next round's group needs one anchor, and where the holders' anchors differ,
        one private member cannot take another's (nobody can dial either). Returns the experts taken."""
        groups = {e: report.groups.get(f"expert{e}") for e in model.local_experts}  # none: not averaged this round
        behind = [e for e, g in groups.items() if g is not None and (not g.ok or g.members < 2)]
        taken = self.refresher.take_agreed(model, peers, behind, versions, agreed)
        for e in taken:
            self.outer.set_anchor(f"expert:{e}", flatten(model.expert_tensors(e)), round_no)
            self.feedback.drop(f"expert:{e}")
        if taken:
            self.server.take_snapshot(round_no, self.server.current("shared")["step"], self.outer.momentum)
        return len(taken)
