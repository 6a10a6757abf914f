"""The ``sparse`` codec's bodies: chunked top-k at 2 bits a value, and the bundle a reducer serves.

A member's message keeps, in each chunk of :data:`CHUNK` values of its flat pseudo-gradient, the ``k``
largest magnitudes. Their positions go as 12-bit offsets in increasing order; their values as one of
four bins (strong or weak, negative or positive: a kept value is strong when its magnitude is at least
the chunk's mean kept magnitude), each decoded as the mean of the kept values that fell in it (four
fp32 means per chunk). A bin's mean is closer to its values than a fixed level times a scale, and
costs 16 bytes per 4,096 values.

A reducer does not average and re-encode its part (a second encoding drops most of what the members'
sum holds): it serves the members' messages as they came, in member order with their weights, as one
*bundle*. Every member decodes the same bytes to the same update: at each position, the weighted mean
of the values of the members that sent it, over their weights alone (a value one member of four sent is
not divided by four); a position a member kept at zero (a chunk with fewer than ``k`` non-zero values)
is not a vote. A bundle holds P messages, so a member receives P times a message's bytes: about P / 4
bits per value at 1/64, which grows with the group where an averaged part would not.

Body layouts (the 32-byte envelope, header and checksum, is ``compression.py``'s):

* message: ``4 x chunks`` fp32 bin means, then the positions of the kept values (12 bits each, two in
  three bytes), then their bins (2 bits each); a chunk keeps ``k``, the last one at most its length;
* bundle: per message its weight (fp64) and byte length (uint64), then the messages, whole (envelope
  included, so each is checked on its own).
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable, Sequence

import torch

from p2p_spes.averaging.bitpack import pack2, pack12, pack12_bytes, to_bytes, unpack2, unpack12
from p2p_spes.averaging.blockwise import keep_mask
from p2p_spes.averaging.transport import TransportError

CHUNK = 4096  # values per chunk: positions fit in 12 bits
_ENTRY = struct.Struct("<dQ")  # a bundle's table: weight, byte length of the message
MAX_SENDERS = 1024  # messages a bundle may hold (a flat group's members)


def chunks(numel: int) -> int:
    return -(-numel // CHUNK)


def kept(numel: int, k: int) -> int:
    """Values a message of ``numel`` keeps: ``k`` per full chunk, at most the last chunk's length."""
    full, rest = divmod(numel, CHUNK)
    return full * k + min(k, rest)


def body_bytes(numel: int, k: int) -> int:
    n = kept(numel, k)
    return 16 * chunks(numel) + pack12_bytes(n) + (n + 3) // 4


def encode(x: torch.Tensor, k: int) -> bytes:
    """The body of ``x`` (flat fp32, finite) at ``k`` values per chunk."""
    n, c = x.numel(), chunks(x.numel())
    rows = torch.zeros(c * CHUNK)
    rows[:n] = x
    rows = rows.view(c, CHUNK)
    score = rows.abs()
    score.view(-1)[n:] = -1.0  # padding ranks below every real value (a short last chunk names only its own)
    idx = score.topk(k, dim=1).indices.sort(dim=1).values
    vals = rows.gather(1, idx)
    mask = keep_mask(n, k, CHUNK).view(-1, k)
    mags = vals.abs() * mask
    threshold = mags.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True)
    strong = mags >= threshold
    # 0 strong -, 1 weak -, 2 weak +, 3 strong +. A chunk that keeps zeros gives them a bin of their own
    # (mean 0), so that they decode to 0, not to a weak value: one no other value uses, else bin 2 (its
    # positive values then all go to bin 3)
    q = torch.where(vals < 0, (~strong).long(), 2 + strong.long())
    zero = (vals == 0) & mask
    used = torch.zeros(c, 4).scatter_add_(1, q, (mask & ~zero).float()) > 0
    free = ~used.all(dim=1)
    merge = zero.any(dim=1) & ~free
    q = torch.where(merge[:, None] & (q == 2), 3, q)
    q = torch.where(zero, torch.where(free, (~used).float().argmax(dim=1), 2)[:, None], q)
    weight = mask.double()
    sums = torch.zeros(c, 4, dtype=torch.float64).scatter_add_(1, q, vals.double() * weight)
    counts = torch.zeros(c, 4, dtype=torch.float64).scatter_add_(1, q, weight)
    means = (sums / counts.clamp(min=1)).float()
    flat = mask.reshape(-1)
    return to_bytes(means) + to_bytes(pack12(idx.reshape(-1)[flat])) + to_bytes(pack2(q.reshape(-1)[flat]))


def decode_sparse(body: torch.Tensor, numel: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions (int64, increasing) and values (fp32) a message body holds; raises ``TransportError``
    when its positions or means do not check out. The body's length was checked by the caller."""
    c, n = chunks(numel), kept(numel, k)
    cut = 16 * c
    means = body[:cut].view(torch.float32).view(c, 4)
    if not torch.isfinite(means).all():
        raise TransportError("sparse message has invalid bin means")
    split = cut + pack12_bytes(n)
    offsets = unpack12(body[cut:split], n)
    bins = unpack2(body[split:], n).long()
    mask = keep_mask(numel, k, CHUNK).view(-1, k)
    slots = torch.zeros(c * k, dtype=torch.int64)
    slots[mask.reshape(-1)] = offsets
    slots = slots.view(c, k)
    if k > 1 and ((slots[:, 1:] <= slots[:, :-1]) & mask[:, 1:]).any():
        raise TransportError("sparse message has positions out of order or repeated")
    lengths = torch.full((c,), CHUNK)
    if numel % CHUNK:
        lengths[-1] = numel % CHUNK
    if ((slots >= lengths[:, None]) & mask).any():
        raise TransportError("sparse message has a position past the end of its chunk")
    chunk_of = torch.arange(c).repeat_interleave(mask.sum(dim=1))
    return chunk_of * CHUNK + offsets, means[chunk_of, bins]


def decode(body: torch.Tensor, numel: int, k: int) -> torch.Tensor:
    """A message body as a dense fp32 tensor of ``numel`` values (zeros where nothing was kept)."""
    positions, values = decode_sparse(body, numel, k)
    out = torch.zeros(numel)
    out[positions] = values  # distinct positions (checked): deterministic
    return out


def bundle_body(messages: Sequence[torch.Tensor], weights: Sequence[float]) -> bytes:
    """The members' whole messages (uint8) with their weights, in the order given (member order)."""
    table = b"".join(_ENTRY.pack(float(w), m.numel()) for m, w in zip(messages, weights))
    return table + b"".join(to_bytes(m) for m in messages)


def bundle_bytes(count: int, message_bytes: int) -> int:
    """A bundle body's size: ``count`` messages of ``message_bytes`` each (a part's messages all hold the
    same number of values, so they are the same size)."""
    return count * (_ENTRY.size + message_bytes)


def decode_bundle(
    body: bytes,
    count: int,
    numel: int,
    message_bytes: int,
    open_message: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """The update a bundle of ``count`` messages holds: at each position the weighted mean of the values of
    the members that sent it (computed in fp64, in member order: the same on every machine).
    ``open_message`` checks one whole message and returns its positions and values."""
    if not 1 <= count <= MAX_SENDERS:
        raise TransportError(f"bundle of {count} messages (at most {MAX_SENDERS})")
    if len(body) != bundle_bytes(count, message_bytes):
        raise TransportError(f"bundle of {len(body)} bytes where {bundle_bytes(count, message_bytes)} were expected")
    num = torch.zeros(numel, dtype=torch.float64)
    den = torch.zeros(numel, dtype=torch.float64)
    start = _ENTRY.size * count
    for i in range(count):
        weight, length = _ENTRY.unpack_from(body, _ENTRY.size * i)
        if not (sys.float_info.min <= weight < float("inf")) or length != message_bytes:
            raise TransportError(f"bundle entry {i} has weight {weight} or length {length}: malformed")
        message = torch.frombuffer(bytearray(body[start : start + length]), dtype=torch.uint8)
        start += length
        positions, values = open_message(message, numel)
        sent = values != 0  # a kept zero is no vote
        positions, values = positions[sent], values[sent]
        num.index_add_(0, positions, values.double() * weight)
        den.index_add_(0, positions, torch.full((positions.numel(),), weight, dtype=torch.float64))
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0).float()
