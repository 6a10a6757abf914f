"""What a peer does with a group's average: the outer step, its anchors and momentum, and the update guard.

Groups average pseudo-gradients, ``anchor - current``, where the anchor is the value the group last
agreed on (identical on every member: the group checks it by digest, ``allreduce.py``). The new
value is the anchor minus the outer step of the decoded average: SPES's ``average`` (the anchor
minus the average, i.e. the average of the members' weights) or DiLoCo's Nesterov step
(``swarm.outer_optimizer``). Every member computes it from the same inputs, so copies stay
bit-identical; the anchor and momentum move only when a group succeeds. Anchors, momentum and the
error-feedback residuals live on the CPU in fp32, never on the accelerator.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Iterable

import torch

from p2p_spes.averaging import Base, TransportError, tensor_digest
from p2p_spes.config import SwarmConfig
from p2p_spes.model import MoETransformer
from p2p_spes.swarm.state import Downloader

log = logging.getLogger(__name__)


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One flat fp32 CPU vector of ``tensors``, in order: the unit every group averages."""
    return torch.cat([t.detach().float().cpu().reshape(-1) for t in tensors])


def split_like(flat: torch.Tensor, targets: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into views shaped like ``targets`` (the inverse of :func:`flatten`)."""
    out, offset = [], 0
    for t in targets:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


class OuterOptimizer:
    """Anchors (with their round and digest) and Nesterov momentum, per group uid (``shared``, ``expert:E``)."""

    def __init__(self, sw: SwarmConfig) -> None:
        self.sw = sw
        self.anchor: dict[str, torch.Tensor] = {}  # the value each group last agreed on (replaced, never written)
        self.anchor_round: dict[str, int] = {}
        self._digests: dict[str, str] = {}
        self.momentum: dict[str, torch.Tensor] = {}  # Nesterov outer momentum per group uid
        # groups whose weights run ahead of their anchor: a lone holder under a lossy codec (any member
        # with swarm.keep_local_progress) keeps what it trained, and its anchor (what it serves, and what
        # frozen copies follow by encoded deltas) trails it by what the codec has not carried yet
        self.ahead: set[str] = set()

    @property
    def stateful(self) -> bool:
        """Whether the outer step keeps momentum (Nesterov): joiners must copy it."""
        return self.sw.outer_optimizer != "average"

    def reset_anchors(self, model: MoETransformer, round_no: int = -1) -> None:
        """Anchors = the weights as they stand now, agreed (at start, or just downloaded)."""
        self.anchor, self.anchor_round, self._digests, self.ahead = {}, {}, {}, set()
        self.set_anchor("shared", flatten(p for _, p in model.shared_parameters()), round_no)
        for e in model.local_experts:
            self.set_anchor(f"expert:{e}", flatten(model.expert_tensors(e)), round_no)

    def set_anchor(self, uid: str, flat: torch.Tensor, round_no: int) -> None:
        self.anchor[uid], self.anchor_round[uid] = flat, round_no
        self._digests.pop(uid, None)
        self.ahead.discard(uid)

    def keeps_own(self, members: int, lossy: bool, carried: bool = True) -> bool:
        """Whether our weights keep what our message has not carried (the group's result plus our
        residual) while the anchor, the value others follow, takes the result: under a lossy codec with
        the plain average, for a lone holder (whose result would be its own weights but for what the
        codec dropped) and, with ``swarm.keep_local_progress``, for every group whose result counted
        our whole contribution (``carried``)."""
        if not lossy or self.stateful:
            return False
        return members == 1 or (self.sw.keep_local_progress and carried)

    def public(self, uid: str, targets: list[torch.Tensor]) -> list[torch.Tensor]:
        """``uid``'s anchor shaped (and typed) like ``targets``: the value we serve and publish."""
        return [v.to(t.dtype) for v, t in zip(split_like(self.anchor[uid], targets), targets)]

    def public_values(self, model: MoETransformer) -> dict[str, list[torch.Tensor]]:
        """The served values of the groups whose weights run ahead of their anchor."""

        def targets(uid: str) -> list[torch.Tensor]:
            if uid == "shared":
                return [p.detach() for _, p in model.shared_parameters()]
            return list(model.expert_tensors(int(uid.split(":")[1])))

        return {uid: self.public(uid, targets(uid)) for uid in self.ahead}

    def reanchor(self, uid: str, tensors: Iterable[torch.Tensor], only_existing: bool = False) -> None:
        """Set ``uid``'s anchor to ``tensors`` (after a merge, an adoption or a takeover changed them)."""
        if uid in self.anchor or not only_existing:
            self.set_anchor(uid, flatten(tensors), self.anchor_round.get(uid, -1))

    def base(self, uid: str) -> Base:
        """What ``uid``'s pseudo-gradients are relative to: its anchor's digest and round."""
        if uid not in self._digests:
            self._digests[uid] = tensor_digest([self.anchor[uid]])
        return Base(self._digests[uid], self.anchor_round[uid])

    def pseudo_gradient(self, uid: str, current: torch.Tensor) -> torch.Tensor:
        """``anchor - current``: what this peer learned since the group last agreed."""
        return self.anchor[uid] - current

    def outer_step(
        self, anchor: torch.Tensor, average: torch.Tensor, momentum: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The new value from ``anchor`` and the averaged pseudo-gradient (and the new momentum)."""
        if not self.stateful:
            return anchor - average, None
        sw = self.sw
        momentum = average.clone() if momentum is None else momentum * sw.outer_momentum + average
        return anchor - sw.outer_lr * (average + sw.outer_momentum * momentum), momentum

    def step(self, uid: str, average: torch.Tensor, round_no: int) -> torch.Tensor:
        """Apply a successful group's averaged pseudo-gradient: the new value becomes the anchor."""
        value, momentum = self.outer_step(self.anchor[uid], average, self.momentum.get(uid))
        if momentum is not None:
            self.momentum[uid] = momentum
        self.set_anchor(uid, value, round_no)
        return value.clone()

    def step_frozen(self, uid: str, copy: torch.Tensor, average: torch.Tensor) -> torch.Tensor | None:
        """A frozen copy moved by its group's average, as the group's members moved it; None when the
        outer step needs momentum we do not track for ``uid`` (then the expert is downloaded whole)."""
        if self.stateful and uid not in self.momentum:
            return None
        value, momentum = self.outer_step(copy, average, self.momentum.get(uid))
        if momentum is not None:
            self.momentum[uid] = momentum
        return value

    def fetch_momentum(self, downloader: Downloader, peer: str, uid: str, size: int) -> None:
        """Take a peer's outer momentum for ``uid`` so our outer steps match theirs (Nesterov only)."""
        if not self.stateful:
            return
        try:
            _, (momentum,) = downloader.download(peer, f"momentum:{uid}", [torch.empty(size)], attempts=2)
        except TransportError:
            self.momentum.pop(uid, None)  # the run has not taken an outer step yet
            return
        self.momentum[uid] = momentum


class UpdateGuard:
    """Refuses group results that are not finite or move our values far more than recent results did,
    or than our own training moved them since the round's anchor."""

    def __init__(self, max_update_ratio: float, history: int = 20) -> None:
        self.limit = max_update_ratio
        self._moves: dict[str, deque[float]] = {}  # recent relative moves of accepted results, per kind
        self._history = history

    def implausible(
        self, kind: str, local: torch.Tensor, averaged: torch.Tensor, anchor: torch.Tensor | None = None
    ) -> str | None:
        """Why a group result must not be applied, or None. The move is ``|averaged - local| / |local|``,
        compared with the larger of the median of accepted moves of the same ``kind`` (shared / expert)
        and, given the ``anchor`` the round started from, our own move ``|anchor - local| / |local|``.
        Moves grow many times over a learning-rate warm-up: against the accepted ones alone, a peer whose
        early moves were tiny would refuse every later honest result (it never accepts the larger moves
        that would raise its median). An honest group moves us by about what its members trained, ours
        included; a poisoned result moves us far more than that."""
        if not torch.isfinite(averaged).all():
            return "the result is not finite"
        scale = max(float(local.norm()), 1e-12)
        move = float((averaged - local).norm()) / scale
        history = self._moves.setdefault(kind, deque(maxlen=self._history))
        if self.limit and len(history) >= 3:
            own = 0.0 if anchor is None else float((anchor - local).norm()) / scale
            typical = max(statistics.median(history), own)
            if move > self.limit * max(typical, 1e-6):
                times = move / max(typical, 1e-6)
                return (
                    f"it moves our values by {move:.3g} of their norm, {times:.0f}x the larger of the recent "
                    f"median and our own training's move"
                )
        history.append(move)
        return None
