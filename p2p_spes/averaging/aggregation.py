"""How a reducer combines the contributions it gathered for its slice of a group's tensor.

``mean`` is the token-weighted mean SPES and DiLoCo use. It trusts every peer: one peer sending
weights scaled by 1000 (or a huge self-declared token count) moves the result anywhere. The robust
rules bound what one peer can do, for groups of three or more:

* ``trimmed_mean``: coordinate-wise, drop the ``k`` largest and ``k`` smallest values (``k`` =
  ``trim_fraction`` of the group, at least 1) and average the rest. With three members it is the
  coordinate-wise median.
* ``centered_clip`` (Karimireddy, He and Jaggi, 2021): start from the coordinate-wise median and
  iterate ``v <- v + mean_i clip(x_i - v, tau)``, where ``clip`` scales a difference down to norm
  ``tau``. ``tau`` is ``clip_tau`` times the median distance of the contributions from the start
  point, so it follows the scale of the parameters. The norms are those of the reducer's slice,
  not of the whole tensor: every slice is clipped on its own (a block-wise CenteredClip), which
  bounds a bad peer's pull on each slice by ``tau / n`` per iteration.

Both robust rules count each peer once and ignore the token weights, because a weight is what a
peer says about itself and would let a liar outvote everyone. Every reducer applies the same rule
to the same contributions in member order, so members still end bit-identical.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

Aggregator = Callable[[list[torch.Tensor], list[float]], torch.Tensor]
ROBUST_MIN_MEMBERS = 3


def weighted_mean(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """The weighted mean in fp64, summed in member order (deterministic for given inputs)."""
    total = sum(weights)
    out = torch.zeros_like(tensors[0], dtype=torch.float64)
    for t, w in zip(tensors, weights):
        out.add_(t.double(), alpha=w / total)
    return out.float()


def trimmed_mean(tensors: list[torch.Tensor], trim_fraction: float = 0.2) -> torch.Tensor:
    """Coordinate-wise mean after dropping the ``k`` smallest and ``k`` largest values."""
    n = len(tensors)
    k = max(1, math.floor(trim_fraction * n))
    if n - 2 * k < 1:
        k = (n - 1) // 2
    stacked = torch.stack([t.double() for t in tensors])
    kept = stacked.sort(dim=0).values[k : n - k]
    return kept.mean(dim=0).float()


def centered_clip(tensors: list[torch.Tensor], clip_tau: float = 1.0, iterations: int = 5) -> torch.Tensor:
    """CenteredClip from the coordinate-wise median, with ``tau`` relative to the spread."""
    stacked = torch.stack([t.double() for t in tensors])
    v = stacked.median(dim=0).values
    distances = (stacked - v).norm(dim=1)
    tau = clip_tau * float(distances.median())
    if tau == 0.0:  # at least half the members sent exactly the median: that is the answer
        return v.float()
    for _ in range(iterations):
        diff = stacked - v
        norms = diff.norm(dim=1, keepdim=True)
        scale = torch.clamp(tau / norms.clamp_min(1e-30), max=1.0)
        v = v + (diff * scale).mean(dim=0)
    return v.float()


def build_aggregator(
    rule: Literal["mean", "trimmed_mean", "centered_clip"] = "mean",
    *,
    trim_fraction: float = 0.2,
    clip_tau: float = 1.0,
    clip_iterations: int = 5,
) -> Aggregator:
    """The reducer's combine function for ``swarm.aggregation``; robust rules need 3+ contributions."""
    if rule == "mean":
        return weighted_mean

    def aggregate(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        if len(tensors) < ROBUST_MIN_MEMBERS:
            return weighted_mean(tensors, weights)
        if rule == "trimmed_mean":
            return trimmed_mean(tensors, trim_fraction)
        return centered_clip(tensors, clip_tau, clip_iterations)

    if rule not in ("trimmed_mean", "centered_clip"):
        raise ValueError(f"unknown aggregation rule {rule!r}")
    return aggregate
