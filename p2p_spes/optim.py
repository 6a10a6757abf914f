"""AdamW over the trainable parameters only (optionally with the second moment a swarm's average sees),
and the cosine schedule with linear warmup."""

from __future__ import annotations

import math

import torch
from torch import nn

from p2p_spes.config import TrainConfig


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Shared parameters and local experts; frozen experts are buffers and never appear here."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


class PooledNoiseAdamW(torch.optim.Optimizer):
    """AdamW whose step is scaled by the second moment of a gradient averaged over ``peers`` batches.

    A peer's AdamW divides by the root of its own ``E[g^2]``: signal squared plus its batch's noise
    variance. When P peers' steps are averaged, the noise in their first moments averages out but each
    step was already shrunk by its own noise, so coordinates where noise dominates move up to sqrt(P)
    times less than under one AdamW on the P batches' mean gradient (``benchmarks/local_steps.py``:
    that difference alone costs more than the averaging interval). Here the noise part of the second
    moment, estimated as ``v - m^2`` (bias-corrected), is divided by ``peers``; with ``peers`` = 1 it is
    AdamW exactly. The state keeps AdamW's names (``exp_avg``, ``exp_avg_sq``, ``step``), so
    checkpoints and moment averaging read it the same way.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, peers: float = 1.0) -> None:
        if peers < 1:
            raise ValueError(f"peers must be at least 1, got {peers}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "peers": peers})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, peers = group["lr"], group["eps"], float(group["peers"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                p.mul_(1 - lr * group["weight_decay"])
                m_hat = m / (1 - beta1**t)
                v_hat = v / (1 - beta2**t)
                if peers > 1:
                    signal = m_hat.square()
                    v_hat = signal.add_((v_hat - signal).clamp_(min=0).div_(peers))
                p.addcdiv_(m_hat, v_hat.sqrt_().add_(eps), value=-lr)
        return loss


def build_optimizer(model: nn.Module, cfg: TrainConfig, peers: float = 1.0) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices and none on norm weights; with ``peers`` > 1, the step a
    gradient averaged over that many peers' batches would take (:class:`PooledNoiseAdamW`)."""
    params = trainable_parameters(model)
    decay = [p for _, p in params if p.ndim >= 2]
    no_decay = [p for _, p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if peers > 1:
        return PooledNoiseAdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, peers=peers)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at ``max_steps``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.max_steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
