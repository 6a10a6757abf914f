"""What a peer does with a group's average: the outer step, its anchors and momentum, and the update guard.

SPES replaces the weights by the group's average; DiLoCo's outer Nesterov step is the option
(``swarm.outer_optimizer``). Either way every member of a group must compute the same result from
the same inputs, so the anchor (the value the group last agreed on) and the momentum move only when
a group succeeds, and a joiner copies both from a live peer.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Iterable

import torch

from p2p_spes.config import SwarmConfig
from p2p_spes.model import MoETransformer
from p2p_spes.swarm.state import Downloader
from p2p_spes.transport import TransportError

log = logging.getLogger(__name__)


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One flat fp32 CPU vector of ``tensors``, in order: the unit every group averages."""
    return torch.cat([t.detach().float().cpu().reshape(-1) for t in tensors])


class OuterOptimizer:
    """Anchors and momentum per group uid (``shared``, ``expert:E``); stateless under ``average``."""

    def __init__(self, sw: SwarmConfig) -> None:
        self.sw = sw
        self.anchor: dict[str, torch.Tensor] = {}  # Nesterov: the value each group last agreed on
        self.momentum: dict[str, torch.Tensor] = {}  # Nesterov outer momentum per group uid

    @property
    def stateful(self) -> bool:
        return self.sw.outer_optimizer != "average"

    def reset_anchors(self, model: MoETransformer) -> None:
        """Anchors = the weights as they stand now, agreed (at start, or just downloaded)."""
        if not self.stateful:
            self.anchor = {}
            return
        self.anchor = {"shared": flatten(p for _, p in model.shared_parameters())}
        for e in model.local_experts:
            self.anchor[f"expert:{e}"] = flatten(model.expert_tensors(e))

    def reanchor(self, uid: str, tensors: Iterable[torch.Tensor], only_existing: bool = False) -> None:
        """Set ``uid``'s anchor to ``tensors`` (after a merge, an adoption or a takeover changed them)."""
        if self.stateful and (uid in self.anchor or not only_existing):
            self.anchor[uid] = flatten(tensors)

    def step(self, uid: str, averaged: torch.Tensor) -> torch.Tensor:
        """The group's new value from its average.

        The pseudo-gradient is the anchor minus the new average. The anchor moves only when a group
        succeeds, so after a failed round every member still has the same anchor, average and
        momentum, and results stay identical.
        """
        if not self.stateful or uid not in self.anchor:
            return averaged
        sw = self.sw
        anchor = self.anchor[uid]
        delta = anchor - averaged
        momentum = self.momentum.get(uid)
        momentum = delta.clone() if momentum is None else momentum.mul_(sw.outer_momentum).add_(delta)
        self.momentum[uid] = momentum
        result = anchor - sw.outer_lr * (delta + sw.outer_momentum * momentum)
        self.anchor[uid] = result.clone()
        return result

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

    def fetch_anchor(self, downloader: Downloader, peer: str, uid: str) -> None:
        """Take a peer's anchor for ``uid``: its last agreed value, which may differ from the weights it
        serves when its last round failed. Every member of a group needs the same one."""
        if uid not in self.anchor:
            return
        try:
            _, (anchor,) = downloader.download(peer, f"anchor:{uid}", [torch.empty_like(self.anchor[uid])], attempts=2)
        except TransportError as exc:
            log.warning("could not fetch the outer-step anchor of %s from %s: %s", uid, peer, exc)
            return
        self.anchor[uid] = anchor


class UpdateGuard:
    """Refuses group results that are not finite or move our values far more than recent results did."""

    def __init__(self, max_update_ratio: float, history: int = 20) -> None:
        self.limit = max_update_ratio
        self._moves: dict[str, deque[float]] = {}  # recent relative moves of accepted results, per kind
        self._history = history

    def implausible(self, kind: str, local: torch.Tensor, averaged: torch.Tensor) -> str | None:
        """Why a group result must not be applied, or None. The move is ``|averaged - local| / |local|``,
        compared with the median of accepted moves of the same ``kind`` (shared / expert)."""
        if not torch.isfinite(averaged).all():
            return "the result is not finite"
        move = float((averaged - local).norm()) / max(float(local.norm()), 1e-12)
        history = self._moves.setdefault(kind, deque(maxlen=self._history))
        if self.limit and len(history) >= 3:
            typical = statistics.median(history)
            if move > self.limit * max(typical, 1e-6):
                times = move / max(typical, 1e-6)
                return f"it moves our values by {move:.3g} of their norm, {times:.0f}x the recent median"
        history.append(move)
        return None
