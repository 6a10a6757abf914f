"""The wire meter: every message of a stream counted once on each side, with hivemind's framing, by purpose."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable

import pytest
from hivemind.proto import averaging_pb2

from p2p_spes.averaging.wire_meter import FRAME_BYTES, MeteredP2P, WireMeter, message_bytes, purpose_of


class Loopback:
    """hivemind's P2P reduced to its protobuf streams, caller and handler in one process."""

    def __init__(self) -> None:
        self.handlers: dict[str, tuple] = {}

    async def add_protobuf_handler(
        self, name, handler, input_type, *, stream_input=False, stream_output=False, balanced=False
    ):
        self.handlers[name] = (handler, stream_input)

    async def iterate_protobuf_handler(self, peer_id, name, requests, output_type):
        handler, stream_input = self.handlers[name]
        received = [m async for m in requests]  # the meter counts them (and the end of the stream) as they go

        async def replay():
            for m in received:
                yield m

        output = handler(replay() if stream_input else received[0], None)
        if not isinstance(output, AsyncIterable):
            output = _one(await output)
        return output


async def _one(message):
    yield message


def data(n: int) -> averaging_pb2.AveragingData:
    return averaging_pb2.AveragingData(group_id=b"x" * n, weight=1.0)


def test_purposes_follow_the_handler_and_the_side():
    assert purpose_of("run.allreduce.contribute", serving=False) == "averaging"
    assert purpose_of("run.allreduce.fetch", serving=True) == "reducing"
    assert purpose_of("run.state", serving=True) == "serving"
    assert purpose_of("run.state", serving=False) == "downloading"
    assert purpose_of("run.something", serving=False) == "other"


def test_both_ends_count_every_message_with_its_framing():
    wire = Loopback()
    server_meter, client_meter = WireMeter(), WireMeter()
    server, client = MeteredP2P(wire, server_meter), MeteredP2P(wire, client_meter)
    requests = [data(100), data(5000), data(1)]
    replies = [data(70_000), data(3)]

    async def contribute(stream, context):
        assert len([m async for m in stream]) == 3
        return data(2)

    async def fetch(request, context):
        for r in replies:
            yield r

    async def scenario():
        await server.add_protobuf_handler("run.allreduce.contribute", contribute, None, stream_input=True)
        await server.add_protobuf_handler("run.state", fetch, None, stream_output=True)

        async def stream():
            for r in requests:
                yield r

        reply = await client.call_protobuf_handler("peer", "run.allreduce.contribute", stream(), None)
        got = [m async for m in await client.iterate_protobuf_handler("peer", "run.state", data(10), None)]
        return reply, got

    reply, got = asyncio.run(scenario())
    assert reply == data(2) and got == replies
    contributed = sum(map(message_bytes, requests)) + FRAME_BYTES  # and the end of the stream
    assert client_meter.by_purpose["averaging"].sent == server_meter.by_purpose["reducing"].received == contributed
    assert client_meter.by_purpose["averaging"].received == server_meter.by_purpose["reducing"].sent
    assert server_meter.by_purpose["reducing"].sent == data(2).ByteSize() + FRAME_BYTES
    served = sum(map(message_bytes, replies))
    assert server_meter.by_purpose["serving"].sent == client_meter.by_purpose["downloading"].received == served
    asked = message_bytes(data(10)) + FRAME_BYTES
    assert client_meter.by_purpose["downloading"].sent == server_meter.by_purpose["serving"].received == asked
    assert client_meter.sent == server_meter.received and client_meter.received == server_meter.sent
    mark = client_meter.snapshot()
    client_meter.add("downloading", received=7)
    assert client_meter.since(mark)["downloading"].received == 7 and client_meter.since(mark)["averaging"].sent == 0


def test_calls_that_would_bypass_the_streams_are_refused():
    meter = MeteredP2P(Loopback(), WireMeter())

    async def unary(request, context):
        return request

    with pytest.raises(TypeError, match="stream handlers only"):
        asyncio.run(meter.add_protobuf_handler("run.x", unary, None))
    with pytest.raises(TypeError, match="streams only"):
        asyncio.run(meter.call_protobuf_handler("peer", "run.x", data(1), None))
