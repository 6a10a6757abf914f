"""SPES warm-up expert merging: pull each expert toward its most similar neighbours, early on.

At sync rounds that are multiples of ``merge_interval``, for every MoE layer and expert i:
``theta_i <- (1 - alpha) * theta_i + alpha * mean_{j in top4(i)} theta_j`` where ``top4(i)`` are the
other experts whose ``w1`` is most cosine-similar to expert i's, applied to w1, v1 and w2 each with
its own kind and computed from the pre-merge values. ``alpha`` decays linearly to zero over
``decay_steps``. The reference concatenates the matrices in hash order; here each kind is explicit.

Every peer holds every expert at the round's version, so every peer computes the same merge and
nothing travels.
"""

from __future__ import annotations

import torch

from p2p_spes.moe import MATRICES, SwiGLUExperts


def merge_alpha(step: int, alpha_start: float, decay_steps: int) -> float:
    return alpha_start * (1.0 - min(step / max(decay_steps, 1), 1.0))


def neighbours(w1: torch.Tensor, k: int = 4) -> torch.Tensor:
    """Indices (E, min(k, E-1)) of each expert's most cosine-similar other experts by ``w1``."""
    flat = torch.nn.functional.normalize(w1.reshape(w1.shape[0], -1).double(), dim=-1)
    sim = flat @ flat.T
    sim.fill_diagonal_(-float("inf"))
    k = min(k, w1.shape[0] - 1)
    return sim.topk(k, dim=-1).indices


@torch.no_grad()
def merge_layer(experts: SwiGLUExperts, alpha: float, k: int = 4) -> None:
    """Merge one layer's experts in place (local and frozen copies alike)."""
    if alpha <= 0 or experts.num_experts < 2:
        return
    stacked = {name: experts.stacked(name) for name in MATRICES}
    idx = neighbours(stacked["w1"], k)
    for name, value in stacked.items():
        neighbour_mean = torch.stack([value[row].mean(dim=0) for row in idx])
        experts.load_stacked(name, (1 - alpha) * value + alpha * neighbour_mean)


def merge_experts(model: torch.nn.Module, alpha: float, k: int = 4) -> None:
    """Apply the warm-up merge to every MoE layer of ``model``."""
    for experts in model.expert_modules():
        merge_layer(experts, alpha, k)
