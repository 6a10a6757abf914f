"""The transfers of a flat group, once its membership is decided: reduce-scatter, then all-gather.

The flat tensor is cut into one part per *reducer*; reducer j reduces part j (its side is ``reducer.py``)
from every member's encoded contribution, then encodes its averaged part once and serves those same bytes
to everyone, so every member decodes bit-identical values. The reducers are the members that can be
dialled (all of them, unless some said they cannot: :attr:`FlatGroup.reducers`), in equal parts
(``torch.tensor_split``), or in proportion to the bandwidths they declared (hivemind's
``load_balance_peers``, told that the clients reduce nothing). A *client* (a member nobody can dial)
sends its encoded part to every reducer and fetches every part, and nobody opens a stream to it; a group
of clients alone is reduced by a reachable outsider (``reducer.PartSpec``). Members keep the encoded parts:
a peer that holds the base can rebuild the result from them alone (a frozen expert's refresh; each part
says its size). The attempt is all-or-nothing: a contribution that fails dooms it for everyone (that
reducer lacks it), a reducer serves nothing unless every member's contribution came (a lost client
fails the attempt at its deadline), and a member applies nothing unless it has every part.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from dataclasses import dataclass

import torch
from hivemind.averaging.load_balancing import load_balance_peers

from p2p_spes.averaging.attempt import Attempt, GroupResult, based_tensor
from p2p_spes.averaging.compression import Codec
from p2p_spes.averaging.membership import Base
from p2p_spes.averaging.part_client import PartClient, PartMissing, Undelivered
from p2p_spes.averaging.reducer import Part, PartServer, PartSpec, describe, group_id
from p2p_spes.averaging.transport import TransportError, TruncatedStream, gather_or_cancel, pack

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlatGroup:
    """A decided flat group: its members in order, the agreed bases and the transfers' deadline; who
    reduces (``reducers``, empty: every member) and the bandwidths they declared (aligned with them;
    0.0: not declared; empty: none did, equal parts)."""

    members: tuple[str, ...]
    bases: dict[str, Base]
    timeout: float  # seconds the transfers may take
    deadline: float  # monotonic time by which they must end
    reducers: tuple[str, ...] = ()
    bandwidths: tuple[float, ...] = ()

    @property
    def reducing(self) -> tuple[str, ...]:
        """The peers that reduce a part each, in part order."""
        return self.reducers or self.members

    @property
    def gid(self) -> str:
        """The group's id: the same on every member that decided the same membership and reducers (as
        before reducers existed when every member reduces an equal part)."""
        if self.reducing == self.members and not self.bandwidths:
            return group_id(list(self.members))
        return group_id(list(self.members), list(self.reducing), list(self.bandwidths))

    def sizes(self, numel: int) -> list[int]:
        """The size of each reducer's part: equal parts without bandwidths, else hivemind's load balance
        among every member with the clients' bandwidth 0 (they send and fetch, but reduce nothing)."""
        if not any(self.bandwidths):
            return [len(c) for c in torch.tensor_split(torch.empty(numel, dtype=torch.bool), len(self.reducing))]
        declared = [b if b > 0 else None for b in self.bandwidths]
        clients = sum(p not in self.reducing for p in self.members)
        try:
            with warnings.catch_warnings():  # hivemind asks scipy for a solver it deprecated: said once per group
                warnings.simplefilter("ignore", DeprecationWarning)
                return list(load_balance_peers(numel, declared + [0.0] * clients)[: len(self.reducing)])
        except Exception as exc:  # (a scipy that dropped that solver): equal parts, and members whose
            # scipy still solves it cut otherwise, which fails the attempt loudly (a part of the wrong size)
            log.warning("could not balance the parts by bandwidth (%r): equal parts", exc)
            return [len(c) for c in torch.tensor_split(torch.empty(numel, dtype=torch.bool), len(self.reducing))]


def exchange_bytes(codec: Codec, numel: int, members: int, reducers: int, reducing: bool) -> tuple[int, int]:
    """About the bytes one member sends and receives in a flat group's exchange of ``numel`` values,
    with ``reducers`` of its ``members`` reducing equal parts (headers and framing left out). A reducer
    sends the others' shares of its tensor and serves its averaged part to the other members; a client
    sends every share and fetches every part. Every member reducing: (members - 1) / members of a
    contribution and of a result each way."""
    contribution, result = codec.wire_bytes(numel), codec.result.wire_bytes(numel, members)
    if not reducing:
        return contribution, result
    share, others = 1 / max(reducers, 1), max(members - 1, 0)
    sent = (1 - share) * contribution + others * share * result
    received = others * share * contribution + (1 - share) * result
    return int(sent), int(received)


class FlatRound:
    """Runs one member's side of a flat group's transfers (the reducer side is the shared ``server``)."""

    def __init__(self, peer_id: str, codec: Codec, server: PartServer, client: PartClient, keep: float) -> None:
        self.peer_id, self.codec, self.server, self.client = peer_id, codec, server, client
        self.keep = keep  # seconds a finished part stays served (late fetchers, rebuilds)

    async def run(self, attempt: Attempt, group: FlatGroup, result: GroupResult) -> None:
        """The transfers of ``attempt`` among ``group``, into ``result`` (``tensor`` and ``messages`` on
        success; ``error``, ``retryable``, ``lost`` and ``doomed`` on failure)."""
        reducers = list(group.reducing)
        gid = group.gid
        self.server.decided[(attempt.round_no, attempt.key)] = gid
        keys = [pack([attempt.round_no, attempt.key, gid, i]) for i in range(len(reducers))]
        mine = reducers.index(self.peer_id) if self.peer_id in reducers else None  # None: we are a client
        exchange = _Exchange(self, attempt, group, keys, mine, result)
        try:
            try:
                await asyncio.wait_for(exchange.prepare(group), group.timeout)
            except Exception:
                result.doomed = True  # we contribute to no part: none can be served
                raise
            # a contribution that failed dooms the attempt for everyone (that reducer lacks it), and
            # parts fetched after our attempt failed are of no use: the others are cancelled
            active = exchange.active()
            await gather_or_cancel((exchange.contribute(i, reducers[i]) for i in active), _left(group.deadline))
            parts = await gather_or_cancel((exchange.fetch(i, reducers[i]) for i in active), _left(group.deadline))
            result.tensor, result.sent = torch.cat(parts), torch.cat([exchange.sent_parts[i] for i in active])
            if mine in active:
                exchange.received[mine] = exchange.part.message
            result.messages = [exchange.received[i] for i in active]
            if exchange.part is not None and exchange.part.clients:
                await exchange.clients_fetched()
        except Exception as exc:  # a failed attempt is discarded whatever went wrong
            if isinstance(exc, asyncio.TimeoutError):  # those that had not taken our contribution by the
                # deadline (a reducer that has not served its part may be waiting for someone else's)
                exchange.suspects.update(set(reducers) - exchange.contributed - {self.peer_id})
            result.error = (
                f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} after {group.timeout:.0f} s"
            )
            result.retryable, result.lost = True, sorted(exchange.suspects)
            log.warning("round %d group %s failed: %s", attempt.round_no, attempt.key, result.error)
        finally:
            if exchange.part is not None:
                self.server.forget_later(keys[mine], (attempt.round_no, attempt.key), self.keep)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.1)


class _Exchange:
    """One member's state in one flat attempt: its encoded parts out, the parts in, and the peers it
    suspects (those that refused or failed it). ``mine`` is the part we reduce (None: we are a client)."""

    def __init__(
        self,
        owner: FlatRound,
        attempt: Attempt,
        group: FlatGroup,
        keys: list[bytes],
        mine: int | None,
        result: GroupResult,
    ) -> None:
        self.owner, self.attempt, self.group, self.keys, self.mine = owner, attempt, group, keys, mine
        self.members = list(group.members)
        self.result = result
        self.part: Part | None = None
        self.sizes: list[int] = []
        self.messages_out: list[torch.Tensor] = []
        self.sent_parts: list[torch.Tensor | None] = [None] * len(keys)
        self.received: list[torch.Tensor | None] = [None] * len(keys)
        self.suspects: set[str] = set()
        self.contributed: set[str] = set()  # reducers that took our contribution

    async def prepare(self, group: FlatGroup) -> None:
        """Our contribution cut into encoded parts, once we hold the group's base; then our part (if we
        reduce one) is registered (a member's contribution that comes earlier waits for it)."""
        codec, server = self.owner.codec, self.owner.server
        flat = await based_tensor(self.attempt, self.result, group.bases)
        self.sizes = group.sizes(flat.numel())
        chunks = torch.split(flat, self.sizes)
        if self.mine in self.active():
            start = sum(self.sizes[: self.mine])
            self.part = Part(
                self.members,
                group.gid,
                (self.sizes[self.mine],),
                group.deadline,
                name=self.attempt.group,
                start=start,
                clients=frozenset(self.members) - set(group.reducing),
            )
            server.register(self.keys[self.mine], self.part)
        self.messages_out = [codec.encode(c.contiguous()) for c in chunks]

    async def clients_fetched(self) -> None:
        """Wait (to the deadline) until every client has fetched our part. A reducer's part is done when
        the contributions are in, but its clients fetch every part after that, through its link: ending
        our round first would open our next groups (expert groups, the digests' wait) before them, and
        they would find those closed."""
        try:
            await asyncio.wait_for(self.part.clients_served.wait(), _left(self.group.deadline))
        except asyncio.TimeoutError:
            late = sorted(self.part.clients - self.part.fetched)
            log.info(
                "round %d group %s: %d client(s) had not fetched our part by the deadline",
                self.attempt.round_no,
                self.attempt.key,
                len(late),
            )

    def active(self) -> list[int]:
        """The parts exchanged: all of them, but a reducer the load balance gave nothing gets no streams
        (equal parts keep today's exchange, empty ones included, when there are fewer values than members)."""
        return [i for i, n in enumerate(self.sizes) if n > 0 or not self.group.bandwidths]

    def key_for(self, i: int, peer: str) -> bytes:
        """Part ``i``'s key, with its description when ``peer`` is an outsider (it registered nothing)."""
        if peer in self.members:
            return self.keys[i]
        spec = PartSpec(
            contributors=tuple(self.members),
            reducers=tuple(self.group.reducing),
            bandwidths=tuple(self.group.bandwidths),
            gid=self.group.gid,
            index=i,
            size=self.sizes[i],
            start=sum(self.sizes[:i]),
            seconds=_left(self.group.deadline),
            name=self.attempt.group,
        )
        return describe(self.keys[i], spec)

    async def contribute(self, i: int, peer: str) -> None:
        codec, weight = self.owner.codec, self.attempt.weight
        message = self.messages_out[i]
        self.sent_parts[i] = codec.decode(message, self.sizes[i])  # what the reducer will decode
        if peer == self.owner.peer_id:
            self.owner.server.add(self.part, peer, float(weight), self.sent_parts[i], message)
            return
        try:
            if await self.owner.client.send(peer, self.key_for(i, peer), message, weight, self.result):
                self.contributed.add(peer)
        except TruncatedStream:
            raise
        except TransportError as exc:
            self.suspects.add(peer)
            self.result.doomed |= isinstance(exc, Undelivered)  # its part can never be served
            raise

    async def fetch(self, i: int, peer: str) -> torch.Tensor:
        if peer == self.owner.peer_id:
            await self.part.done.wait()
            return self.part.result
        try:
            (self.received[i],) = await self.owner.client.fetch(peer, self.keys[i], self.result)
        except PartMissing:  # it answers: what it lacks is someone else's contribution
            raise
        except Exception:
            self.suspects.add(peer)
            raise
        return self.owner.codec.result.decode(self.received[i], self.sizes[i])
