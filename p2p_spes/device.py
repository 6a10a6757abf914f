"""Where a peer computes: ``train.device`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``) as a torch device."""

from __future__ import annotations

import torch

from p2p_spes.errors import ConfigError


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """``auto`` is the GPU when torch sees one, else the CPU. On a node of several processes
    (``local_rank`` given), ``auto`` and ``cuda`` mean this process's own GPU, which becomes torch's
    current device. Asking for CUDA where torch sees none is a :class:`ConfigError` naming the fix."""
    cuda = torch.cuda.is_available()
    if local_rank is not None and name in ("auto", "cuda") and cuda:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if name == "auto":
        return torch.device("cuda" if cuda else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not cuda:
        raise ConfigError(f"train.device={name} but CUDA is not available here; use train.device=auto or cpu")
    return device
