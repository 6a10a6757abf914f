"""AdamW over the trainable parameters only, and the cosine schedule with linear warmup."""

from __future__ import annotations

import math

import torch
from torch import nn

from p2p_spes.config import TrainConfig


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Shared parameters and local experts; frozen experts are buffers and never appear here."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def parameter_groups(model: nn.Module, cfg: TrainConfig) -> list[dict]:
    """Weight decay on matrices, none on norm weights."""
    params = trainable_parameters(model)
    decay = [p for _, p in params if p.ndim >= 2]
    no_decay = [p for _, p in params if p.ndim < 2]
    return [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and none on norm weights."""
    return torch.optim.AdamW(parameter_groups(model, cfg), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


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
