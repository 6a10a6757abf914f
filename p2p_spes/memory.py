"""Per-peer memory accounting: bytes of parameters, gradients and optimizer state.

Split into shared parameters, local experts (trained here) and frozen experts (held for the
forward pass only), because the point of expert subsets is that the last group costs no
gradient and no optimizer state.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from p2p_spes.config import TrainConfig
from p2p_spes.optim import optimizer_moments

GROUPS = ("shared", "local_experts", "frozen_experts")


@dataclass
class MemoryReport:
    parameters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GROUPS, 0))
    gradients: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GROUPS, 0))
    optimizer: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GROUPS, 0))

    @property
    def total(self) -> int:
        return sum(sum(d.values()) for d in (self.parameters, self.gradients, self.optimizer))

    def to_dict(self) -> dict:
        out = asdict(self)
        out["total"] = self.total
        return out


@dataclass
class SyncMemory:
    """What syncing keeps per peer, in host memory (``device``), never on the accelerator: the anchors
    (last agreed value of the shared parameters and of each trained expert), the Nesterov momentum,
    the error-feedback residuals of what our messages dropped, and a reducer's residual of its slices."""

    anchors: int = 0
    momentum: int = 0
    residuals: int = 0
    reducer_residuals: int = 0
    device: str = "cpu"

    @property
    def total(self) -> int:
        return self.anchors + self.momentum + self.residuals + self.reducer_residuals

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def _group_of(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if ".experts." in name and leaf.startswith("frozen_"):
        return "frozen_experts"
    if ".experts." in name:
        return "local_experts"
    return "shared"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def measure_memory(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
    """Bytes actually allocated by the model's tensors, their gradients and the optimizer state."""
    report = MemoryReport()
    names = {id(p): n for n, p in model.named_parameters()}
    for name, p in model.named_parameters():
        report.parameters[_group_of(name)] += _nbytes(p)
        if p.grad is not None:
            report.gradients[_group_of(name)] += _nbytes(p.grad)
    for name, b in model.named_buffers():
        if _group_of(name) == "frozen_experts":
            report.parameters["frozen_experts"] += _nbytes(b)
    if optimizer is not None:
        for p, state in optimizer.state.items():
            group = _group_of(names.get(id(p), ""))
            for key, value in state.items():
                if torch.is_tensor(value) and key != "step":
                    report.optimizer[group] += _nbytes(value)
    return report


def expected_memory(
    model: nn.Module, train: TrainConfig | None = None, grad_bytes_per_element: int | None = None
) -> MemoryReport:
    """Bytes a model *will* use, from shapes alone (works on the ``meta`` device).

    Trainable parameters get a gradient of their own dtype (or ``grad_bytes_per_element``) and the
    fp32 state of ``train.optimizer`` (the default config's when ``train`` is None): AdamW keeps two
    moments, Muon one momentum for the hidden matrices. Frozen experts get neither.
    """
    train = train or TrainConfig()
    report = MemoryReport()
    for name, p in model.named_parameters():
        group = _group_of(name)
        report.parameters[group] += _nbytes(p)
        report.gradients[group] += p.numel() * (grad_bytes_per_element or p.element_size())
        report.optimizer[group] += optimizer_moments(name, p, train) * p.numel() * 4
    for name, b in model.named_buffers():
        if _group_of(name) == "frozen_experts":
            report.parameters["frozen_experts"] += _nbytes(b)
    return report
