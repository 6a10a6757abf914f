"""The softmax top-k router and the routing statistics both MoE backends report.

The statistics live here, apart from either backend, because the model's auxiliary losses (the
MegaBlocks load-balance loss and the router z-loss, docs/method.md) must not depend on which backend
ran: the torch backend and the MegaBlocks adapter compute them with :func:`routing_stats` from the
router's own logits, so the two agree in train and eval mode and for any loss weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class RouterStats:
    """Per-layer routing statistics of one forward pass."""

    tokens_per_expert: torch.Tensor  # (E,) float, no grad: how many (token, slot) pairs chose e
    mean_probs: torch.Tensor  # (E,) mean router probability over tokens, with grad
    router_z: torch.Tensor  # scalar, mean_t logsumexp(logits)^2, with grad
    num_tokens: int
    skip_rate: float = 0.0  # fraction of (token, slot) pairs routed to experts not resident here


def routing_stats(
    logits: torch.Tensor, probs: torch.Tensor, top_experts: torch.Tensor, num_experts: int, skip_rate: float = 0.0
) -> RouterStats:
    """The statistics of one routing decision.

    ``logits`` and ``probs`` are (T, E) (any float dtype; the statistics are fp32), ``top_experts``
    holds the chosen expert ids of every token, (T, k) or flattened.
    """
    return RouterStats(
        tokens_per_expert=torch.bincount(top_experts.reshape(-1), minlength=num_experts).float(),
        mean_probs=probs.float().mean(dim=0),
        router_z=torch.logsumexp(logits.float(), dim=-1).pow(2).mean(),
        num_tokens=logits.shape[0],
        skip_rate=skip_rate,
    )


def resident_weights(top_w: torch.Tensor, resident: torch.Tensor) -> torch.Tensor:
    """The partial-residency skip rule on one token's top-k weights (rows of ``top_w``).

    Selected experts that are not resident are dropped and the resident ones are rescaled so that
    they carry the token's whole top-k weight mass: ``w_i * sum_j w_j / sum_{j resident} w_j``
    (so they sum to 1 when ``normalize_top_k``, else to the softmax mass of the top k). A token
    none of whose top-k experts is resident gets all-zero weights: its MoE output is zero and the
    residual passes through. With every expert resident the weights are unchanged.
    """
    kept = top_w * resident
    kept_mass = kept.sum(dim=-1, keepdim=True)
    scale = torch.where(kept_mass > 0, top_w.sum(dim=-1, keepdim=True) / kept_mass.clamp_min(1e-30), 0.0)
    return kept * scale


class Router(nn.Module):
    """``layer`` is named as in MegaBlocks' LearnedRouter so checkpoints interchange."""

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.layer = nn.Linear(d_model, num_experts, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits (T, E) of the tokens ``x`` (T, H)."""
        return self.layer(x).float()
