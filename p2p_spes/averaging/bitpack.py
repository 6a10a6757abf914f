"""Packing small unsigned integers into bytes, and tensors into ``bytes``: the codecs' bodies
(``compression.py``, ``sparse.py``). Little-endian and lowest bits first throughout, so a message packs
the same on every machine."""

from __future__ import annotations

import torch


def to_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of ``t`` (contiguous, native little-endian on every platform torch supports)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _padded(q: torch.Tensor, multiple: int) -> torch.Tensor:
    q = q.to(torch.uint8) if q.dtype != torch.int64 else q
    pad = (-q.numel()) % multiple
    return torch.cat([q, q.new_zeros(pad)]) if pad else q


def pack2(q: torch.Tensor) -> torch.Tensor:
    """2-bit values (0..3) four per byte, lowest bits first."""
    q = _padded(q.to(torch.uint8), 4).view(-1, 4)
    return q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)


def unpack2(packed: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack([(packed >> s) & 0x03 for s in (0, 2, 4, 6)], dim=1).reshape(-1)[:n]


def pack4(q: torch.Tensor) -> torch.Tensor:
    """4-bit values (0..15) two per byte, low nibble first."""
    q = _padded(q.to(torch.uint8), 2)
    return q[0::2] | (q[1::2] << 4)


def unpack4(packed: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:n]


def pack12(q: torch.Tensor) -> torch.Tensor:
    """12-bit values (0..4095) two in three bytes: the low 8 bits of the first, then its high 4 bits
    with the low 4 bits of the second, then the second's high 8 bits."""
    q = _padded(q.to(torch.int64), 2).view(-1, 2)
    a, b = q[:, 0], q[:, 1]
    return torch.stack([a & 0xFF, (a >> 8) | ((b & 0x0F) << 4), b >> 4], dim=1).reshape(-1).to(torch.uint8)


def unpack12(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` 12-bit values of ``packed`` (int64)."""
    t = packed.to(torch.int64).view(-1, 3)
    a = t[:, 0] | ((t[:, 1] & 0x0F) << 8)
    b = (t[:, 1] >> 4) | (t[:, 2] << 4)
    return torch.stack([a, b], dim=1).reshape(-1)[:n]


def pack12_bytes(n: int) -> int:
    """Bytes :func:`pack12` makes of ``n`` values."""
    return 3 * ((n + 1) // 2)
