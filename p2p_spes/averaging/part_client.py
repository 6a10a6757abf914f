"""A member's calls to reducers (``reducer.py``): send a contribution, fetch an averaged part or a column.

A stream cut short (hivemind ends one silently when its connection closes) is not a failure yet: the
call goes again, up to ``ATTEMPTS`` times, and a reducer that already holds a contribution whose
reply was lost says so (``TAKEN``) instead of refusing it. What is counted (bytes, calls repeated)
goes to the caller's tally (a ``GroupResult``).

A contribution that certainly never reached its reducer (the first dial failed: the peer is gone, or the
reducer refused it) raises :class:`Undelivered`: that reducer's part can then never be served, so the
attempt cannot succeed for any member, which lets its retry form at once (``allreduce.py``).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from hivemind.p2p import P2PDaemonError, P2PHandlerError, PeerID
from hivemind.proto import averaging_pb2

from p2p_spes.averaging.reducer import AGAIN, MISSING, OK, TAKEN
from p2p_spes.averaging.transport import TransportError, TruncatedStream, collect_tensors, parse_tensor, serialize_parts

log = logging.getLogger(__name__)
ATTEMPTS = 3  # sends and fetches of one part, within the group's deadline


class PartMissing(TransportError):
    """A reducer answered but had no averaged part to serve: a contribution it needed never came."""


class Undelivered(TransportError):
    """A reducer certainly lacks our contribution (it refused it, or the stream to it never opened)."""


class Tally(Protocol):
    bytes_sent: int
    bytes_received: int
    retries: int


class PartClient:
    """The client side of one peer's reducer RPCs (names as :class:`~p2p_spes.averaging.allreduce.GroupAllReduce` serves them)."""

    def __init__(self, p2p, run_id: str) -> None:
        self.p2p = p2p
        self.contribute_name = f"{run_id}.allreduce.contribute"
        self.fetch_name = f"{run_id}.allreduce.fetch"
        self.column_name = f"{run_id}.allreduce.column"

    async def send(self, peer: str, key: bytes, message: torch.Tensor, weight: float, tally: Tally) -> bool:
        """Send our encoded contribution to the part ``key`` that ``peer`` reduces. True once it took it;
        False when no reply came (it may have it: its result will tell). Raises ``Undelivered`` when
        it refuses or cannot be dialled first time, ``TruncatedStream`` when every try was cut short."""
        chunk_parts = serialize_parts(message)
        size = sum(c.ByteSize() for c in chunk_parts)

        async def messages():
            for j, c in enumerate(chunk_parts):
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.PART_FOR_AVERAGING,
                    group_id=key if j == 0 else b"",
                    weight=float(weight) if j == 0 else 0.0,
                    tensor_part=c,
                )

        for attempt in range(ATTEMPTS):
            if attempt:  # the last send was cut short or its reply lost: it goes again
                tally.retries += 1
            tally.bytes_sent += size
            try:
                reply = await self.p2p.call_protobuf_handler(
                    PeerID.from_base58(peer), self.contribute_name, messages(), averaging_pb2.AveragingData
                )
            except P2PDaemonError as exc:  # no stream opened: nothing of this try reached it
                if attempt == 0:
                    raise Undelivered(f"could not reach {peer}: {exc}") from None
                raise TransportError(f"could not reach {peer} again: {exc}") from None  # an earlier try may have
            except (ValueError, P2PHandlerError) as exc:
                # the stream closed before the reply: the reducer answers TAKEN if our part got there
                if attempt == ATTEMPTS - 1:
                    log.info("no reply from %s to our contribution (%s); its result will tell", peer, exc)
                    return False
                reply = averaging_pb2.AveragingData(code=AGAIN)
            if reply.code in (OK, TAKEN):
                return True
            if reply.code != AGAIN:  # (it would answer TAKEN had an earlier try got there)
                raise Undelivered(f"{peer} refused our contribution (code {reply.code})")
        raise TruncatedStream(f"our contribution to {peer} was cut short {ATTEMPTS} times")

    async def fetch(self, peer: str, key: bytes, tally: Tally, column: bool = False) -> list[torch.Tensor]:
        """The encoded averaged part ``key`` from ``peer`` (one tensor), or with ``column`` a column's
        result (its parts in order), asked again when the stream is cut short. Raises ``PartMissing``
        when it has none to serve."""
        for attempt in range(ATTEMPTS):
            try:
                return await self._fetch_once(peer, key, tally, column)
            except TruncatedStream as exc:  # a reducer serves the same bytes until the round is over
                if attempt == ATTEMPTS - 1:
                    raise
                log.info("averaged part from %s came truncated (%s); fetching it again", peer, exc)
                tally.retries += 1
        raise AssertionError("unreachable")

    async def _fetch_once(self, peer: str, key: bytes, tally: Tally, column: bool) -> list[torch.Tensor]:
        stream = await self.p2p.iterate_protobuf_handler(
            PeerID.from_base58(peer),
            self.column_name if column else self.fetch_name,
            averaging_pb2.AveragingData(group_id=key),
            averaging_pb2.AveragingData,
        )

        async def checked():
            async for message in stream:
                if message.code == MISSING:
                    raise PartMissing(f"{peer} had no averaged part to serve (a contribution never came)")
                if message.code != OK:
                    raise TransportError(f"{peer} could not serve an averaged part (code {message.code})")
                tally.bytes_received += message.tensor_part.ByteSize()
                yield message

        _, tensors = await collect_tensors(checked())
        if not tensors or (not column and len(tensors) != 1):
            raise TruncatedStream(f"{peer} sent {len(tensors)} tensors where {'some' if column else 'one'} were due")
        return [parse_tensor(chunks) for chunks in tensors]
