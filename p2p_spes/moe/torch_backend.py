"""The MoE layer in plain PyTorch: softmax top-k router, dropless dispatch, partial residency.

This backend runs anywhere (CPU or CUDA) and is the reference the MegaBlocks adapter and the
grouped_mm kernel are checked against at start-up (``selfcheck.py``). Its weight layout and names
are MegaBlocks' (``router.layer.weight``, ``experts.mlp.{w1,v1,w2}``), so the two backends load each
other's checkpoints. ``forward(x)`` returns the layer output and a :class:`RouterStats` from which
the model computes the load-balance and router z-losses (docs/method.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from p2p_spes.config import MoEConfig
from p2p_spes.moe.experts import SwiGLUExperts
from p2p_spes.moe.router import Router, RouterStats, resident_weights, routing_stats


class ExpertContainer(nn.Module):
    """Holds ``mlp`` so the weight names are ``experts.mlp.w1`` as in MegaBlocks' dMoE."""

    def __init__(self, mlp: SwiGLUExperts) -> None:
        super().__init__()
        self.mlp = mlp


class TorchMoE(nn.Module):
    """Dropless top-k MoE in plain PyTorch (CPU or CUDA)."""

    def __init__(
        self,
        cfg: MoEConfig,
        d_model: int,
        local_experts: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        resident_only: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.normalize = cfg.num_experts, cfg.top_k, cfg.normalize_top_k
        self.router = Router(d_model, cfg.num_experts, device=device)
        self.experts = ExpertContainer(
            SwiGLUExperts(
                cfg.num_experts,
                d_model,
                cfg.ffn_dim,
                local_experts,
                kernel=cfg.torch_kernel,
                device=device,
                resident_only=resident_only,
            )
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

        stats = routing_stats(logits, probs, flat_expert, self.num_experts, skip_rate=skip_rate)
        return out.reshape(shape).to(x.dtype), stats
