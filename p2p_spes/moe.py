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

    def __init__(self, cfg: MoEConfig, d_model: int, local_experts: Sequence[int] | None = None, device=None) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.normalize = cfg.num_experts, cfg.top_k, cfg.normalize_top_k
        self.router = Router(d_model, cfg.num_experts, device=device)
        self.experts = ExpertContainer(
            SwiGLUExperts(cfg.num_experts, d_model, cfg.ffn_dim, local_experts, kernel=cfg.torch_kernel, device=device)
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
        slots = self.expert_weights.slot_of_expert[flat_expert]
        order = torch.argsort(slots, stable=True)
        token_of_row = order // self.top_k
        counts_per_slot = torch.bincount(slots, minlength=self.num_experts)
        rows = self.expert_weights(tokens[token_of_row], counts_per_slot)
        weighted = rows * top_w.reshape(-1)[order].unsqueeze(-1).to(rows.dtype)
        out = torch.zeros_like(tokens, dtype=rows.dtype).index_add_(0, token_of_row, weighted)

        stats = RouterStats(
            tokens_per_expert=torch.bincount(flat_expert, minlength=self.num_experts).float(),
            mean_probs=probs.mean(dim=0),
            router_z=torch.logsumexp(logits, dim=-1).pow(2).mean(),
            num_tokens=tokens.shape[0],
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
    cfg: MoEConfig, d_model: int, local_experts: Sequence[int] | None, device: torch.device
) -> nn.Module:
    impl = resolve_impl(cfg, device)
    if impl == "megablocks":
        from p2p_spes.moe_megablocks import MegaBlocksMoE

        return MegaBlocksMoE(cfg, d_model, local_experts, device=device)
    if impl != "torch":
        raise BackendError(f"unknown moe.impl {impl!r}")
    return TorchMoE(cfg, d_model, local_experts, device=device)
