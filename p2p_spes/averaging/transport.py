"""What travels between peers: tensors in hivemind's serialized form, metadata in msgpack.

Nothing received is unpickled. Every tensor stream is checked on receipt against the shapes and
dtypes the receiver expects, and refused if it is not finite.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from typing import TypeVar

import msgpack
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from p2p_spes.errors import P2PSpesError

CHUNK_BYTES = 2**19
T = TypeVar("T")
UNWIND_SECONDS = 1.0  # how long cancelled transfers get to close their streams


class TransportError(P2PSpesError, ValueError):
    """A peer sent something malformed, of the wrong shape or dtype, or not finite."""


class TruncatedStream(TransportError):
    """A tensor stream ended before all of its bytes came. hivemind ends a stream silently when its
    connection closes (as under load): unlike a malformed tensor, worth asking again."""


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, max_bytes: int = 1 << 20):
    if len(data) > max_bytes:
        raise TransportError(f"metadata of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise TransportError(f"malformed msgpack metadata: {exc}") from None


def tensor_digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 over the raw bytes of the tensors, in order: equal digests mean bit-identical copies."""
    digest = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        digest.update(str((tuple(t.shape), str(t.dtype))).encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def serialize_parts(tensor: torch.Tensor) -> list[runtime_pb2.Tensor]:
    """One tensor, as it is (compression happens before: ``compression.py``), in protobuf chunks small
    enough for a libp2p stream."""
    serialized = serialize_torch_tensor(tensor.detach().cpu(), runtime_pb2.CompressionType.NONE)
    return list(split_for_streaming(serialized, CHUNK_BYTES))


def parse_tensor(
    parts: Sequence[runtime_pb2.Tensor], shape: Sequence[int] | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Reassemble, check and return a tensor received as chunks."""
    if not parts:
        raise TruncatedStream("empty tensor stream")
    combined = combine_from_streaming(list(parts))
    want = _payload_bytes(combined)
    if want is not None and len(combined.buffer) < want:
        raise TruncatedStream(f"tensor stream ended after {len(combined.buffer)} of its {want} bytes")
    try:
        tensor = deserialize_torch_tensor(combined)
    except Exception as exc:
        raise TransportError(f"could not deserialize a tensor: {exc}") from None
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise TransportError(f"tensor of shape {tuple(tensor.shape)} where {tuple(shape)} was expected")
    if dtype is not None:
        if not tensor.dtype.is_floating_point:
            raise TransportError(f"tensor of dtype {tensor.dtype} where a floating tensor was expected")
        tensor = tensor.to(dtype)
    if tensor.dtype.is_floating_point and not torch.isfinite(tensor).all():
        raise TransportError("tensor with NaN or infinite values refused")
    return tensor


def _payload_bytes(serialized: runtime_pb2.Tensor) -> int | None:
    """The bytes an uncompressed serialized tensor's buffer must hold (None when that is not known)."""
    dtype = getattr(torch, serialized.dtype, None)
    if serialized.compression != runtime_pb2.CompressionType.NONE or not isinstance(dtype, torch.dtype):
        return None
    return math.prod(serialized.size) * dtype.itemsize


async def collect_tensors(
    stream: AsyncIterator, field: str = "tensor_part"
) -> tuple[bytes, list[list[runtime_pb2.Tensor]]]:
    """Group a stream of messages carrying ``metadata`` and tensor chunks into per-tensor chunk lists.

    A chunk whose ``dtype`` is set starts a new tensor (hivemind's streaming convention).
    """
    metadata = b""
    tensors: list[list[runtime_pb2.Tensor]] = []
    async for message in stream:
        if getattr(message, "metadata", b""):
            metadata = message.metadata
        part = getattr(message, field)
        if not part.buffer and not part.dtype:
            continue
        if part.dtype or not tensors:
            tensors.append([])
        tensors[-1].append(part)
    return metadata, tensors


async def gather_or_cancel(coros: Iterable[Awaitable[T]], timeout: float) -> list[T]:
    """The results of ``coros``, all within ``timeout``; when one fails (or time runs out) the others
    are cancelled and given a moment to close their streams.

    ``asyncio.gather`` leaves the others running when one fails. Nothing then holds those tasks but
    the streams they wait on, so the garbage collector takes them mid-transfer and asyncio logs
    "aclose(): asynchronous generator is already running".
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout)
    except BaseException:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=UNWIND_SECONDS)
        raise
