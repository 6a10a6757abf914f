"""How a sync round's group results reach the model: what this peer sends for a group (its pseudo-gradient
plus what its last message dropped), how a group's decoded average is written back (the outer step from
the agreed anchor, error feedback settled, the encoded parts kept to serve), and the warm-up merge on the
values every peer holds."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from p2p_spes.averaging import ErrorFeedback, GroupAllReduce, GroupResult, tensor_digest
from p2p_spes.merging import merge_experts
from p2p_spes.model import MoETransformer, copy_into
from p2p_spes.swarm.agreement import group_id
from p2p_spes.swarm.counters import SwarmCounters
from p2p_spes.swarm.outer import OuterOptimizer, UpdateGuard, split_like
from p2p_spes.swarm.pacing import Deadlines
from p2p_spes.swarm.report import GroupReport
from p2p_spes.swarm.state import StateServer

log = logging.getLogger(__name__)


class GroupApplier:
    """Turns our tensors into group contributions and group results back into our tensors."""

    def __init__(
        self,
        reducer: GroupAllReduce,
        server: StateServer,
        outer: OuterOptimizer,
        guard: UpdateGuard,
        deadlines: Deadlines,
        stats: SwarmCounters,
    ) -> None:
        self.reducer, self.server, self.outer, self.guard = reducer, server, outer, guard
        self.deadlines, self.stats = deadlines, stats
        # what our messages dropped, sent next round
        self.feedback = ErrorFeedback(reducer.codec, outer.sw.feedback_decay)

    def contribution(
        self, uid: str, current: torch.Tensor, sending: dict[str, torch.Tensor]
    ) -> Callable[[], torch.Tensor]:
        """What we send for ``uid``, computed once the group's anchor is ours (after any rebase)."""

        def make() -> torch.Tensor:
            sending[uid] = self.feedback.compensate(uid, self.outer.pseudo_gradient(uid, current))
            return sending[uid]

        return make

    def apply(
        self,
        res: GroupResult,
        targets: list[torch.Tensor],
        uid: str,
        local: torch.Tensor,
        sending: dict[str, torch.Tensor],
        round_no: int,
    ) -> GroupReport:
        """Write a successful group's result (the outer step of its decoded average, from the agreed
        anchor) into the model and keep its encoded parts to serve; a failed one is dropped, and so is
        one the update guard refuses (we keep our values and take no one's)."""
        info = GroupReport(
            ok=res.ok,
            members=len(res.members),
            group_id=group_id(res.members),
            bytes_sent=res.bytes_sent,
            bytes_received=res.bytes_received,
            seconds=round(res.seconds, 3),
            retries=res.retries or None,
            attempts=res.attempts if res.attempts > 1 else None,
            lost=res.lost or None,
            rows=res.rows or None,
            partial=True if res.ok and res.rows and res.sent is None else None,
        )
        if not res.ok:
            info.error = res.error
            return info
        if len(res.members) > 1:
            if not res.lost:
                # a round that lost a member waited for it: its time says nothing of the links, and the
                # group's deadline is the longest any member proposes, so one member's inflated estimate
                # would become everyone's (a round without losses still counts a retry our own link needed)
                self.deadlines.observe_transfer(res.bytes_sent + res.bytes_received, res.transfer_seconds)
            anchor = self.outer.anchor[uid]
            reason = self.guard.implausible(uid.split(":")[0], local, anchor - res.tensor, anchor)
            if reason:
                log.warning("refused the %s result of this round: %s", uid, reason)
                self.stats.updates_refused += 1
                info.ok, info.refused, info.error = False, reason, f"refused: {reason}"
                return info
        base = self.outer.base(uid)
        value = self.outer.step(uid, res.tensor, round_no)
        if self.outer.keeps_own(len(res.members), not self.reducer.codec.lossless, carried=res.sent is not None):
            # our weights keep what we trained; the anchor, what we serve, took the encoded value, and
            # the next pseudo-gradient (anchor - weights) carries what this message dropped: no residual.
            # Alone, that is our weights as they are; in a group, its result plus what we sent and it
            # did not carry (what we sent is relative to the anchor the result moved from)
            if len(res.members) > 1:
                copy_into(targets, split_like(value - (sending[uid] - res.sent), targets))
            self.outer.ahead.add(uid)
            self.feedback.drop(uid)
            digest = tensor_digest(self.outer.public(uid, targets))
        else:
            copy_into(targets, split_like(value, targets))
            if res.sent is None:  # our contribution missed part of the result: it holds nothing to carry over
                self.feedback.drop(uid)
            else:
                self.feedback.settle(uid, sending[uid], res.sent)
            digest = tensor_digest(targets)
        self.server.keep_update(uid, base.digest, digest, res.messages)
        return info

    def merge(self, model: MoETransformer, alpha: float) -> None:
        """The warm-up merge, on the values every peer holds: an expert whose weights run ahead of its
        anchor is merged at its anchor (as the others hold it) and keeps its lead on top."""
        leads = {}
        for e in model.local_experts:
            uid, targets = f"expert:{e}", model.expert_tensors(e)
            if uid in self.outer.ahead:
                public = self.outer.public(uid, targets)
                leads[uid] = [t.detach() - p.to(t.device) for t, p in zip(targets, public)]
                copy_into(targets, public)
        merge_experts(model, alpha)
        for e in model.local_experts:
            uid, targets = f"expert:{e}", model.expert_tensors(e)
            self.outer.reanchor(uid, targets, only_existing=True)
            if uid in leads:
                copy_into(targets, [t.detach() + d for t, d in zip(targets, leads[uid])])
                self.outer.ahead.add(uid)
