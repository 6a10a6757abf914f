"""Pick the micro-batch a device can hold, keeping the run's tokens per step (batch x grad_accum).

Weights, gradients and optimizer state come from ``memory.expected_memory`` on a ``meta`` model (the
peer's real expert split); activations from a per-token count of what the backward pass keeps
(fp32, eager attention: an over-estimate on GPUs with fused attention or bf16). Only a fraction of
the free memory is planned for, leaving room for the allocator and the sync buffers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from p2p_spes.config import Config
from p2p_spes.device import resolve_device
from p2p_spes.errors import ConfigError
from p2p_spes.memory import expected_memory
from p2p_spes.model import MoETransformer


@dataclass
class BatchPlan:
    device: str
    free_bytes: int
    static_bytes: int  # weights + gradients + optimizer state
    bytes_per_sample: int  # activations of one sequence
    batch_size: int
    grad_accum: int

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        gb = 1e9
        return (
            f"batch {self.batch_size} x {self.grad_accum} accumulation step(s) on {self.device}: "
            f"{self.free_bytes / gb:.1f} GB free, model and optimizer {self.static_bytes / gb:.2f} GB, "
            f"{self.bytes_per_sample / gb:.3f} GB per sequence"
        )


def free_memory(device: str) -> int:
    """Bytes free on ``device`` now: CUDA's free memory, or the RAM the OS reports available."""
    resolved = resolve_device(device)
    if resolved.type == "cuda":
        return int(torch.cuda.mem_get_info(resolved)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def static_bytes(cfg: Config) -> int:
    """Weights, gradients and optimizer state of a swarm peer that trains its share of the experts."""

    local = max(cfg.experts_per_partition(p) for p in range(cfg.peer.count))  # the largest share a peer gets
    model = MoETransformer(cfg.model, cfg.moe, local_experts=list(range(local)), device="meta")
    return expected_memory(model, cfg.train).total


def activation_bytes_per_sample(cfg: Config) -> int:
    """fp32 activations kept for backward for one sequence (attention scores, routed copies, logits)."""
    m, moe = cfg.model, cfg.moe
    d, seq, k, f = m.d_model, m.max_seq_len, moe.top_k, moe.ffn_dim
    per_token_layer = 12 * d + m.num_heads * seq + moe.num_experts + k * (2 * d + 4 * f)
    per_token = m.num_layers * per_token_layer + 3 * m.vocab_size
    return 4 * seq * per_token


def fit_batch(cfg: Config, free_bytes: int, device: str = "cpu", fraction: float = 0.8) -> BatchPlan:
    """The largest divisor ``b`` of batch_size*grad_accum whose activations fit; grad_accum makes up the rest."""
    if not 0 < fraction <= 1:
        raise ConfigError(f"memory fraction must be in (0, 1], got {fraction}")
    total = cfg.train.batch_size * cfg.train.grad_accum
    fixed = static_bytes(cfg)
    per_sample = activation_bytes_per_sample(cfg)
    room = int(free_bytes * fraction) - fixed
    if room < per_sample:
        raise ConfigError(
            f"{device} has {free_bytes / 1e9:.1f} GB free; this run needs about {(fixed + per_sample) / 1e9 / fraction:.1f} GB "
            "for one sequence (weights, gradients, optimizer state and activations). Free memory, or use a bigger device"
        )
    fits = room // per_sample
    batch = max(b for b in range(1, total + 1) if total % b == 0 and b <= fits)
    return BatchPlan(device, int(free_bytes), fixed, per_sample, batch, total // batch)
