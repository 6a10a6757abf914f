"""MegaBlocks backend: MegaBlocks' router and token permutation, our expert weight storage.

Why an adapter: MegaBlocks' ``dMoE`` keeps each expert matrix as one fused ``(E*F, H)`` parameter,
which would allocate gradients and optimizer state for every expert. We keep its CUDA routing and
permutation (``grouped`` implementation; ``sparse`` refuses triton >= 3.2) and swap ``experts.mlp``
for :class:`SwiGLUExperts`, whose local/frozen split makes gradient and optimizer memory scale with
the local experts. Weight names (``router.layer.weight``, ``experts.mlp.{w1,v1,w2}``) are the torch
backend's, so checkpoints interchange.

Routing statistics. MegaBlocks 0.10.0 keeps its statistics in module-global lists, and only some of
the time: ``ParallelMLP.forward`` (``megablocks/layers/moe.py``) appends ``(tokens_per_expert,
scores)`` to ``_LOAD_BALANCING_LOSS`` only ``if self.training and args.moe_loss_weight > 0``, and
``LearnedRouter.forward`` (``megablocks/layers/router.py``) appends the logits to ``_ROUTER_LOGITS``
only when ``args.moe_zloss_weight != 0``. Reading them would fail in eval mode and for zero loss
weights, and what is kept there holds the autograd graph until someone clears it. So the adapter
gives MegaBlocks zero loss weights (it keeps nothing), records the router's logits and decisions
with forward hooks during its own call, computes :class:`RouterStats` from them exactly as the torch
backend does, and clears both global lists after every call, also when the call raises.

The ``megablocks`` package is imported in one place, :func:`import_megablocks`; a test hands the
adapter a stand-in API (``api=``) to check this contract on the CPU.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from p2p_spes.config import MoEConfig
from p2p_spes.errors import BackendError
from p2p_spes.moe.experts import SwiGLUExperts
from p2p_spes.moe.router import RouterStats, routing_stats

INSTALL_HINT = (
    "install it on a CUDA machine with `pip install 'p2p-spes[gpu]'`, or set moe.impl=torch to use the "
    "pure-PyTorch backend"
)


def megablocks_available() -> bool:
    """Whether a ``megablocks`` package is installed (importing it may still fail)."""
    return importlib.util.find_spec("megablocks") is not None


@dataclass(frozen=True)
class MegaBlocksAPI:
    """The parts of MegaBlocks 0.10.0 the adapter uses."""

    arguments: ModuleType  # megablocks.layers.arguments: Arguments
    dmoe: ModuleType  # megablocks.layers.dmoe: dMoE
    moe: ModuleType  # megablocks.layers.moe: _LOAD_BALANCING_LOSS, clear_load_balancing_loss
    router: ModuleType  # megablocks.layers.router: _ROUTER_LOGITS, clear_router_zloss

    def __deepcopy__(self, memo: dict) -> MegaBlocksAPI:
        return self  # modules are not copyable; a deep copy of the model (peer.py's shadow) shares them

    def clear_global_state(self) -> None:
        """Empty MegaBlocks' module-global statistics lists."""
        self.moe.clear_load_balancing_loss()
        self.router.clear_router_zloss()


def import_megablocks() -> MegaBlocksAPI:
    """Import the MegaBlocks modules the adapter needs.

    The import is deferred to this function because ``megablocks`` is an optional, CUDA-only
    dependency (``p2p-spes[gpu]``) that the rest of the package must run without.
    """
    try:
        names = ("arguments", "dmoe", "moe", "router")
        modules = [importlib.import_module(f"megablocks.layers.{name}") for name in names]
    except (ImportError, OSError) as exc:
        raise BackendError(f"moe.impl=megablocks: MegaBlocks does not import ({exc}); {INSTALL_HINT}") from exc
    return MegaBlocksAPI(*modules)


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


def megablocks_arguments(api: MegaBlocksAPI, cfg: MoEConfig, d_model: int, device: torch.device) -> Any:
    """MegaBlocks ``Arguments`` for a dropless GLU MoE that keeps no statistics of its own."""
    return api.arguments.Arguments(
        hidden_size=d_model,
        ffn_hidden_size=cfg.ffn_dim,
        moe_num_experts=cfg.num_experts,
        moe_top_k=cfg.top_k,
        mlp_type="glu",
        mlp_impl="grouped",
        activation_fn=F.silu,
        moe_normalize_expert_weights=1 if cfg.normalize_top_k else None,
        # Our losses are computed from RouterStats (model.auxiliary_losses); with these at 0 MegaBlocks
        # appends nothing to its global lists, so nothing there holds activations between steps.
        moe_loss_weight=0.0,
        moe_zloss_weight=0.0,
        bias=False,
        return_bias=False,
        # Arguments defaults to fp16=True, which would make the router weight fp16; ours is fp32 (the
        # torch backend's), with autocast deciding the compute dtype.
        fp16=False,
        bf16=False,
        device=device,
    )


class MegaBlocksMoE(nn.Module):
    """``dMoE`` with GLU experts on CUDA, exposing the torch backend's interface.

    ``api``: the MegaBlocks modules to use; by default the installed package, which needs CUDA. A
    test passes a CPU stand-in here (the only way to build the adapter off a GPU).
    """

    def __init__(
        self,
        cfg: MoEConfig,
        d_model: int,
        local_experts: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        api: MegaBlocksAPI | None = None,
    ) -> None:
        super().__init__()
        device = torch.device(device or "cuda")
        if api is None:
            if not megablocks_available():
                raise BackendError(
                    f"moe.impl=megablocks was requested but MegaBlocks is not importable: {INSTALL_HINT}"
                )
            if device.type != "cuda":
                raise BackendError(
                    f"moe.impl=megablocks needs a CUDA device, got {device}; set moe.impl=torch (or auto) on this "
                    "machine"
                )
            api = import_megablocks()
        self.api = api
        self.num_experts = cfg.num_experts
        inner = api.dmoe.dMoE(megablocks_arguments(api, cfg, d_model, device))
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
        seen: dict[str, Any] = {}

        def keep(key: str):
            def hook(module: nn.Module, args: tuple, output: Any) -> None:
                seen[key] = output

            return hook

        hooks = [
            self.router.layer.register_forward_hook(keep("logits")),  # (T, E), before the softmax
            self.router.register_forward_hook(keep("routing")),  # (scores, expert_weights, top_experts)
        ]
        try:
            out = self._inner[0](x)
        finally:
            for handle in hooks:
                handle.remove()
            self.api.clear_global_state()
        if isinstance(out, tuple):  # (out, bias) when MegaBlocks is asked to return the bias
            out = out[0]
        if "routing" not in seen or "logits" not in seen:
            raise BackendError("the MegaBlocks dMoE did not call its router as MegaBlocks 0.10.0 does")
        scores, _, top_experts = seen["routing"]
        stats = routing_stats(seen["logits"], scores, top_experts, self.num_experts)
        return out.reshape(x.shape).to(x.dtype), stats
