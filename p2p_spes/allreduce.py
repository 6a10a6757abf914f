"""Deadline-bounded group all-reduce over hivemind's DHT and libp2p streams.

Why not hivemind's ``DecentralizedAverager``: each one is a forked process (one per expert group
starved 2 cores here), its butterfly applies *deltas* so peers end a round a few ulps apart (not
bit-identical), and a peer lost mid-round can leave partially averaged tensors behind. This module
keeps hivemind's DHT, transport and compression and runs the protocol in the trainer's own event
loop:

1. **Join.** Each member writes ``(weight, arrival time, proposed window)`` under the group's DHT key.
   The group is everyone who arrived within the first arrival's proposed window (at most
   ``matchmaking_time``) of it; a member stops waiting early once every peer it expects has arrived.
   The sorted member list hashes to a group id.
2. **Reduce-scatter.** The flat tensor is cut into one part per member; member i receives part i
   from everyone (compressed) and computes the weighted mean in member order.
3. **All-gather.** Everyone fetches each averaged part from its reducer. The reducer keeps exactly
   the bytes it serves, so every member ends with bit-identical values.

Any missing contribution or part before the deadline fails the round *for the whole group*: a
reducer either serves one result to everybody or none, and a member applies nothing unless it has
every part. Views of the membership that differ give different group ids and fail loudly.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

from dht.keys import group_key
from dht.records import signed_values
from p2p_spes.aggregation import Aggregator, weighted_mean
from p2p_spes.transport import TransportError, collect_tensors, pack, parse_tensor, serialize_parts, unpack

log = logging.getLogger(__name__)
OK, BAD = averaging_pb2.AVERAGED_PART, averaging_pb2.BAD_GROUP_ID


@dataclass
class GroupResult:
    tensor: torch.Tensor | None
    members: list[str]
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    error: str | None = None
    transfer_seconds: float = 0.0  # from the membership decided to the result (or the failure)
    lateness: dict[str, float] = field(default_factory=dict)  # every arrival's delay after the first, seconds
    window: float = 0.0  # the join window the group used (the first arrival's proposal)

    @property
    def ok(self) -> bool:
        return self.tensor is not None


@dataclass
class _Part:
    members: list[str]
    gid: str
    shape: tuple[int, ...]
    deadline: float
    contributions: dict[str, tuple[float, torch.Tensor]] = field(default_factory=dict)
    result_parts: list | None = None
    result: torch.Tensor | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class GroupAllReduce:
    """Serves and runs all-reduce rounds for one peer. Create and use it inside one event loop."""

    def __init__(
        self, dht, p2p, peer_id: str, run_id: str, *, owner: bytes, compression: str = "none",
        matchmaking_time: float = 3.0, timeout: float = 30.0,
        aggregate: Aggregator | None = None,
    ) -> None:
        self.dht, self.p2p, self.peer_id, self.run_id = dht, p2p, peer_id, run_id
        self.owner = owner  # our signed subkey (dht/identity.py): nobody can join a group in our name
        self.compression, self.matchmaking_time, self.timeout = compression, matchmaking_time, timeout
        self.aggregate = aggregate or weighted_mean
        self._parts: dict[bytes, _Part] = {}
        # what we moved as a reducer for others (contributions in, averaged parts out), for accounting
        self.served_in = self.served_out = 0
        self._registered: dict[bytes, asyncio.Event] = {}
        self._decided: dict[tuple[int, str], str] = {}  # (round, group) -> our group id, once known

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
                return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            first = messages[0]

            async def replay():
                for m in messages:
                    yield m

            _, tensors = await collect_tensors(replay())
            if len(tensors) != 1 or not first.weight > 0:
                return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            part = await self._wait_part(first.group_id)
            if part is None or sender not in part.members or sender in part.contributions or part.done.is_set():
                return averaging_pb2.AveragingData(code=BAD)
            tensor = parse_tensor(tensors[0], part.shape, torch.float32)
            self.served_in += sum(m.tensor_part.ByteSize() for m in messages)
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
            part.result_parts = serialize_parts(averaged, self.compression)
            part.result = parse_tensor(part.result_parts, part.shape, torch.float32)
            part.done.set()

    # Client side ---------------------------------------------------------------------------
    async def _members(self, key: str, expected: set[str], weight: float,
                       window: float) -> tuple[list[str], dict[str, float], float]:
        """Join the group's DHT record and return the agreed member list (see module docstring), every
        arrival's delay after the first, and the join window used.

        Each arrival proposes a join window (``window``, at most ``matchmaking_time``); the group uses the
        first arrival's proposal (ties by peer id), which every member reads from the same records.
        """
        arrival = get_dht_time()
        ttl = self.matchmaking_time + self.timeout + 30
        give_up = time.monotonic() + self.matchmaking_time + 10
        mine = {"peer_id": self.peer_id, "w": float(weight), "t": arrival, "m": float(window)}
        # every DHT request is bounded: one that never answers fails the round (asyncio.TimeoutError)
        await asyncio.wait_for(self.dht.store(key, mine, expiration_time=arrival + ttl, subkey=self.owner,
                                              return_future=True), self.matchmaking_time + 10)

        async def read() -> tuple[dict[str, float], float]:
            found = await asyncio.wait_for(self.dht.get(key, latest=True, return_future=True),
                                           max(give_up - time.monotonic(), 0.0) + 5)
            records = {p: v for p, v in signed_values(found).items()
                       if isinstance(v, dict) and isinstance(v.get("t"), float)}
            records.setdefault(self.peer_id, mine)
            return {p: v["t"] for p, v in records.items()}, self._agreed_window(records)

        while True:
            times, agreed = await read()
            cutoff = min(times.values()) + agreed
            if expected <= set(times) or get_dht_time() >= cutoff or time.monotonic() > give_up:
                break
            await asyncio.sleep(0.2)
        # One more read after a grace period, so that peers whose records landed just before the
        # cutoff are seen by everyone.
        await asyncio.sleep(0.5)
        times, agreed = await read()
        first = min(times.values())
        members = sorted(p for p, t in times.items() if t <= first + agreed)
        return members, {p: t - first for p, t in times.items()}, agreed

    def _agreed_window(self, records: dict[str, dict]) -> float:
        """The join window the first arrival proposed (ties by peer id), at most ``matchmaking_time``."""
        first = min(records, key=lambda p: (records[p]["t"], p))
        proposed = records[first].get("m")
        if isinstance(proposed, (int, float)) and not isinstance(proposed, bool) and proposed > 0:
            return min(float(proposed), self.matchmaking_time)
        return self.matchmaking_time

    async def run(self, round_no: int, group: str, tensor: torch.Tensor, weight: float, expected: set[str],
                  on_members: Callable[[], None] | None = None, window: float | None = None,
                  timeout: float | None = None) -> GroupResult:
        """All-reduce ``tensor`` (flat fp32, CPU) with the peers that join ``group`` of ``round_no``.

        ``on_members`` is called once the membership is decided (or matchmaking failed). ``window`` is the
        join window this peer proposes and ``timeout`` its deadline for the transfers (both measured by
        the caller; at most the configured ``matchmaking_time`` and ``timeout``).
        """
        t0 = time.monotonic()
        window = self.matchmaking_time if window is None else min(window, self.matchmaking_time)
        timeout = self.timeout if timeout is None else min(timeout, self.timeout)
        try:
            members, lateness, agreed = await self._members(
                group_key(self.run_id, round_no, group), set(expected) | {self.peer_id}, weight, window)
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
        if len(members) == 1:
            result.tensor, result.seconds = tensor, time.monotonic() - t0
            return result
        gid = hashlib.sha256(pack(members)).hexdigest()[:16]
        self._decided[(round_no, group)] = gid
        chunks = torch.tensor_split(tensor, len(members))
        deadline = time.monotonic() + timeout
        keys = [pack([round_no, group, gid, i]) for i in range(len(members))]
        mine = members.index(self.peer_id)
        part = _Part(members, gid, tuple(chunks[mine].shape), deadline)
        self._parts[keys[mine]] = part
        if keys[mine] in self._registered:
            self._registered.pop(keys[mine]).set()

        async def contribute(i: int, peer: str) -> None:
            chunk_parts = serialize_parts(chunks[i].contiguous(), self.compression)
            if peer == self.peer_id:
                self._add(part, peer, float(weight), parse_tensor(chunk_parts, part.shape, torch.float32))
                return
            result.bytes_sent += sum(c.ByteSize() for c in chunk_parts)

            async def messages():
                for j, c in enumerate(chunk_parts):
                    yield averaging_pb2.AveragingData(
                        code=averaging_pb2.PART_FOR_AVERAGING, group_id=keys[i] if j == 0 else b"",
                        weight=float(weight) if j == 0 else 0.0, tensor_part=c,
                    )

            reply = await self.p2p.call_protobuf_handler(PeerID.from_base58(peer), self._contribute_name, messages(),
                                                         averaging_pb2.AveragingData)
            if reply.code != OK:
                raise TransportError(f"{peer} refused our contribution (code {reply.code})")

        async def fetch(i: int, peer: str) -> torch.Tensor:
            if peer == self.peer_id:
                await part.done.wait()
                return part.result

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
            return parse_tensor(chunks_in, tuple(chunks[i].shape), torch.float32)

        try:
            await asyncio.wait_for(asyncio.gather(*(contribute(i, p) for i, p in enumerate(members))), timeout)
            remaining = max(deadline - time.monotonic(), 0.1)
            parts = await asyncio.wait_for(asyncio.gather(*(fetch(i, p) for i, p in enumerate(members))), remaining)
            result.tensor = torch.cat(parts)
        except Exception as exc:  # a failed round is discarded whatever went wrong
            result.error = f"{type(exc).__name__}: {exc}"
            log.warning("round %d group %s failed: %s", round_no, group, result.error)
        finally:
            loop = asyncio.get_running_loop()
            loop.call_later(self.timeout + self.matchmaking_time, self._parts.pop, keys[mine], None)
            loop.call_later(3 * (self.timeout + self.matchmaking_time), self._decided.pop, (round_no, group), None)
        result.seconds, result.transfer_seconds = time.monotonic() - t0, time.monotonic() - t_decided
        return result
