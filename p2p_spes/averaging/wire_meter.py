"""Every byte a peer's streams carry, counted in one place: where messages cross hivemind's P2P layer.

:class:`MeteredP2P` stands in for hivemind's ``P2P`` and counts each protobuf message that a stream
handler receives or sends, and each that a call sends or receives, with hivemind's own framing (a marker
byte and an 8-byte length per message, and the end-of-stream message a caller sends after its last). It
counts them by purpose, from the handler's name and which side of the stream this peer is on:

- ``averaging``: our side of a group's exchange as a member (contributions out, averaged parts in);
- ``reducing``: a member's contributions we reduce (in) and the averaged parts we serve (out); none for a
  client (a member nobody can dial, ``allreduce.py``), and all there is for an outsider that reduces for
  a group of clients it is not in;
- ``serving``: state, experts, anchors and updates other peers download from us;
- ``downloading``: what we download from other peers (catch-up, refreshes, rebases, adoptions);
- ``data_served``: the run's data files peers fetch from us (``{run}.data``, serving side);
- ``data_fetched``: the run's data files we fetch from peers (calling side);
- ``other``: any other handler.

What it does not see: the DHT's own RPCs (hivemind runs the DHT in a process of its own), and what
libp2p and TCP/IP add below a stream (its encryption and multiplexing frames, packet headers).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

FRAME_BYTES = 9  # hivemind's frame around each protobuf message on a stream: 1 marker byte, 8 length bytes
PURPOSES = ("averaging", "reducing", "serving", "downloading", "data_served", "data_fetched", "other")


@dataclass
class Traffic:
    sent: int = 0
    received: int = 0


def purpose_of(handler: str, serving: bool) -> str:
    """The purpose of a stream of handler ``handler``, on its serving side or its calling side."""
    if ".allreduce." in handler:
        return "reducing" if serving else "averaging"
    if handler.endswith(".state"):
        return "serving" if serving else "downloading"
    if handler.endswith(".data"):
        return "data_served" if serving else "data_fetched"
    return "other"


class WireMeter:
    """Bytes sent and received on the swarm's streams, by purpose (see the module docstring)."""

    def __init__(self) -> None:
        self.by_purpose = {p: Traffic() for p in PURPOSES}

    def add(self, purpose: str, sent: int = 0, received: int = 0) -> None:
        traffic = self.by_purpose[purpose]
        traffic.sent += sent
        traffic.received += received

    @property
    def sent(self) -> int:
        return sum(t.sent for t in self.by_purpose.values())

    @property
    def received(self) -> int:
        return sum(t.received for t in self.by_purpose.values())

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """The counts now, to subtract later (:meth:`since`)."""
        return {p: (t.sent, t.received) for p, t in self.by_purpose.items()}

    def since(self, snapshot: dict[str, tuple[int, int]]) -> dict[str, Traffic]:
        """What moved since ``snapshot``, by purpose."""
        return {p: Traffic(t.sent - snapshot[p][0], t.received - snapshot[p][1]) for p, t in self.by_purpose.items()}


def message_bytes(message: Any) -> int:
    """A protobuf message's bytes on a stream, framing included."""
    return message.ByteSize() + FRAME_BYTES


async def _counted(stream: AsyncIterable[Any], count: Callable[[int], None], end: bool = False) -> AsyncIterator[Any]:
    async for message in stream:
        count(message_bytes(message))
        yield message
    if end:  # the end-of-stream message that follows the last one
        count(FRAME_BYTES)


async def _one(message: Any) -> AsyncIterator[Any]:
    yield message


class MeteredP2P:
    """hivemind's ``P2P`` with every protobuf stream counted into ``meter``; the rest passes through."""

    def __init__(self, p2p: Any, meter: WireMeter) -> None:
        self._p2p, self.meter = p2p, meter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._p2p, name)

    async def add_protobuf_handler(
        self,
        name: str,
        handler: Callable[..., Any],
        input_protobuf_type: Any,
        *,
        stream_input: bool = False,
        stream_output: bool = False,
        balanced: bool = False,
    ) -> None:
        if not stream_input and not stream_output:
            raise TypeError(f"{name}: the wire meter counts stream handlers only (register it with stream_output=True)")
        purpose = purpose_of(name, serving=True)

        def received(n: int) -> None:
            self.meter.add(purpose, received=n)

        def sent(n: int) -> None:
            self.meter.add(purpose, sent=n)

        async def counted(request: Any, context: Any) -> AsyncIterator[Any]:
            if stream_input:
                request = _counted(request, received, end=True)
            else:
                received(message_bytes(request) + FRAME_BYTES)  # the request, then the end of the stream
            output = handler(request, context)
            stream = output if isinstance(output, AsyncIterable) else _one(await output)
            async for message in _counted(stream, sent):
                yield message

        await self._p2p.add_protobuf_handler(
            name,
            counted,
            input_protobuf_type,
            stream_input=stream_input,
            stream_output=stream_output,
            balanced=balanced,
        )

    async def call_protobuf_handler(self, peer_id: Any, name: str, input: Any, output_protobuf_type: Any) -> Any:
        """One reply to a stream of requests (hivemind's unary calls bypass the streams: not offered here)."""
        if not isinstance(input, AsyncIterable):
            raise TypeError(f"{name}: the wire meter counts streams only; pass the request as an async iterable")
        stream = await self.iterate_protobuf_handler(peer_id, name, input, output_protobuf_type)
        replies = [message async for message in stream]
        if len(replies) != 1:
            raise ValueError(f"{name} at {peer_id} answered with {len(replies)} messages, expected one")
        return replies[0]

    async def iterate_protobuf_handler(
        self, peer_id: Any, name: str, input: Any, output_protobuf_type: Any
    ) -> AsyncIterator[Any]:
        purpose = purpose_of(name, serving=False)
        requests = input if isinstance(input, AsyncIterable) else _one(input)
        outgoing = _counted(requests, lambda n: self.meter.add(purpose, sent=n), end=True)
        stream = await self._p2p.iterate_protobuf_handler(peer_id, name, outgoing, output_protobuf_type)
        return _counted(stream, lambda n: self.meter.add(purpose, received=n))
