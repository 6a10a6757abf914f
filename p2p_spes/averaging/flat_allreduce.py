"""The transfers of a flat group, once its membership is decided: reduce-scatter, then all-gather.

The flat tensor is cut into one part per member; member i reduces part i (its side is ``reducer.py``)
from every member's encoded contribution, then encodes its averaged part once and serves those same bytes
to everyone, so every member decodes bit-identical values. Members keep the encoded parts: a peer that
holds the base can rebuild the result from them alone (a frozen expert's refresh). The attempt is
all-or-nothing: a contribution that fails dooms it for everyone (that reducer lacks it), and a member
applies nothing unless it has every part.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass

import torch

from p2p_spes.averaging.attempt import Attempt, GroupResult, based_tensor
from p2p_spes.averaging.compression import Codec
from p2p_spes.averaging.matchmaking import Base
from p2p_spes.averaging.part_client import PartClient, PartMissing, Undelivered
from p2p_spes.averaging.reducer import Part, PartServer
from p2p_spes.averaging.transport import TransportError, TruncatedStream, gather_or_cancel, pack

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlatGroup:
    """A decided flat group: its members in order, the agreed bases and the transfers' deadline."""

    members: tuple[str, ...]
    bases: dict[str, Base]
    timeout: float  # seconds the transfers may take
    deadline: float  # monotonic time by which they must end

    @property
    def gid(self) -> str:
        """The group's id: the same on every member that decided the same membership."""
        return hashlib.sha256(pack(list(self.members))).hexdigest()[:16]


class FlatRound:
    """Runs one member's side of a flat group's transfers (the reducer side is the shared ``server``)."""

    def __init__(self, peer_id: str, codec: Codec, server: PartServer, client: PartClient, keep: float) -> None:
        self.peer_id, self.codec, self.server, self.client = peer_id, codec, server, client
        self.keep = keep  # seconds a finished part stays served (late fetchers, rebuilds)

    async def run(self, attempt: Attempt, group: FlatGroup, result: GroupResult) -> None:
        """The transfers of ``attempt`` among ``group``, into ``result`` (``tensor`` and ``messages`` on
        success; ``error``, ``retryable``, ``lost`` and ``doomed`` on failure)."""
        members = list(group.members)
        gid = group.gid
        self.server.decided[(attempt.round_no, attempt.key)] = gid
        keys = [pack([attempt.round_no, attempt.key, gid, i]) for i in range(len(members))]
        mine = members.index(self.peer_id)
        exchange = _Exchange(self, attempt, members, keys, mine, result)
        try:
            try:
                await asyncio.wait_for(exchange.prepare(group), group.timeout)
            except Exception:
                result.doomed = True  # we contribute to no part: none can be served
                raise
            # a contribution that failed dooms the attempt for everyone (that reducer lacks it), and
            # parts fetched after our attempt failed are of no use: the others are cancelled
            await gather_or_cancel((exchange.contribute(i, p) for i, p in enumerate(members)), _left(group.deadline))
            parts = await gather_or_cancel((exchange.fetch(i, p) for i, p in enumerate(members)), _left(group.deadline))
            result.tensor, result.sent = torch.cat(parts), torch.cat(exchange.sent_parts)
            exchange.received[mine] = exchange.part.message
            result.messages = list(exchange.received)
        except Exception as exc:  # a failed attempt is discarded whatever went wrong
            if isinstance(exc, asyncio.TimeoutError):  # those that had not taken our contribution by the
                # deadline (a reducer that has not served its part may be waiting for someone else's)
                exchange.suspects.update(set(members) - exchange.contributed - {self.peer_id})
            result.error = (
                f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} after {group.timeout:.0f} s"
            )
            result.retryable, result.lost = True, sorted(exchange.suspects)
            log.warning("round %d group %s failed: %s", attempt.round_no, attempt.key, result.error)
        finally:
            self.server.forget_later(keys[mine], (attempt.round_no, attempt.key), self.keep)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.1)


class _Exchange:
    """One member's state in one flat attempt: its encoded parts out, the parts in, and the members it
    suspects (those that refused or failed it)."""

    def __init__(
        self, owner: FlatRound, attempt: Attempt, members: list[str], keys: list[bytes], mine: int, result: GroupResult
    ) -> None:
        self.owner, self.attempt, self.members, self.keys, self.mine = owner, attempt, members, keys, mine
        self.result = result
        self.part: Part | None = None
        self.sizes: list[int] = []
        self.messages_out: list[torch.Tensor] = []
        self.sent_parts: list[torch.Tensor | None] = [None] * len(members)
        self.received: list[torch.Tensor | None] = [None] * len(members)
        self.suspects: set[str] = set()
        self.contributed: set[str] = set()  # members that took our contribution

    async def prepare(self, group: FlatGroup) -> None:
        """Our contribution cut into encoded parts, once we hold the group's base; then our part is
        registered (a member's contribution that comes earlier waits for it)."""
        codec, server = self.owner.codec, self.owner.server
        flat = await based_tensor(self.attempt, self.result, group.bases)
        chunks = torch.tensor_split(flat, len(self.members))
        self.sizes = [len(c) for c in chunks]
        start = sum(self.sizes[: self.mine])
        self.part = Part(
            self.members, group.gid, (self.sizes[self.mine],), group.deadline, name=self.attempt.group, start=start
        )
        server.register(self.keys[self.mine], self.part)
        self.messages_out = [codec.encode(c.contiguous()) for c in chunks]

    async def contribute(self, i: int, peer: str) -> None:
        codec, weight = self.owner.codec, self.attempt.weight
        message = self.messages_out[i]
        self.sent_parts[i] = codec.decode(message, self.sizes[i])  # what the reducer will decode
        if peer == self.owner.peer_id:
            self.owner.server.add(self.part, peer, float(weight), self.sent_parts[i])
            return
        try:
            if await self.owner.client.send(peer, self.keys[i], message, weight, self.result):
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
