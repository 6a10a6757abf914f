"""The mixture-of-experts layer: softmax top-k router, dropless dispatch, auxiliary losses.

Two backends share one interface and one weight layout (MegaBlocks'): ``torch`` (this file,
runs anywhere) and ``megablocks`` (``moe_megablocks.py``, CUDA). ``forward(x)`` returns the
layer output and a :class:`RouterStats` from which the model computes the MegaBlocks
load-balance and router z-losses (see SPEC.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from p2p_spes.config import MoEConfig
from p2p_spes.errors import BackendError
from p2p_spes.experts import SwiGLUExperts


@dataclass
class RouterStats:
    """Per-layer routing statistics of one forward pass."""

    tokens_per_expert: torch.Tensor  # (E,) float, no grad: how many (token, slot) pairs chose e
    mean_probs: torch.Tensor  # (E,) mean router probability over tokens, with grad
    router_z: torch.Tensor  # scalar, mean_t logsumexp(logits)^2, with grad
    num_tokens: int
    skip_rate: float = 0.0  # fraction of (token, slot) pairs routed to experts not resident here


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

    def __init__(self, d_model: int, num_experts: int, device=None, dtype=None) -> None:
        super().__init__()
        self.layer = nn.Linear(d_model, num_experts, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).float()


class ExpertContainer(nn.Module):
    """Holds ``mlp`` so the weight names are ``experts.mlp.w1`` as in MegaBlocks' dMoE."""

    def __init__(self, mlp: SwiGLUExperts) -> None:
        super().__init__()
        self.mlp = mlp


class TorchMoE(nn.Module):
    """Dropless top-k MoE in plain PyTorch (CPU or CUDA)."""

    def __init__(self, cfg: MoEConfig, d_model: int, local_experts: Sequence[int] | None = None, device=None,
                 resident_only: bool = False) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.normalize = cfg.num_experts, cfg.top_k, cfg.normalize_top_k
        self.router = Router(d_model, cfg.num_experts, device=device)
        self.experts = ExpertContainer(
            SwiGLUExperts(cfg.num_experts, d_model, cfg.ffn_dim, local_experts, kernel=cfg.torch_kernel, device=device,
                          resident_only=resident_only)
        )

    @property
    def expert_weights(self) -> SwiGLUExperts:
        return self.experts.mlp

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = self.router(tokens)
        probs = logits.softmax(dim=-1)
        top_w, top_i = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)

        flat_expert = top_i.reshape(-1)
        store = self.expert_weights
        slots = store.slot_of_expert[flat_expert]
        skip_rate = 0.0
        if store.absent_ids:
            resident = (slots >= 0).view_as(top_i)
            skip_rate = 1.0 - float(resident.float().mean()) if resident.numel() else 0.0
            top_w = resident_weights(top_w, resident)
        kept = torch.nonzero(slots >= 0).squeeze(-1)
        order = kept[torch.argsort(slots[kept], stable=True)]
        token_of_row = order // self.top_k
        counts_per_slot = torch.bincount(slots[kept], minlength=store.num_slots)
        rows = store(tokens[token_of_row], counts_per_slot)
        weighted = rows * top_w.reshape(-1)[order].unsqueeze(-1).to(rows.dtype)
        out = torch.zeros_like(tokens, dtype=rows.dtype).index_add_(0, token_of_row, weighted)

        stats = RouterStats(
            tokens_per_expert=torch.bincount(flat_expert, minlength=self.num_experts).float(),
            mean_probs=probs.mean(dim=0),
            router_z=torch.logsumexp(logits, dim=-1).pow(2).mean(),
            num_tokens=tokens.shape[0],
            skip_rate=skip_rate,
        )
        return out.reshape(shape).to(x.dtype), stats


def resolve_impl(cfg: MoEConfig, device: torch.device) -> str:
    """``auto`` picks MegaBlocks on CUDA when it imports, else the torch backend."""
    if cfg.impl == "torch":
        return "torch"
    if cfg.impl == "megablocks":
        return "megablocks"
    if device.type == "cuda":
        from p2p_spes.moe_megablocks import megablocks_available

        if megablocks_available():
            return "megablocks"
    return "torch"


def build_moe(
    cfg: MoEConfig, d_model: int, local_experts: Sequence[int] | None, device: torch.device,
    resident_only: bool = False,
) -> nn.Module:
    impl = resolve_impl(cfg, device)
    if impl == "megablocks" and resident_only:
        raise BackendError(
            "swarm.residency: partial needs the torch MoE backend (the MegaBlocks adapter keeps every "
            "expert resident); set moe.impl: torch or swarm.residency: full"
        )
    if impl == "megablocks":
        from p2p_spes.moe_megablocks import MegaBlocksMoE

        return MegaBlocksMoE(cfg, d_model, local_experts, device=device)
    if impl != "torch":
        raise BackendError(f"unknown moe.impl {impl!r}")
    return TorchMoE(cfg, d_model, local_experts, device=device, resident_only=resident_only)
