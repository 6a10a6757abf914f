"""How pseudo-gradients travel: codecs with an integrity envelope, and error feedback.

A group averages ``anchor - current`` (the pseudo-gradient) and every member applies the same
decoded average to the same anchor, so the codec may lose information without breaking
bit-identity: only decoding must be deterministic, and it is (element-wise ops and a scatter into
distinct slots). What a codec drops is kept by the sender (:class:`ErrorFeedback`) and added to its
next message, so nothing a peer learned is lost, only delayed.

Codecs (``swarm.compression``), values in blocks of :data:`BLOCK`:

* ``none``: fp32; ``fp16``: half precision (clamped to its range);
* ``int8`` / ``int4``: symmetric blockwise quantization, one fp16 scale per block (absmax / 127 or 7);
* ``topk``: per block, the ``k`` largest magnitudes (``swarm.topk_fraction`` of the block), their
  positions as uint8 offsets in increasing order, their values at 2 bits on the levels
  ``{-1, -1/3, 1/3, 1} x scale`` with one fp16 scale (the block's largest kept magnitude).

Not hivemind's codecs: per-tensor (its blockwise 8-bit needs bitsandbytes), no 4-bit, top-k or integrity
check. hivemind still serializes and streams the result.

Every message is one uint8 tensor: a 32-byte header (magic with version, codec, numel, topk k, a
BLAKE2b-64 checksum of the body) and the body. A message whose header, size, checksum, index order
or scales do not check out is refused (:class:`~p2p_spes.averaging.transport.TransportError`), never applied.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from p2p_spes.averaging import sparse
from p2p_spes.averaging.bitpack import pack2, pack4, to_bytes, unpack2, unpack4
from p2p_spes.averaging.blockwise import (
    BLOCK,
    FP16_MAX,
    as_blocks,
    block_count,
    block_scales,
    dequantize,
    keep_mask,
    quantize,
    read_scales,
)
from p2p_spes.averaging.transport import TransportError

CODECS = ("none", "fp16", "int8", "int4", "topk", "sparse")  # what swarm.compression may name
DENSE = CODECS[:4]  # what swarm.lone_compression may name
BUNDLE = "sparse-bundle"  # a sparse group's result: the members' messages, forwarded (sparse.py)
_WIRE = (*CODECS, BUNDLE)  # codec ids in the header
SPARSE_DECAY = 0.95  # the sparse codec's error feedback decays (error_feedback.py)
LOSSLESS = ("none",)
MAGIC = b"PSG1"
_HEADER = struct.Struct("<4sBxxxQH6x")  # magic, codec id, numel, topk k (24 bytes; the checksum follows)
_CHECK = 8
HEADER_BYTES = _HEADER.size + _CHECK
_TOPK_LEVELS = torch.tensor([-1.0, -1.0 / 3.0, 1.0 / 3.0, 1.0])


@dataclass(frozen=True)
class Codec:
    """One of :data:`CODECS`; ``topk_fraction`` is the share of each block ``topk`` keeps in a member's
    message, ``result_fraction`` (None: the same) in a group's averaged parts (:attr:`result`).
    ``floor_fraction`` (set on :attr:`result` only) lets a message keep fewer values, down to that share:
    a group of few members encodes its mean at :meth:`result_for`. ``lone_fraction`` (None: the result's)
    is the share a group of one keeps, or ``lone_compression`` a dense codec it uses instead (:attr:`lone`)."""

    name: str = "none"
    topk_fraction: float = 1 / 64
    result_fraction: float | None = None
    floor_fraction: float | None = None
    lone_fraction: float | None = None
    lone_compression: str | None = None

    def __post_init__(self) -> None:
        if self.name not in _WIRE:
            raise ValueError(f"unknown compression {self.name!r}; choose one of {', '.join(CODECS)}")
        shares = {"topk_fraction": self.topk_fraction, "topk_result_fraction": self.result_fraction}
        shares |= {"floor_fraction": self.floor_fraction, "topk_lone_fraction": self.lone_fraction}
        for what, share in shares.items():
            if share is not None and not 0 < share <= 1:
                raise ValueError(f"{what} must be in (0, 1], got {share}")
        lone, most = self.lone_fraction, self.result_fraction or self.topk_fraction
        if self.name == "topk" and lone is not None and not self.topk_fraction <= lone <= most:
            raise ValueError(
                f"topk_lone_fraction {lone} is outside topk_fraction {self.topk_fraction} .. "
                f"topk_result_fraction {self.result_fraction} (the shares a group's result may keep)"
            )
        dense = self.lone_compression
        if dense is not None and (self.name != "topk" or dense not in DENSE or lone is not None):
            what = f"topk (not {self.name}), one of {', '.join(DENSE)} and no topk_lone_fraction"
            raise ValueError(f"lone_compression {dense!r} needs {what}")

    @property
    def result(self) -> Codec:
        """The codec that decodes a group's averaged parts: what every member applies and what frozen
        copies follow. Under ``topk`` the mean of P members' messages holds up to P x k values per block;
        re-encoded at k, the rest waits in the reducer's residual for later rounds, a delay that costs
        loss, so ``result_fraction`` may keep more; a group's parts keep between k and that (:meth:`result_for`)."""
        if self.name == "sparse":
            return Codec(BUNDLE, self.topk_fraction)
        if self.name != "topk" or self.result_fraction is None:
            return self
        floor = min(self.topk_fraction, self.result_fraction)
        return Codec(self.name, self.result_fraction, floor_fraction=floor, lone_compression=self.lone_compression)

    def result_for(self, contributions: int) -> Codec:
        """The codec that encodes the mean of ``contributions`` encoded messages (a reducer's part): with
        ``result_fraction``, k per contribution up to the result's k. The mean holds no more than that
        many values per block, so a larger k would only spend bytes on zeros (sent as +-1/3 of the
        scale). A lone holder's update is its own dense pseudo-gradient, not such a mean: it goes at
        :attr:`lone` (by default the result's k: at fewer, its frozen copies trail it, which costs loss)."""
        result = self.result
        if result is self or self.forwards:
            return result
        return Codec(self.name, min(result.k, max(1, contributions) * self.k) / BLOCK)

    @property
    def lone(self) -> Codec:
        """A group of one's result (a lone holder's update, what its copies download): :attr:`result`'s,
        at ``lone_fraction`` (between the members' k and the result's) or ``lone_compression`` if set."""
        if self.lone_compression is not None:
            return Codec(self.lone_compression)
        if self.lone_fraction is None or self.name != "topk":
            return self.result
        return Codec(self.name, self.lone_fraction)

    @property
    def lossless(self) -> bool:
        return self.name in LOSSLESS

    @property
    def forwards(self) -> bool:
        """Whether a reducer serves the members' messages as they came (a bundle) instead of their mean."""
        return self.name == "sparse"

    @property
    def feedback_decay(self) -> float:
        """What the residual of error feedback is multiplied by when it is sent again (1: kept whole)."""
        return SPARSE_DECAY if self.name == "sparse" else 1.0

    @property
    def member(self) -> Codec:
        """The codec of the messages a bundle holds (itself for any other codec)."""
        return Codec("sparse", self.topk_fraction) if self.name == BUNDLE else self

    @property
    def k(self) -> int:
        """Values ``topk`` keeps per block of :data:`BLOCK` (``sparse``: per chunk of ``sparse.CHUNK``)."""
        size = sparse.CHUNK if self.name in ("sparse", BUNDLE) else BLOCK
        return max(1, min(size, round(self.topk_fraction * size)))

    def body_bytes(self, numel: int, count: int = 1) -> int:
        """The exact size of the body of a message of ``numel`` values (what the receiver checks); a
        bundle's, of ``count`` members' messages."""
        if self.name == "sparse":
            return sparse.body_bytes(numel, self.k)
        if self.name == BUNDLE:
            return sparse.bundle_bytes(count, self.member.wire_bytes(numel))
        blocks = block_count(numel)
        if self.name == "none":
            return 4 * numel
        if self.name == "fp16":
            return 2 * numel
        if self.name == "int8":
            return 2 * blocks + numel
        if self.name == "int4":
            return 2 * blocks + (numel + 1) // 2
        kept = self._kept(numel)
        return 2 * blocks + kept + (kept + 3) // 4

    def wire_bytes(self, numel: int, count: int = 1) -> int:
        """Header plus body: the payload of one message before hivemind's protobuf framing."""
        return HEADER_BYTES + self.body_bytes(numel, count)

    def _kept(self, numel: int) -> int:
        """Values kept over all blocks: ``k`` per full block, at most the length of the last one."""
        full, rest = divmod(numel, BLOCK)
        return full * self.k + min(self.k, rest)

    # Encoding ------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (flat, finite) as one uint8 message: header, checksum, body."""
        x = x.detach().reshape(-1).float().cpu()
        if self.name == BUNDLE:
            raise ValueError("a bundle is made of the members' messages (Codec.bundle), not encoded")
        body = sparse.encode(x, self.k) if self.name == "sparse" else getattr(self, f"_encode_{self.name}")(x)
        assert len(body) == self.body_bytes(x.numel())
        return self._sealed(body, x.numel(), self.k)

    def alone(self, x: torch.Tensor) -> torch.Tensor:
        """A group of one's result, in :attr:`lone`'s codec (under ``sparse``, a bundle of one message)."""
        if self.forwards:
            return self.result.bundle([self.encode(x)], [1.0], x.numel())
        return self.lone.encode(x)

    def bundle(self, messages: list[torch.Tensor], weights: list[float], numel: int) -> torch.Tensor:
        """A reducer's part under ``sparse``: the members' ``messages`` of ``numel`` values each, with their
        weights, in member order (this codec is :attr:`result`)."""
        return self._sealed(sparse.bundle_body(messages, weights), numel, len(messages))

    def _sealed(self, body: bytes, numel: int, k: int) -> torch.Tensor:
        header = _HEADER.pack(MAGIC, _WIRE.index(self.name), numel, k)
        checksum = hashlib.blake2b(header + body, digest_size=_CHECK).digest()
        return torch.frombuffer(bytearray(header + checksum + body), dtype=torch.uint8)

    def _encode_none(self, x: torch.Tensor) -> bytes:
        return to_bytes(x)

    def _encode_fp16(self, x: torch.Tensor) -> bytes:
        return to_bytes(x.clamp(-FP16_MAX, FP16_MAX).half())

    def _encode_int8(self, x: torch.Tensor) -> bytes:
        scales, q = quantize(x, 127)
        return to_bytes(scales) + to_bytes(q)

    def _encode_int4(self, x: torch.Tensor) -> bytes:
        scales, q = quantize(x, 7)
        return to_bytes(scales) + to_bytes(pack4(q.to(torch.int16) + 8))

    def _encode_topk(self, x: torch.Tensor) -> bytes:
        rows = as_blocks(x)
        n, k = x.numel(), self.k
        # the padding ranks below every real value, zeros included: a last block with fewer than k
        # non-zero values must still name positions inside itself (the receiver refuses any past it)
        score = rows.abs()
        score.view(-1)[n:] = -1.0
        idx = score.topk(k, dim=1).indices.sort(dim=1).values  # positions in increasing order
        vals = rows.gather(1, idx)
        scales = block_scales(vals.abs().amax(dim=1), 1.0)
        # nearest of the four levels: -1, -1/3, 1/3, 1 (x scale)
        q = torch.round((vals / scales.float()[:, None]).clamp(-1, 1) * 1.5 + 1.5).clamp(0, 3)
        keep = keep_mask(n, k)
        idx, q = idx.reshape(-1)[keep], q.reshape(-1)[keep]
        return to_bytes(scales) + to_bytes(idx.to(torch.uint8)) + to_bytes(pack2(q))

    # Decoding ------------------------------------------------------------------------------------
    def decode(self, message: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 values of ``message``, which must hold ``numel`` values in this codec."""
        opened = self._open(message, numel)
        if isinstance(opened, Codec):  # a group of few members: its mean, at fewer values
            return opened.decode(message, numel)
        body, k = opened
        if not numel:  # an empty part (more reducers than values): torch.frombuffer refuses an empty buffer
            return torch.empty(0)
        if self.name == "sparse":
            out = sparse.decode(body, numel, self.k)
        elif self.name == BUNDLE:
            member = self.member
            out = sparse.decode_bundle(to_bytes(body), k, numel, member.wire_bytes(numel), member.open_sparse)
        else:
            out = getattr(self, f"_decode_{self.name}")(body, numel)
        if not torch.isfinite(out).all():
            raise TransportError("compressed message decodes to NaN or infinite values")
        return out

    def open_sparse(self, message: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A ``sparse`` message's positions and values, checked (a bundle's members, one by one)."""
        body, _ = self._open(message, numel)
        return (
            sparse.decode_sparse(body, numel, self.k) if numel else (torch.empty(0, dtype=torch.int64), torch.empty(0))
        )

    def _open(self, message: torch.Tensor, numel: int) -> tuple[torch.Tensor, int] | Codec:
        """``message``'s body (uint8) and header k once its envelope checks out (a ``TransportError`` names
        what does not), or the codec to decode it with instead (topk's mean of few messages)."""
        if message.dtype != torch.uint8 or message.dim() != 1:
            raise TransportError(f"a compressed message must be a flat uint8 tensor, got {message.dtype}")
        raw = to_bytes(message)
        if len(raw) < HEADER_BYTES:
            raise TransportError(f"compressed message of {len(raw)} bytes is shorter than its header")
        magic, codec, count, k = _HEADER.unpack(raw[: _HEADER.size])
        if magic != MAGIC:
            raise TransportError("not a p2p-spes compressed message (bad magic)")
        if codec >= len(_WIRE) or _WIRE[codec] != self.name:
            theirs = _WIRE[codec] if codec < len(_WIRE) else f"unknown ({codec})"
            raise TransportError(f"message compressed with {theirs}, this run uses {self.name} (swarm.compression)")
        floor = self.k if self.floor_fraction is None else Codec(self.name, self.floor_fraction).k
        bad_k = not floor <= k <= self.k if self.name == "topk" else (k < 1 if self.name == BUNDLE else k != self.k)
        if count != numel or (self.name not in ("none", "fp16", "int8", "int4") and bad_k):
            expected = f"k={self.k}" if floor == self.k else f"k={floor}..{self.k}"
            raise TransportError(f"message of {count} values (k={k}) where {numel} ({expected}) were expected")
        if self.name == "topk" and k != self.k:
            return Codec(self.name, k / BLOCK)
        body = raw[HEADER_BYTES:]
        size = self.body_bytes(numel, k)
        if len(body) != size:
            raise TransportError(
                f"compressed body of {len(body)} bytes where {size} were expected (truncated or padded)"
            )
        checksum = hashlib.blake2b(raw[: _HEADER.size] + body, digest_size=_CHECK).digest()
        if checksum != raw[_HEADER.size : HEADER_BYTES]:
            raise TransportError("compressed message fails its checksum (corrupt)")
        return torch.frombuffer(bytearray(body), dtype=torch.uint8) if body else torch.empty(0, dtype=torch.uint8), k

    def _decode_none(self, body: torch.Tensor, numel: int) -> torch.Tensor:
        return body.view(torch.float32).clone()

    def _decode_fp16(self, body: torch.Tensor, numel: int) -> torch.Tensor:
        return body.view(torch.float16).float()

    def _decode_int8(self, body: torch.Tensor, numel: int) -> torch.Tensor:
        scales, rest = read_scales(body, numel)
        q = rest.view(torch.int8)
        if (q == -128).any():
            raise TransportError("int8 message holds -128, outside the symmetric range")
        return dequantize(q, scales, numel)

    def _decode_int4(self, body: torch.Tensor, numel: int) -> torch.Tensor:
        scales, rest = read_scales(body, numel)
        q = unpack4(rest, numel).to(torch.int16) - 8
        if (q < -7).any():
            raise TransportError("int4 message holds -8, outside the symmetric range")
        return dequantize(q, scales, numel)

    def _decode_topk(self, body: torch.Tensor, numel: int) -> torch.Tensor:
        scales, rest = read_scales(body, numel)
        kept = self._kept(numel)
        idx, packed = rest[:kept], rest[kept:]
        slots = torch.zeros(block_count(numel) * self.k, dtype=torch.int64)
        keep = keep_mask(numel, self.k)
        slots[keep] = idx.long()
        slots = slots.view(-1, self.k)
        mask = keep.view(-1, self.k)
        # positions strictly increasing inside each block and inside the block's length: no slot twice
        if mask.shape[1] > 1 and ((slots[:, 1:] <= slots[:, :-1]) & mask[:, 1:]).any():
            raise TransportError("top-k message has positions out of order or repeated")
        lengths = torch.full((slots.shape[0],), BLOCK)
        if numel % BLOCK:
            lengths[-1] = numel % BLOCK
        if ((slots >= lengths[:, None]) & mask).any():
            raise TransportError("top-k message has a position past the end of its block")
        values = _TOPK_LEVELS[unpack2(packed, kept).long()] * scales.repeat_interleave(mask.sum(dim=1))
        positions = (torch.arange(slots.shape[0])[:, None] * BLOCK + slots)[mask]
        out = torch.zeros(slots.shape[0] * BLOCK)
        out[positions] = values  # distinct positions (checked above): deterministic
        return out[:numel].contiguous()

    # Splitting -----------------------------------------------------------------------------------
    def decode_update(self, messages: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
        """A group's result as a frozen copy downloads it: its parts (:meth:`decode_parts`), or a lone
        holder's one message in :attr:`lone`'s dense codec, which only this reads (a reducer never does)."""
        lone = self.lone
        if len(messages) == 1 and lone.name != self.name and _header(messages[0])[1] == _WIRE.index(lone.name):
            return lone.decode(messages[0], numel)
        return self.decode_parts(messages, numel)

    def decode_parts(self, messages: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
        """A tensor of ``numel`` values sent as parts in order. Each part's size is read from its header:
        a group splits among its reducers in proportion to their bandwidth, not always in equal parts."""
        sizes = [message_numel(m) for m in messages]
        if sum(sizes) != numel:
            raise TransportError(f"{len(messages)} parts of {sum(sizes)} values where {numel} were expected")
        return torch.cat([self.decode(m, n) for m, n in zip(messages, sizes)])


def _header(message: torch.Tensor) -> tuple[bytes, int, int, int]:
    """A message's header (magic, codec id, numel, k), unchecked but for its length and magic."""
    if message.dtype != torch.uint8 or message.dim() != 1 or message.numel() < HEADER_BYTES:
        raise TransportError("not a p2p-spes compressed message (too short or not flat uint8)")
    header = _HEADER.unpack(to_bytes(message[: _HEADER.size]))
    if header[0] != MAGIC:
        raise TransportError("not a p2p-spes compressed message (bad magic)")
    return header


def message_numel(message: torch.Tensor) -> int:
    """The values a message says it holds (its header; :meth:`Codec.decode` checks the rest)."""
    return _header(message)[2]
