"""A member's part of a group all-reduce, as its reducer: contributions in, one averaged part out.

Member i of a group reduces part i of the group's flat tensor (``allreduce.py`` cuts it). It takes
each member's encoded contribution to that part, once; when it holds all of them it computes their
combination (``aggregation.py``) in member order, encodes it once with the run's codec (adding what
its last encoding of an overlapping range dropped: error feedback on the reducer's side) and serves
those same bytes to every member until the part is forgotten. A part that never gets every
contribution is never served: members that ask are told so at its deadline (``INTERNAL_ERROR``).

Contributions may arrive before this peer reached the round: they wait for the part to be
registered, at most one join window and one deadline. A contribution for a group this peer formed
with other members is refused at once (``BAD_GROUP_ID``).

**Reducing for a group we are not in.** A group whose members nobody can dial (``allreduce.py``: they are
all clients) names a reachable outsider as its reducer. Its contributions then carry the part's
description (:class:`PartSpec`, after the part's key in the first message's ``group_id``), and the
outsider creates the part on demand when the description checks out (it names us as the reducer, its
group id is the hash of its contributors and reducers, the sender is a contributor): a part whose
contributors are the group's members, to which it adds nothing itself (weight 0: it is not averaged in).
At most ``MAX_ADOPTED`` such parts are open at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sys
import time
from dataclasses import dataclass, field

import torch
from hivemind.proto import averaging_pb2

from p2p_spes.averaging.aggregation import Aggregator
from p2p_spes.averaging.compression import Codec
from p2p_spes.averaging.transport import (
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
MISSING = averaging_pb2.INTERNAL_ERROR  # the part has no result: a contribution never came
MAX_ADOPTED = 32  # parts of groups we are not in (outsider reductions) open at once
MAX_ADOPTED_VALUES = 1 << 28  # values of one such part: a description cannot make us hold more


def group_id(members: list[str], reducers: list[str] | None = None, bandwidths: list[float] | None = None) -> str:
    """A flat group's id: the hash of its sorted members, and of who reduces which share when that is not
    every member in equal parts (members that decided another split get another id and fail loudly)."""
    if not reducers and not bandwidths:
        return hashlib.sha256(pack(list(members))).hexdigest()[:16]
    return hashlib.sha256(pack([list(members), list(reducers or members), list(bandwidths or [])])).hexdigest()[:16]


@dataclass(frozen=True)
class PartSpec:
    """What an outsider needs to reduce a part of a group it is not in (module docstring). ``seconds`` is
    the time left until the group's deadline when it was sent (monotonic clocks differ across machines)."""

    contributors: tuple[str, ...]
    reducers: tuple[str, ...]
    bandwidths: tuple[float, ...]
    gid: str
    index: int
    size: int
    start: int
    seconds: float
    name: str

    def packed(self) -> list:
        return [
            list(self.contributors),
            list(self.reducers),
            list(self.bandwidths),
            self.gid,
            self.index,
            self.size,
            self.start,
            float(self.seconds),
            self.name,
        ]

    @classmethod
    def unpacked(cls, value: object) -> PartSpec:
        """A description as it came; raises ``TransportError`` if it is malformed."""
        try:
            contributors, reducers, bandwidths, gid, index, size, start, seconds, name = value  # type: ignore[misc]
            spec = cls(
                tuple(contributors),
                tuple(reducers),
                tuple(float(b) for b in bandwidths),
                gid,
                index,
                size,
                start,
                float(seconds),
                name,
            )
        except (TypeError, ValueError):
            raise TransportError("malformed part description") from None
        strings = all(isinstance(p, str) for p in spec.contributors + spec.reducers)
        ints = all(type(v) is int and v >= 0 for v in (spec.index, spec.size, spec.start))
        if not (strings and ints and isinstance(spec.gid, str) and isinstance(spec.name, str)):
            raise TransportError("malformed part description")
        return spec


@dataclass
class Part:
    """The part of one group attempt this peer reduces."""

    members: list[str]
    gid: str
    shape: tuple[int, ...]
    deadline: float
    name: str = ""  # the group's name (same every round): the reducer's residual is kept under it
    start: int = 0  # where this part starts in the group's flat tensor
    # a row's part of a bounded group (grid_allreduce.py): its result is the row's combination, kept
    # here (not encoded or served) for its reducer to take into the columns; it may close without everyone
    relay: bool = False
    contributions: dict[str, tuple[float, torch.Tensor]] = field(default_factory=dict)
    messages: dict[str, torch.Tensor] = field(default_factory=dict)  # as they came (a forwarding codec's)
    result_parts: list | None = None
    message: torch.Tensor | None = None
    result: torch.Tensor | None = None
    weight: float = 0.0  # of the contributions combined into the result
    done: asyncio.Event = field(default_factory=asyncio.Event)
    clients: frozenset[str] = frozenset()  # members that reduce nothing: the reducer waits for their fetches
    fetched: set[str] = field(default_factory=set)  # members the whole result was streamed to
    clients_served: asyncio.Event = field(default_factory=asyncio.Event)

    def served(self, peer: str) -> None:
        """``peer`` has been streamed the whole result; once every client has, ``clients_served`` is set."""
        self.fetched.add(peer)
        if self.clients <= self.fetched:
            self.clients_served.set()


class PartServer:
    """The parts this peer reduces, keyed by ``pack([round, group key, group id, index])``, and the two
    RPC handlers members call (:meth:`contribute`, :meth:`fetch`)."""

    def __init__(self, codec: Codec, aggregate: Aggregator, wait: float) -> None:
        self.codec, self.aggregate = codec, aggregate
        self.wait = wait  # how long a contribution waits for us to reach its round (window + deadline)
        self.parts: dict[bytes, Part] = {}
        self._awaited: dict[bytes, asyncio.Event] = {}  # keys (parts, columns) a caller waits to see
        self.decided: dict[tuple[int, str], str] = {}  # (round, group key) -> our group id, once known
        # what our encodings of averaged parts dropped, by group name: (start, values), added the next
        # time we reduce an overlapping range (CPU, fp32, about 1/members of each group's tensor)
        self.residual: dict[str, tuple[int, torch.Tensor]] = {}
        # the results of the columns of bounded groups we hold (grid_allreduce.py): the column's encoded
        # averaged parts, or None when the column failed; served to any peer that asks, by key
        self.columns: dict[bytes, list[torch.Tensor] | None] = {}
        # the column keys we will publish, by (round, group), once our grid for it is decided: a key of
        # that round we do not hold is answered at once (a peer with another view of the group asked)
        self.holding: dict[tuple[int, str], set[bytes]] = {}
        self.peer_id = ""  # ours: a part described to us (outsider reduction) must name us; "" takes none
        self.adopted: set[bytes] = set()  # keys of the parts we reduce for groups we are not in

    def register(self, key: bytes, part: Part) -> None:
        """Start reducing ``part``; contributions that came early stop waiting for it."""
        self.parts[key] = part
        self._arrived(key)

    def forget_later(self, key: bytes, decided: tuple[int, str], seconds: float) -> None:
        """Drop the part after ``seconds`` (it serves stragglers until then), its decision after 3x."""
        loop = asyncio.get_running_loop()
        loop.call_later(seconds, self.parts.pop, key, None)
        loop.call_later(3 * seconds, self.decided.pop, decided, None)

    def adopt(self, key: bytes, spec: PartSpec, sender: str) -> Part | None:
        """The part ``spec`` describes (we reduce it for a group we are not in), created on its first
        contribution; None when the description does not check out (see the module docstring)."""
        part = self.parts.get(key)
        if part is not None:  # every contributor must describe the same part
            same = part.members == list(spec.contributors) and part.gid == spec.gid and part.start == spec.start
            return part if same and part.shape == (spec.size,) else None
        try:
            round_no, group, gid, index = unpack(key)
        except (TransportError, ValueError):
            return None
        if (
            not self.peer_id
            or gid != spec.gid
            or index != spec.index
            or spec.index >= len(spec.reducers)
            or spec.reducers[spec.index] != self.peer_id
            or self.peer_id in spec.contributors
            or sender not in spec.contributors
            or list(spec.contributors) != sorted(set(spec.contributors))
            or spec.gid != group_id(list(spec.contributors), list(spec.reducers), list(spec.bandwidths))
            or not 0 < spec.seconds <= self.wait * len(spec.contributors)  # one reducer carries them all
            or spec.size > MAX_ADOPTED_VALUES
            or len(self.adopted) >= MAX_ADOPTED
        ):
            return None
        part = Part(
            list(spec.contributors),
            gid,
            (spec.size,),
            time.monotonic() + spec.seconds,
            name=spec.name,
            start=spec.start,
            clients=frozenset(spec.contributors),
        )
        self.register(key, part)
        self.adopted.add(key)
        self.forget_later(key, (round_no, group), spec.seconds + self.wait)
        asyncio.get_running_loop().call_later(spec.seconds + self.wait, self.adopted.discard, key)
        log.info("reducing part %d of %s for a group we are not in (%d members)", index, group, len(part.members))
        return part

    def adopted_until(self, round_no: int) -> float:
        """When the last part of ``round_no`` we reduce for a group we are not in has its deadline
        (monotonic; 0.0: none), and earlier once each of its contributors has fetched its result."""
        ends = [
            part.deadline
            for key in self.adopted
            if (part := self.parts.get(key)) is not None
            and unpack(key)[0] == round_no
            and not part.clients_served.is_set()
        ]
        return max(ends, default=0.0)

    async def wait_part(self, key: bytes) -> Part | None:
        """Our part for ``key``, waiting while we have not reached that round yet."""
        try:
            round_no, group, gid, _ = unpack(key)
        except (TransportError, ValueError):
            return None
        decided = self.decided.get((round_no, group))
        if decided is not None and decided != gid and key not in self.adopted:
            return None  # we formed this group with other members: refuse at once (unless we reduce for it)
        if key not in self.parts:
            await self._await(key)
        return self.parts.get(key)

    def _arrived(self, key: bytes) -> None:
        """A part was registered or a column published under ``key``: callers waiting for it go on."""
        if key in self._awaited:
            self._awaited.pop(key).set()

    async def _await(self, key: bytes) -> None:
        """Wait (at most ``self.wait``) for ``key`` to be registered or published."""
        try:
            await asyncio.wait_for(self._awaited.setdefault(key, asyncio.Event()).wait(), self.wait)
        except asyncio.TimeoutError:
            pass

    def publish(self, key: bytes, messages: list[torch.Tensor] | None, seconds: float) -> None:
        """Serve a column's result (``None``: it failed) under ``key`` for ``seconds``."""
        self.columns[key] = messages
        self._arrived(key)
        asyncio.get_running_loop().call_later(seconds, self.columns.pop, key, None)

    async def column(self, request: averaging_pb2.AveragingData, context):
        """Handler: a column's result, its encoded parts one tensor after another, once we have it
        (``MISSING``: it failed, or we did not hold it by the time we stopped waiting)."""
        key = request.group_id
        try:
            round_no, uid = unpack(key)
            ours = self.holding.get((round_no, str(uid).rsplit("/c", 1)[0]))
        except (TransportError, ValueError, TypeError):
            ours = set()
        if key not in self.columns and ours is not None and key not in ours:
            yield averaging_pb2.AveragingData(code=MISSING)
            return
        if key not in self.columns:
            await self._await(key)
        messages = self.columns.get(key)
        if messages is None:
            yield averaging_pb2.AveragingData(code=MISSING)
            return
        for message in messages:
            for chunk in serialize_parts(message):
                yield averaging_pb2.AveragingData(code=OK, tensor_part=chunk)

    async def contribute(self, stream, context) -> averaging_pb2.AveragingData:
        """Handler: a member's encoded contribution to our part (the first message names the part)."""
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
            if len(tensors) > 1 or not sys.float_info.min <= first.weight < float("inf"):
                return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            key, spec = described(first.group_id)
            part = self.adopt(key, spec, sender) if spec is not None else await self.wait_part(key)
            if part is not None and sender in part.contributions:
                return averaging_pb2.AveragingData(code=TAKEN)
            if part is None or sender not in part.members or part.done.is_set():
                return averaging_pb2.AveragingData(code=BAD)
            message = parse_tensor(tensors[0] if tensors else [])
            tensor = self.codec.decode(message, part.shape[0])
        except TruncatedStream as exc:
            log.info("a contribution from %s came truncated (%s); asking for it again", sender, exc)
            return averaging_pb2.AveragingData(code=AGAIN)
        except TransportError as exc:
            log.warning("refused a contribution from %s: %s", sender, exc)
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        except Exception as exc:
            log.warning("contribution from %s failed: %r", sender, exc)
            return averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
        self.add(part, sender, first.weight, tensor, message)
        return averaging_pb2.AveragingData(code=OK)

    async def fetch(self, request: averaging_pb2.AveragingData, context):
        """Handler: our averaged part, streamed, once every contribution came (or ``MISSING`` at its deadline)."""
        part = await self.wait_part(request.group_id)
        if part is None or context.remote_id.to_base58() not in part.members:
            yield averaging_pb2.AveragingData(code=BAD)
            return
        try:
            await asyncio.wait_for(part.done.wait(), max(part.deadline - time.monotonic(), 0.01))
        except asyncio.TimeoutError:
            pass
        if part.result_parts is None:
            yield averaging_pb2.AveragingData(code=MISSING)
            return
        for chunk in part.result_parts:
            yield averaging_pb2.AveragingData(code=OK, tensor_part=chunk)
        part.served(context.remote_id.to_base58())

    def add(self, part: Part, peer: str, weight: float, tensor: torch.Tensor, message: torch.Tensor) -> None:
        """Take ``peer``'s contribution (decoded, and as it came); with the last one, compute the result."""
        part.contributions[peer] = (weight, tensor)
        if self.codec.forwards:
            part.messages[peer] = message
        if len(part.contributions) == len(part.members):
            self.close(part)

    def close(self, part: Part) -> None:
        """Combine the contributions that came, in member order (all of them, except for a relayed part
        closed at its deadline), and encode the result once unless it is relayed."""
        if part.done.is_set() or not part.contributions:
            return
        order = sorted(part.contributions)
        weights = [part.contributions[p][0] for p in order]
        part.weight = float(sum(weights))
        if self.codec.forwards and not part.relay:  # the members' messages as they came, in member order
            part.message = self.codec.result.bundle([part.messages[p] for p in order], weights, part.shape[0])
            part.result = self.codec.result.decode(part.message, part.shape[0])
        elif part.relay:
            part.result = self.aggregate([part.contributions[p][1] for p in order], weights)
        else:
            averaged = self.aggregate([part.contributions[p][1] for p in order], weights)
            part.message, part.result = self.encode_result(part, averaged)
        if part.message is not None:
            part.result_parts = serialize_parts(part.message)
        part.done.set()

    def encode_result(self, part: Part, averaged: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode our averaged part once, with what our last encoding of an overlapping range dropped."""
        if self.codec.lossless:
            message = self.codec.encode(averaged)
            return message, self.codec.decode(message, averaged.numel())
        end = part.start + averaged.numel()
        start0, residual = self.residual.get(part.name, (0, torch.empty(0)))
        lo, hi = max(start0, part.start), min(start0 + residual.numel(), end)
        compensated = averaged.clone()
        if lo < hi:
            compensated[lo - part.start : hi - part.start] += residual[lo - start0 : hi - start0]
        codec = self.codec.result_for(len(part.contributions))  # the mean of n messages: at most n x k values a block
        message = codec.encode(compensated)
        decoded = codec.decode(message, averaged.numel())
        self.residual[part.name] = (part.start, compensated - decoded)
        return message, decoded


def describe(key: bytes, spec: PartSpec) -> bytes:
    """A part's key followed by its description: what a contribution to an outsider names."""
    return pack([*unpack(key), spec.packed()])


def described(group_id: bytes) -> tuple[bytes, PartSpec | None]:
    """The part key a contribution names, and the part's description if it carries one."""
    try:
        fields = unpack(group_id)
    except TransportError:
        return group_id, None
    if not isinstance(fields, list) or len(fields) != 5:
        return group_id, None
    return pack(fields[:4]), PartSpec.unpacked(fields[4])
