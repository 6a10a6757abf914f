"""Which MoE backend a layer is built with: ``moe.impl`` and ``moe.torch_kernel`` resolved for a device.

Kept apart from the backends so that neither imports the other: this module knows both, they know
only the router and the expert storage. The start-up check that may change the choice on a GPU is
``selfcheck.py``; this module only applies a configuration.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from p2p_spes.config import MoEConfig
from p2p_spes.errors import BackendError
from p2p_spes.moe.experts import uses_grouped_mm
from p2p_spes.moe.megablocks import MegaBlocksMoE, megablocks_available
from p2p_spes.moe.torch_backend import TorchMoE


def resolve_impl(cfg: MoEConfig, device: torch.device, resident_only: bool = False) -> str:
    """``auto`` picks MegaBlocks on CUDA when it is installed, else the torch backend.

    Partial residency (``resident_only``) needs the torch backend, so ``auto`` takes it then.
    """
    if cfg.impl in ("torch", "megablocks"):
        return cfg.impl
    if device.type == "cuda" and not resident_only and megablocks_available():
        return "megablocks"
    return "torch"


def torch_kernel_label(cfg: MoEConfig, d_model: int, device: torch.device) -> str:
    """The expert kernel the torch backend runs for ``cfg.torch_kernel`` here: ``grouped_mm`` or ``loop``.

    The model's parameters (and so the rows the experts see) are fp32; autocast does the rest.
    """
    on_cuda = device.type == "cuda"
    return "grouped_mm" if uses_grouped_mm(cfg.torch_kernel, d_model, cfg.ffn_dim, torch.float32, on_cuda) else "loop"


def build_moe(
    cfg: MoEConfig,
    d_model: int,
    local_experts: Sequence[int] | None,
    device: torch.device,
    resident_only: bool = False,
) -> nn.Module:
    """One MoE layer of the backend ``cfg`` resolves to on ``device``."""
    impl = resolve_impl(cfg, device, resident_only)
    if impl == "megablocks" and resident_only:
        raise BackendError(
            "swarm.residency: partial needs the torch MoE backend (the MegaBlocks adapter keeps every "
            "expert resident); set moe.impl: torch or swarm.residency: full"
        )
    if impl == "megablocks":
        return MegaBlocksMoE(cfg, d_model, local_experts, device=device)
    if impl != "torch":
        raise BackendError(f"unknown moe.impl {impl!r}")
    return TorchMoE(cfg, d_model, local_experts, device=device, resident_only=resident_only)
