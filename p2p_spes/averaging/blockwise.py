"""Blocks of values with one fp16 scale each: what the dense int codecs and top-k share (compression.py)."""

from __future__ import annotations

import torch

from p2p_spes.averaging.transport import TransportError

BLOCK = 256
FP16_MAX = 65504.0
MIN_SCALE = 2.0**-14  # fp16's smallest normal: scales never underflow to zero or subnormals


def block_count(numel: int, size: int = BLOCK) -> int:
    """How many blocks of ``size`` hold ``numel`` values (the last one may be short)."""
    return -(-numel // size)


def as_blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` (flat) as rows of :data:`BLOCK`, zero-padded."""
    out = torch.zeros(block_count(x.numel()) * BLOCK, dtype=torch.float32)
    out[: x.numel()] = x
    return out.view(-1, BLOCK)


def keep_mask(numel: int, k: int, size: int = BLOCK) -> torch.Tensor:
    """Which of the ``blocks x k`` slots of a top-k message are real (blocks of ``size``: topk's, or
    sparse's chunks), flat: the last block keeps at most its own length."""
    blocks, rest = block_count(numel, size), numel % size
    mask = torch.ones(blocks, k, dtype=torch.bool)
    if rest and rest < k:
        mask[-1, rest:] = False
    return mask.reshape(-1)


def block_scales(absmax: torch.Tensor, top: float) -> torch.Tensor:
    """fp16 per-block scales for values up to ``absmax`` over ``top`` levels (never zero, never inf)."""
    return (absmax / top).clamp(MIN_SCALE, FP16_MAX).half()


def quantize(x: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (flat) as fp16 block scales and int8 levels in ``-top .. top`` (int8: 127, int4: 7)."""
    rows = as_blocks(x)
    scales = block_scales(rows.abs().amax(dim=1), top)
    q = torch.round(rows / scales.float()[:, None]).clamp(-top, top).to(torch.int8).reshape(-1)[: x.numel()]
    return scales, q


def read_scales(body: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A message body's fp16 block scales (checked: finite, not negative) and the bytes after them."""
    cut = 2 * block_count(numel)
    scales = body[:cut].view(torch.float16).float()
    if not torch.isfinite(scales).all() or (scales < 0).any():
        raise TransportError("compressed message has invalid block scales")
    return scales, body[cut:]


def dequantize(q: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 values of levels ``q`` times their block's scale."""
    rows = torch.zeros(block_count(numel) * BLOCK)
    rows[:numel] = q.float()
    return (rows.view(-1, BLOCK) * scales[:, None]).reshape(-1)[:numel].contiguous()
