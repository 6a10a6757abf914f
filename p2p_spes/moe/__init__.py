"""The mixture-of-experts layer: router, expert storage, the torch and MegaBlocks backends, the GPU check.

One package so that the pieces import in one direction (router and expert storage <- backends <-
backend choice <- start-up check) with no cycle; ``from p2p_spes.moe import X`` is the public way in.
"""

from p2p_spes.moe.backend import build_moe, resolve_impl, torch_kernel_label
from p2p_spes.moe.experts import MATRICES, SwiGLUExperts, uses_grouped_mm
from p2p_spes.moe.megablocks import MegaBlocksAPI, MegaBlocksMoE, import_megablocks, megablocks_available
from p2p_spes.moe.router import Router, RouterStats, resident_weights, routing_stats
from p2p_spes.moe.selfcheck import BackendChoice, choose_backend
from p2p_spes.moe.torch_backend import ExpertContainer, TorchMoE

__all__ = [
    "MATRICES",
    "BackendChoice",
    "ExpertContainer",
    "MegaBlocksAPI",
    "MegaBlocksMoE",
    "Router",
    "RouterStats",
    "SwiGLUExperts",
    "TorchMoE",
    "build_moe",
    "choose_backend",
    "import_megablocks",
    "megablocks_available",
    "resident_weights",
    "resolve_impl",
    "routing_stats",
    "torch_kernel_label",
    "uses_grouped_mm",
]
