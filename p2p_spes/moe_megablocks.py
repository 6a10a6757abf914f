"""MegaBlocks backend: MegaBlocks' router and token permutation, our expert weight storage.

MegaBlocks' ``dMoE`` keeps each expert matrix as one fused ``(E*F, H)`` parameter, which would
allocate gradients and Adam moments for every expert. We keep its CUDA routing and permutation
(``grouped`` implementation; ``sparse`` refuses triton >= 3.2) and swap ``experts.mlp`` for
:class:`SwiGLUExperts`, whose local/frozen split makes gradient and optimizer memory scale with
the local experts. Weight names (``router.layer.weight``, ``experts.mlp.{w1,v1,w2}``) are the
same as the torch backend's, so checkpoints interchange.
"""

from __future__ import annotations

import importlib.util
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from p2p_spes.config import MoEConfig
from p2p_spes.errors import BackendError
from p2p_spes.experts import SwiGLUExperts
from p2p_spes.moe import RouterStats

INSTALL_HINT = (
    "install it on a CUDA machine with `pip install 'p2p-spes[gpu]'`, or set moe.impl=torch to use the "
    "pure-PyTorch backend"
)


def megablocks_available() -> bool:
    return importlib.util.find_spec("megablocks") is not None


class ExpertOrderSwiGLU(SwiGLUExperts):
    """Takes rows MegaBlocks sorted by expert id (its ``mlp(x, tokens_per_expert)`` call).

    Our storage wants rows grouped by slot (local experts first); when the local experts are not
    the leading ids, rows are permuted into slot order and back.
    """

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        counts = tokens_per_expert.to(x.device).long()
        if self.local_ids == list(range(self.num_local)):
            return super().forward(x, counts)
        expert_of_row = torch.repeat_interleave(torch.arange(self.num_experts, device=x.device), counts)
        order = torch.argsort(self.slot_of_expert[expert_of_row], stable=True)
        counts_per_slot = torch.zeros_like(counts).index_add_(0, self.slot_of_expert, counts)
        out_sorted = super().forward(x[order], counts_per_slot)
        return torch.empty_like(out_sorted).index_copy_(0, order, out_sorted)


class MegaBlocksMoE(nn.Module):
    """``dMoE`` with GLU experts on CUDA, exposing the torch backend's interface."""

    def __init__(self, cfg: MoEConfig, d_model: int, local_experts: Sequence[int] | None = None, device=None) -> None:
        super().__init__()
        if not megablocks_available():
            raise BackendError(f"moe.impl=megablocks was requested but MegaBlocks is not importable: {INSTALL_HINT}")
        device = torch.device(device or "cuda")
        if device.type != "cuda":
            raise BackendError(
                f"moe.impl=megablocks needs a CUDA device, got {device}; set moe.impl=torch (or auto) on this machine"
            )
        from megablocks.layers.arguments import Arguments
        from megablocks.layers.dmoe import dMoE

        args = Arguments(
            hidden_size=d_model,
            ffn_hidden_size=cfg.ffn_dim,
            moe_num_experts=cfg.num_experts,
            moe_top_k=cfg.top_k,
            mlp_type="glu",
            mlp_impl="grouped",
            activation_fn=F.silu,
            moe_normalize_expert_weights=1 if cfg.normalize_top_k else None,
            moe_loss_weight=cfg.lb_loss_weight,
            moe_zloss_weight=cfg.router_z_loss_weight,
            bias=False,
            return_bias=False,
            device=device,
        )
        self.args = args
        self.num_experts = cfg.num_experts
        inner = dMoE(args)
        self.router = inner.router
        self.experts = inner.experts
        self.experts.mlp = ExpertOrderSwiGLU(
            cfg.num_experts, d_model, cfg.ffn_dim, local_experts, kernel="grouped_mm", device=device
        )
        self._inner = [inner]  # not a submodule: its parameters are ours, reached via router/experts

    @property
    def expert_weights(self) -> SwiGLUExperts:
        return self.experts.mlp

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        from megablocks.layers import moe as mb_moe
        from megablocks.layers import router as mb_router

        out = self._inner[0](x)
        if isinstance(out, tuple):
            out = out[0]
        tokens_per_expert, scores = mb_moe.get_load_balancing_loss()[-1]
        logits = mb_router._ROUTER_LOGITS[-1]
        mb_moe.clear_load_balancing_loss()
        mb_router.clear_router_zloss()
        stats = RouterStats(
            tokens_per_expert=tokens_per_expert.detach().float(),
            mean_probs=scores.float().mean(dim=0),
            router_z=torch.logsumexp(logits.float(), dim=-1).pow(2).mean(),
            num_tokens=scores.shape[0],
        )
        return out, stats
