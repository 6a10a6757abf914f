"""Internet round trips in the lab without ``netem``: a transparent TCP proxy that delays every byte.

This kernel has neither ``netem`` nor ``fq`` (so no earliest-departure-time delay either), so the lab
adds latency where the traffic is TCP: in a peer's namespace, ``iptables -t nat OUTPUT ... REDIRECT``
hands every connection the peer *dials* to the lab to this proxy (:func:`redirect_rules`), which dials
the original destination itself (its own sockets carry ``SO_MARK`` :data:`MARK`, which the rule skips)
and relays both directions, each byte written ``one_way`` seconds after it was read. One proxy on the
dialing side therefore gives the whole connection a round trip of ``2 x one_way``; every peer of a
lab runs one, so every connection has it, whoever dials.

What is emulated: the time a request takes to reach the other end and its answer to come back, for
every message on every connection, and the connection's set-up (the upstream dial starts ``one_way``
late and nothing is relayed until ``one_way`` after it connected, so the first exchange takes two round
trips, as a TCP handshake and a request would; the dialer's ``connect`` itself returns at once). What is not: TCP's own behaviour over a long path (slow start, the congestion window and ACK
clocking see the sub-millisecond lab path, so a transfer ramps up faster than it would over the
internet), loss, jitter and reordering, and UDP (the swarm uses TCP only).

Run as ``python -m benchmarks.lab.delay_proxy --port P --one-way-ms D`` inside the namespace.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import struct
from collections.abc import Sequence

MARK = 0x4C  # the proxy's own upstream sockets: the REDIRECT rule passes them
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h: the destination a REDIRECTed connection was dialled to
CHUNK = 1 << 16
IN_FLIGHT = 16 << 20  # bytes a direction holds while they wait out the delay (bounds the proxy's memory)


def redirect_rules(port: int, subnet: str) -> list[list[str]]:
    """The iptables commands (run inside the namespace) that send the connections it dials to ``subnet``
    through the proxy on ``port``."""
    return [
        ["iptables", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", subnet, "-m", "mark", "!", "--mark",
         str(MARK), "-j", "REDIRECT", "--to-ports", str(port)],
    ]  # fmt: skip


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where a REDIRECTed connection was going (``SO_ORIGINAL_DST``: a ``sockaddr_in``)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port


class _Delayed:
    """One direction of a connection: what was read, released ``delay`` seconds later, in order."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        self.held = 0
        self.room = asyncio.Condition()

    async def read_from(self, reader: asyncio.StreamReader) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await reader.read(CHUNK)
            async with self.room:
                await self.room.wait_for(lambda: self.held < IN_FLIGHT)
                self.held += len(data)
            self.queue.put_nowait((loop.time() + self.delay, data))
            if not data:
                return

    async def write_to(self, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, data = await self.queue.get()
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
            async with self.room:
                self.held -= len(data)
                self.room.notify_all()


async def _relay(one_way: float, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    up_writer = None
    try:
        host, port = original_destination(writer.get_extra_info("socket"))
        await asyncio.sleep(one_way)  # the dial reaches the other end one way later
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        upstream.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, MARK)
        upstream.setblocking(False)
        await asyncio.get_running_loop().sock_connect(upstream, (host, port))
        up_reader, up_writer = await asyncio.open_connection(sock=upstream)
        await asyncio.sleep(one_way)  # and its answer comes back one way later: nothing flows before
        out, back = _Delayed(one_way), _Delayed(one_way)
        tasks = [
            asyncio.ensure_future(c)
            for c in (out.read_from(reader), out.write_to(up_writer), back.read_from(up_reader), back.write_to(writer))
        ]
        _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:  # one side failed: the others end with it, as over a dropped connection
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    except OSError:
        pass  # the upstream dial failed: the dialer sees its connection closed
    finally:
        for w in (writer, up_writer):
            if w is not None:
                w.close()


async def serve(port: int, one_way: float) -> None:
    server = await asyncio.start_server(lambda r, w: _relay(one_way, r, w), "127.0.0.1", port, reuse_address=True)
    print("ready", flush=True)  # the lab waits for this before any peer dials
    async with server:
        await server.serve_forever()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--one-way-ms", type=float, required=True)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.port, args.one_way_ms / 1000))


if __name__ == "__main__":
    main()
