"""Deadline-bounded group all-reduce over hivemind's DHT and libp2p streams.

Why not hivemind's ``DecentralizedAverager``: each one is a forked process (one per expert group
starved 2 cores here), its butterfly applies *deltas* so peers end a round a few ulps apart (not
bit-identical), and a peer lost mid-round can leave partially averaged tensors behind. This module
keeps hivemind's DHT, transport and compression and runs the protocol in the trainer's own event
loop:

1. **Join.** Each member writes ``(weight, arrival time, proposed window, base)`` under the group's DHT
   key. The group is everyone who arrived within the first arrival's proposed window (at most
   ``matchmaking_time``) of it; a member stops waiting early once every peer it expects has arrived.
   The sorted member list hashes to a group id. The *base* is the digest (and round) of the value the
   tensor is relative to (a pseudo-gradient's anchor): the group agrees on the newest one its members
   name, and a member holding another first takes the agreed one from a member (``rebase``).
2. **Reduce-scatter.** The flat tensor is cut into one part per member; member i receives part i
   from everyone, encoded with the run's codec (``compression.py``), and computes the weighted mean in
   member order.
3. **All-gather.** The reducer encodes its averaged part once (adding what its last encoding of that
   range dropped: error feedback on the reducer's side too) and serves those same bytes to everyone,
   so every member decodes bit-identical values. Members keep the encoded parts: a peer that holds
   the base can rebuild the result from them alone (a frozen expert's refresh).

Any missing contribution or part before the deadline fails the round *for the whole group*: a
reducer either serves one result to everybody or none, and a member applies nothing unless it has
every part. Views of the membership that differ give different group ids and fail loudly. A stream
cut short (hivemind ends one silently when its connection closes) is not a failure yet: the part is
sent or fetched again, up to ``ATTEMPTS`` times within the deadline, and a reducer that already holds
a contribution whose reply was lost says so (``TAKEN``) instead of refusing it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2PHandlerError, PeerID
from hivemind.proto import averaging_pb2

from dht.keys import group_key
from p2p_spes.aggregation import Aggregator, weighted_mean
from p2p_spes.compression import Codec
from p2p_spes.matchmaking import Base, agreed_base, join_group
from p2p_spes.transport import (
    TransportError,
    TruncatedStream,
    collect_tensors,
    pack,
    parse_tensor,
    serialize_parts,
    unpack,
)

log = logging.getLogger(__name__)
OK, BAD = averaging_pb2.AVERAGED_PART, averaging_pb2.BAD_GROUP_ID
AGAIN = averaging_pb2.CANCELLED  # a contribution's stream ended early: send it again
TAKEN = averaging_pb2.DUPLICATE_PEER_ID  # we already hold this sender's contribution (its reply was lost)
ATTEMPTS = 3  # sends and fetches of one part, within the group's deadline


Rebase = Callable[[Base, list[str]], Awaitable[None]]


@dataclass
class GroupResult:
    tensor: torch.Tensor | None  # the group's average, decoded (the same bits on every member)
    members: list[str]
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    error: str | None = None
    transfer_seconds: float = 0.0  # from the membership decided to the result (or the failure)
    lateness: dict[str, float] = field(default_factory=dict)  # every arrival's delay after the first, seconds
    window: float = 0.0  # the join window the group used (the first arrival's proposal)
    sent: torch.Tensor | None = None  # our contribution as the reducers decoded it (error feedback)
    messages: list[torch.Tensor] = field(default_factory=list)  # the encoded averaged parts, in order
    base: Base | None = None  # the base the group agreed on
    retries: int = 0  # parts sent or fetched again after their stream was cut short

    @property
    def ok(self) -> bool:
        return self.tensor is not None


@dataclass
class _Part:
    members: list[str]
    gid: str
    shape: tuple[int, ...]
    deadline: float
    name: str = ""  # the group's name (same every round): the reducer's residual is kept under it
    start: int = 0  # where this part starts in the group's flat tensor
    contributions: dict[str, tuple[float, torch.Tensor]] = field(default_factory=dict)
    result_parts: list | None = None
    message: torch.Tensor | None = None
    result: torch.Tensor | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class GroupAllReduce:
    """Serves and runs all-reduce rounds for one peer. Create and use it inside one event loop."""

    def __init__(
        self, dht, p2p, peer_id: str, run_id: str, *, owner: bytes, compression: str | Codec = "none",
        matchmaking_time: float = 3.0, timeout: float = 30.0,
        aggregate: Aggregator | None = None,
    ) -> None:
        self.dht, self.p2p, self.peer_id, self.run_id = dht, p2p, peer_id, run_id
        self.owner = owner  # our signed subkey (dht/identity.py): nobody can join a group in our name
        self.codec = compression if isinstance(compression, Codec) else Codec(compression)
        self.matchmaking_time, self.timeout = matchmaking_time, timeout
        self.aggregate = aggregate or weighted_mean
        self._parts: dict[bytes, _Part] = {}
        # what we moved as a reducer for others (contributions in, averaged parts out), for accounting
        self.served_in = self.served_out = 0
        self._registered: dict[bytes, asyncio.Event] = {}
        self._decided: dict[tuple[int, str], str] = {}  # (round, group) -> our group id, once known
        # what our encodings of averaged parts dropped, by group name: (start, values), added the next
        # time we reduce an overlapping range (CPU, fp32, about 1/members of each group's tensor)
        self.reducer_residual: dict[str, tuple[int, torch.Tensor]] = {}

    @property
    def _contribute_name(self) -> str:
        return f"{self.run_id}.allreduce.contribute"

    @property
    def _fetch_name(self) -> str:
        return f"{self.run_id}.allreduce.fetch"

    async def start(self) -> None:
        await self.p2p.add_protobuf_handler(
            self._contribute_name, self._rpc_contribute, averaging_pb2.AveragingData, stream_input=True
        )
        await self.p2p.add_protobuf_handler(
            self._fetch_name, self._rpc_fetch, averaging_pb2.AveragingData, stream_output=True
        )

    # Server side ---------------------------------------------------------------------------
    async def _wait_part(self, key: bytes) -> _Part | None:
        """Our part for ``key``, waiting while we have not reached that round yet."""
        try:
            round_no, group, gid, _ = unpack(key)
        except (TransportError, ValueError):
            return None
        decided = self._decided.get((round_no, group))
        if decided is not None and decided != gid:
            return None  # we formed this group with other members: refuse at once
        if key not in self._parts:
            event = self._registered.setdefault(key, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), self.matchmaking_time + self.timeout)
            except asyncio.TimeoutError:
                return None
        return self._parts.get(key)

    async def _rpc_contribute(self, stream, context) -> averaging_pb2.AveragingData:
        sender = context.remote_id.to_base58()
        try:
            messages = [m async for m in stream]
            if not messages:
                return averaging_pb2.AveragingData(code=AGAIN)
            first = messages[0]

            async def replay():
                for m in messages:
                    yield m

            _, tensors = await collect_tensors(replay())
            if len(tensors) > 1 or not first.weight > 0:
                return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            part = await self._wait_part(first.group_id)
            if part is not None and sender in part.contributions:
                return averaging_pb2.AveragingData(code=TAKEN)
            if part is None or sender not in part.members or part.done.is_set():
                return averaging_pb2.AveragingData(code=BAD)
            message = parse_tensor(tensors[0] if tensors else [])
            tensor = self.codec.decode(message, part.shape[0])
            self.served_in += sum(m.tensor_part.ByteSize() for m in messages)
        except TruncatedStream as exc:
            log.info("a contribution from %s came truncated (%s); asking for it again", sender, exc)
            return averaging_pb2.AveragingData(code=AGAIN)
        except TransportError as exc:
            log.warning("refused a contribution from %s: %s", sender, exc)
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        except Exception as exc:
            log.warning("contribution from %s failed: %r", sender, exc)
            return averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
        self._add(part, sender, first.weight, tensor)
        return averaging_pb2.AveragingData(code=OK)

    async def _rpc_fetch(self, request: averaging_pb2.AveragingData, context):
        part = await self._wait_part(request.group_id)
        if part is None or context.remote_id.to_base58() not in part.members:
            yield averaging_pb2.AveragingData(code=BAD)
            return
        try:
            await asyncio.wait_for(part.done.wait(), max(part.deadline - time.monotonic(), 0.01))
        except asyncio.TimeoutError:
            pass
        if part.result_parts is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
            return
        for chunk in part.result_parts:
            self.served_out += chunk.ByteSize()
            yield averaging_pb2.AveragingData(code=OK, tensor_part=chunk)

    def _add(self, part: _Part, peer: str, weight: float, tensor: torch.Tensor) -> None:
        part.contributions[peer] = (weight, tensor)
        if len(part.contributions) == len(part.members):
            order = sorted(part.contributions)
            averaged = self.aggregate([part.contributions[p][1] for p in order], [part.contributions[p][0] for p in order])
            part.message, part.result = self._encode_result(part, averaged)
            part.result_parts = serialize_parts(part.message)
            part.done.set()

    def _encode_result(self, part: _Part, averaged: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode our averaged part once, with what our last encoding of an overlapping range dropped."""
        if self.codec.lossless:
            message = self.codec.encode(averaged)
            return message, self.codec.decode(message, averaged.numel())
        end = part.start + averaged.numel()
        start0, residual = self.reducer_residual.get(part.name, (0, torch.empty(0)))
        lo, hi = max(start0, part.start), min(start0 + residual.numel(), end)
        compensated = averaged.clone()
        if lo < hi:
            compensated[lo - part.start:hi - part.start] += residual[lo - start0:hi - start0]
        message = self.codec.encode(compensated)
        decoded = self.codec.decode(message, averaged.numel())
        self.reducer_residual[part.name] = (part.start, compensated - decoded)
        return message, decoded

    # Client side ---------------------------------------------------------------------------
    def solo(self, tensor: torch.Tensor, result: GroupResult | None = None) -> GroupResult:
        """A group of one: its result is our own tensor as the codec carries it (what a peer that
        rebuilds it from the encoded message gets too)."""
        result = result or GroupResult(None, [self.peer_id])
        message = self.codec.encode(tensor)
        result.tensor = result.sent = self.codec.decode(message, tensor.numel())
        result.messages = [message]
        return result

    async def run(self, round_no: int, group: str, tensor: torch.Tensor | Callable[[], torch.Tensor],
                  weight: float, expected: set[str], on_members: Callable[[], None] | None = None,
                  window: float | None = None, timeout: float | None = None,
                  base: Base | None = None, rebase: Rebase | None = None) -> GroupResult:
        """All-reduce ``tensor`` (flat fp32, CPU) with the peers that join ``group`` of ``round_no``.

        ``on_members`` is called once the membership is decided (or matchmaking failed). ``window`` is the
        join window this peer proposes and ``timeout`` its deadline for the transfers (both measured by
        the caller; at most the configured ``matchmaking_time`` and ``timeout``). With ``base``, when the
        group agrees on another base, ``rebase(digest, members holding it)`` is awaited first (it must
        take that base or raise); ``tensor`` may then be a function, called after it.
        """
        t0 = time.monotonic()
        window = self.matchmaking_time if window is None else min(window, self.matchmaking_time)
        timeout = self.timeout if timeout is None else min(timeout, self.timeout)
        try:
            joined = await join_group(
                self.dht, group_key(self.run_id, round_no, group), self.peer_id, self.owner,
                set(expected) | {self.peer_id}, weight, window, base,
                matchmaking_time=self.matchmaking_time, ttl=self.matchmaking_time + self.timeout + 30)
            members, lateness, agreed, bases = joined.members, joined.lateness, joined.window, joined.bases
        except asyncio.TimeoutError:
            result = GroupResult(None, [])
            result.error, result.seconds = "the DHT did not answer during matchmaking", time.monotonic() - t0
            log.warning("round %d group %s failed: %s", round_no, group, result.error)
            return result
        finally:
            if on_members is not None:
                on_members()
        result = GroupResult(None, members, lateness=lateness, window=agreed)
        t_decided = time.monotonic()
        if self.peer_id not in members:
            result.error = "arrived after the group closed"
            return result
        result.base = agreed_base(bases)
        deadline = time.monotonic() + timeout
        if len(members) == 1:
            self.solo(tensor() if callable(tensor) else tensor, result)
            result.seconds = time.monotonic() - t0
            return result
        gid = hashlib.sha256(pack(members)).hexdigest()[:16]
        self._decided[(round_no, group)] = gid
        keys = [pack([round_no, group, gid, i]) for i in range(len(members))]
        mine = members.index(self.peer_id)
        part: _Part | None = None
        sizes: list[int] = []
        sent_parts: list[torch.Tensor | None] = [None] * len(members)
        received: list[torch.Tensor | None] = [None] * len(members)

        async def prepare() -> list[torch.Tensor]:
            """Our contribution cut into encoded parts, once we hold the group's base; then our part is
            registered (a member's contribution that comes earlier waits for it)."""
            nonlocal part
            if base is not None and result.base is not None and result.base.digest != base.digest:
                holders = [p for p in members if p in bases and bases[p].digest == result.base.digest]
                if rebase is None:
                    raise TransportError(f"the group agreed on base {result.base.digest[:12]}, we hold another")
                await rebase(result.base, holders)
            flat = tensor() if callable(tensor) else tensor
            chunks = torch.tensor_split(flat, len(members))
            sizes[:] = [len(c) for c in chunks]
            part = _Part(members, gid, (sizes[mine],), deadline, name=group, start=sum(sizes[:mine]))
            self._parts[keys[mine]] = part
            if keys[mine] in self._registered:
                self._registered.pop(keys[mine]).set()
            return [self.codec.encode(c.contiguous()) for c in chunks]

        messages_out: list[torch.Tensor] = []

        async def contribute(i: int, peer: str) -> None:
            message = messages_out[i]
            sent_parts[i] = self.codec.decode(message, sizes[i])  # what the reducer will decode
            if peer == self.peer_id:
                self._add(part, peer, float(weight), sent_parts[i])
                return
            chunk_parts = serialize_parts(message)
            result.bytes_sent += sum(c.ByteSize() for c in chunk_parts)

            async def messages():
                for j, c in enumerate(chunk_parts):
                    yield averaging_pb2.AveragingData(
                        code=averaging_pb2.PART_FOR_AVERAGING, group_id=keys[i] if j == 0 else b"",
                        weight=float(weight) if j == 0 else 0.0, tensor_part=c,
                    )

            for attempt in range(ATTEMPTS):
                if attempt:  # the last send was cut short or its reply lost: it goes again
                    result.retries += 1
                    result.bytes_sent += sum(c.ByteSize() for c in chunk_parts)
                try:
                    reply = await self.p2p.call_protobuf_handler(PeerID.from_base58(peer), self._contribute_name,
                                                                 messages(), averaging_pb2.AveragingData)
                except (ValueError, P2PHandlerError) as exc:
                    # the stream closed before the reply: the reducer answers TAKEN if our part got there
                    if attempt == ATTEMPTS - 1:
                        # (or it finished its round and moved on: its result, served only if it has
                        # every contribution, will tell)
                        log.info("no reply from %s to our contribution (%s); its result will tell", peer, exc)
                        return
                    reply = averaging_pb2.AveragingData(code=AGAIN)
                if reply.code in (OK, TAKEN):
                    return
                if reply.code != AGAIN:
                    raise TransportError(f"{peer} refused our contribution (code {reply.code})")
            raise TruncatedStream(f"our contribution to {peer} was cut short {ATTEMPTS} times")

        async def fetch_once(i: int, peer: str) -> torch.Tensor:
            stream = await self.p2p.iterate_protobuf_handler(
                PeerID.from_base58(peer), self._fetch_name, averaging_pb2.AveragingData(group_id=keys[i]),
                averaging_pb2.AveragingData,
            )
            chunks_in = []
            async for message in stream:
                if message.code != OK:
                    raise TransportError(f"{peer} could not serve averaged part {i} (code {message.code})")
                chunks_in.append(message.tensor_part)
                result.bytes_received += message.tensor_part.ByteSize()
            received[i] = parse_tensor(chunks_in)
            return self.codec.decode(received[i], sizes[i])

        async def fetch(i: int, peer: str) -> torch.Tensor:
            if peer == self.peer_id:
                await part.done.wait()
                return part.result
            for attempt in range(ATTEMPTS):
                try:
                    return await fetch_once(i, peer)
                except TruncatedStream as exc:  # the reducer serves the same bytes until the round is over
                    if attempt == ATTEMPTS - 1:
                        raise
                    log.info("averaged part %d from %s came truncated (%s); fetching it again", i, peer, exc)
                    result.retries += 1
            raise AssertionError("unreachable")

        try:
            messages_out[:] = await asyncio.wait_for(prepare(), timeout)
            await asyncio.wait_for(asyncio.gather(*(contribute(i, p) for i, p in enumerate(members))),
                                   max(deadline - time.monotonic(), 0.1))
            remaining = max(deadline - time.monotonic(), 0.1)
            parts = await asyncio.wait_for(asyncio.gather(*(fetch(i, p) for i, p in enumerate(members))), remaining)
            result.tensor, result.sent = torch.cat(parts), torch.cat(sent_parts)
            received[mine] = part.message
            result.messages = list(received)
        except Exception as exc:  # a failed round is discarded whatever went wrong
            result.error = f"{type(exc).__name__}: {exc}"
            log.warning("round %d group %s failed: %s", round_no, group, result.error)
        finally:
            loop = asyncio.get_running_loop()
            loop.call_later(self.timeout + self.matchmaking_time, self._parts.pop, keys[mine], None)
            loop.call_later(3 * (self.timeout + self.matchmaking_time), self._decided.pop, (round_no, group), None)
        result.seconds, result.transfer_seconds = time.monotonic() - t0, time.monotonic() - t_decided
        return result
