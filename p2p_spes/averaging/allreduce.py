"""Deadline-bounded group all-reduce over hivemind's DHT and libp2p streams.

Why not hivemind's ``DecentralizedAverager``: each one is a forked process (one per expert group
starved 2 cores here), its butterfly applies *deltas* so peers end a round a few ulps apart (not
bit-identical), and a peer lost mid-round can leave partially averaged tensors behind. This module
keeps hivemind's DHT, transport and compression and runs the protocol in the trainer's own event
loop:

1. **Join.** Each member writes ``(weight, arrival time, proposed window, proposed deadline, base)``
   under the group's DHT key. The group is everyone who arrived within the first arrival's proposed
   window (at most ``matchmaking_time``) of it; a member stops waiting early once every peer it expects
   has arrived, and every member adopts the membership and transfer deadline (the longest any member
   proposed) the first arrival published (``matchmaking.py``).
   The sorted member list hashes to a group id. The *base* is the digest (and round) of the value the
   tensor is relative to (a pseudo-gradient's anchor): the group agrees on the newest one its members
   name, and a member holding another first takes the agreed one from a member (``rebase``).
2. **Reduce-scatter.** The flat tensor is cut into one part per member; member i receives part i
   from everyone (its side is ``reducer.py``), encoded with the run's codec (``compression.py``), and computes the weighted mean in
   member order.
3. **All-gather.** The reducer encodes its averaged part once (adding what its last encoding of that
   range dropped: error feedback on the reducer's side too) and serves those same bytes to everyone,
   so every member decodes bit-identical values. Members keep the encoded parts: a peer that holds
   the base can rebuild the result from them alone (a frozen expert's refresh).

Any missing contribution or part before the deadline fails the attempt *for the whole group*: a
reducer either serves one result to everybody or none, and a member applies nothing unless it has
every part. A member lost mid-round then costs the others a retry, not the round: every member whose
attempt failed in the transfers joins the group again under the attempt's own key (``group~2``, ...,
up to ``retries`` more times), with the same tensor, and those that come (a dead member does not, a slow
one is welcome) average among themselves. The retry forms no earlier than the failed attempt's deadline
for every member (first arrival + window + ``DECISION_LAG`` + deadline, by the DHT clock, + ``HOLD``), so
that a member that succeeded has said so under the retry's key (``announce_done``): a member that sees
that does not form the group again (its result would differ) and takes the agreed result instead (the
round's adopt path). It forms at once (``matchmaking.ABORT_HOLD``) when a member's contribution certainly
never reached a reducer (``part_client.Undelivered``: the reducer is gone): nobody can have finished. A
peer that arrived after the group closed joins the retry too (it computes the deadline from the
decision), so the late majority is not lost with a small early group. Each attempt is all-or-nothing,
so no partial average is ever applied; the members of the one that succeeds end bit-identical and report
the lost members (``GroupResult.lost``). A member alone at a retry fails (the others may have applied
the first attempt). Views of the membership that differ give different group ids and fail loudly. A
stream cut short (hivemind ends one silently when its connection closes) is sent or fetched again, up to
``part_client.ATTEMPTS`` times within the deadline, and a reducer that already holds a contribution
whose reply was lost says so (``TAKEN``) instead of refusing it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

from dht.keys import group_key
from dht.records import signed_values
from p2p_spes.averaging.aggregation import Aggregator, weighted_mean
from p2p_spes.averaging.compression import Codec
from p2p_spes.averaging.grid import Grid, make_grid
from p2p_spes.averaging.grid_allreduce import ColumnResult, GridRound
from p2p_spes.averaging.matchmaking import DECISION_LAG, Base, agreed_base, announce_done, join_group
from p2p_spes.averaging.part_client import PartClient, PartMissing, Undelivered
from p2p_spes.averaging.reducer import Part, PartServer
from p2p_spes.averaging.transport import TransportError, TruncatedStream, gather_or_cancel, pack

log = logging.getLogger(__name__)
HOLD = 1.0  # seconds past a failed attempt's deadline before the next forms: members that finished say so by then


def relaxed_timeout(proposal: float | None, configured: float) -> float | None:
    """What a member proposes for a retry: twice the deadline it measured, at most ``configured`` (a
    round that lost a member is a disturbed one, and the members' rates were not measured under it)."""
    return None if proposal is None else min(2 * proposal, configured)


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
    attempts: int = 1  # times the group formed this round (a failed transfer is retried among those who come)
    lost: list[str] = field(default_factory=list)  # members of the first attempt missing from the one that succeeded
    retryable: bool = False  # failed in the transfers (not in matchmaking): the survivors may form again
    deadline_at: float = 0.0  # monotonic time by which the transfers had to end: any member done by then says so
    rows: int = 0  # rows of a bounded group run as a grid (0: one flat group)
    doomed: bool = False  # failed for every member (a reducer lacks our contribution): retry without waiting

    @property
    def ok(self) -> bool:
        return self.tensor is not None


class GroupAllReduce:
    """Serves and runs all-reduce rounds for one peer. Create and use it inside one event loop."""

    def __init__(
        self,
        dht,
        p2p,
        peer_id: str,
        run_id: str,
        *,
        owner: bytes,
        compression: str | Codec = "none",
        matchmaking_time: float = 3.0,
        timeout: float = 30.0,
        aggregate: Aggregator | None = None,
        retries: int = 1,
        group_size: int = 0,
    ) -> None:
        self.dht, self.p2p, self.peer_id, self.run_id = dht, p2p, peer_id, run_id
        self.owner = owner  # our signed subkey (dht/identity.py): nobody can join a group in our name
        self.codec = compression if isinstance(compression, Codec) else Codec(compression)
        self.matchmaking_time, self.timeout = matchmaking_time, timeout
        self.aggregate = aggregate or weighted_mean
        self.retries = retries  # attempts after a failed transfer, per group and round
        # the parts we reduce for the groups we are in (reducer.py); replaceable before start()
        self.server = PartServer(self.codec, self.aggregate, matchmaking_time + timeout)
        self._announcing: set[asyncio.Future] = set()  # "done" records being stored (kept from the collector)
        self.client = PartClient(p2p, run_id)
        self.group_size = group_size  # a bounded group larger than this runs in rows and columns (grid.py)
        self.grid = GridRound(peer_id, self.codec, self.server, self.client)

    async def start(self) -> None:
        await self.p2p.add_protobuf_handler(
            self.client.contribute_name, self.server.contribute, averaging_pb2.AveragingData, stream_input=True
        )
        for name, handler in (
            (self.client.fetch_name, self.server.fetch),
            (self.client.column_name, self.server.column),
        ):
            await self.p2p.add_protobuf_handler(name, handler, averaging_pb2.AveragingData, stream_output=True)

    # Client side ---------------------------------------------------------------------------
    @staticmethod
    async def _based(
        tensor: torch.Tensor | Callable[[], torch.Tensor],
        base: Base | None,
        result: GroupResult,
        bases: dict[str, Base],
        rebase: Rebase | None,
    ) -> torch.Tensor:
        """Our tensor, once we hold the base the group agreed on (taken from a member that holds it)."""
        if base is not None and result.base is not None and result.base.digest != base.digest:
            holders = [p for p in result.members if p in bases and bases[p].digest == result.base.digest]
            if rebase is None:
                raise TransportError(f"the group agreed on base {result.base.digest[:12]}, we hold another")
            await rebase(result.base, holders)
        return tensor() if callable(tensor) else tensor

    async def _grid(
        self,
        round_no: int,
        group: str,
        grid: Grid,
        tensor: torch.Tensor | Callable[[], torch.Tensor],
        weight: float,
        window: float,
        timeout: float,
        base: Base | None,
        bases: dict[str, Base],
        rebase: Rebase | None,
        result: GroupResult,
    ) -> None:
        """A large group's transfers in rows and columns (``grid_allreduce.py``), into ``result``. Each
        column is a flat group of its holders; the stages' deadlines leave room for a column's retry."""
        try:
            flat = await asyncio.wait_for(self._based(tensor, base, result, bases, rebase), timeout)
        except Exception as exc:
            result.error = f"could not take the agreed base: {exc!r}"
            return
        row_deadline = time.monotonic() + timeout
        deadline = row_deadline + window + (2 + self.retries) * timeout + self.retries * HOLD
        result.deadline_at = deadline

        async def column_run(uid: str, values: torch.Tensor, w: float, expected: set[str]) -> ColumnResult:
            res = await self.run(round_no, uid, values, w, expected, window=window, timeout=timeout)
            return ColumnResult(res.messages if res.ok else None, res.sent, res.bytes_sent, res.bytes_received)

        async def column_members(uid: str) -> list[str]:
            found = await asyncio.wait_for(
                self.dht.get(group_key(self.run_id, round_no, uid), latest=True, return_future=True),
                self.matchmaking_time,
            )
            return sorted(
                p for p, v in signed_values(found).items() if isinstance(v, dict) and isinstance(v.get("t"), float)
            )

        out = await self.grid.run(
            round_no, group, grid, flat, weight, column_run, row_deadline, deadline, column_members
        )
        result.tensor, result.error, result.rows = out.tensor, out.error, len(grid.rows)
        result.sent = out.sent if out.counted else None  # not counted everywhere: nothing to carry over
        result.bytes_sent, result.bytes_received, result.retries = out.bytes_sent, out.bytes_received, out.retries
        result.lost = out.missing

    @property
    def records_ttl(self) -> float:
        """How long a group's records (arrivals, decision, "done") stay in the DHT: through its round and
        the next, so a peer one round behind (restarted) finds them and adopts the group's result (gone
        with the round, they sent such a peer, 80 s late at 24 peers, to a group of its own)."""
        return 2 * (self.matchmaking_time + self.timeout) + 30

    def solo(self, tensor: torch.Tensor, result: GroupResult | None = None) -> GroupResult:
        """A group of one: its result is our own tensor as the codec carries it (what a rebuild gets)."""
        result = result or GroupResult(None, [self.peer_id])
        message = self.codec.result.encode(tensor)  # served as the group's update, as a group's result is
        result.tensor = result.sent = self.codec.result.decode(message, tensor.numel())
        result.messages = [message]
        return result

    async def run(
        self,
        round_no: int,
        group: str,
        tensor: torch.Tensor | Callable[[], torch.Tensor],
        weight: float,
        expected: set[str],
        on_members: Callable[[], None] | None = None,
        window: float | None = None,
        timeout: float | None = None,
        base: Base | None = None,
        rebase: Rebase | None = None,
        bounded: bool = False,
        quorum: float = 0.0,
    ) -> GroupResult:
        """All-reduce ``tensor`` (flat fp32, CPU) with the peers that join ``group`` of ``round_no``.

        ``on_members`` is called once the membership is decided (or matchmaking failed). ``window`` is the
        join window this peer proposes and ``timeout`` the transfer deadline (both measured by the caller,
        None if not yet; at most the configured ones); the group keeps the longest deadline its members
        proposed, the configured one if none did. With ``base``, when the group agrees on another base,
        ``rebase(digest, members holding it)`` is awaited first (it must take that base or raise);
        ``tensor`` may then be a function, called after it. A ``bounded`` group with more members than
        ``group_size`` runs in rows and columns (``grid_allreduce.py``) and is not formed again: a member
        lost there costs its row's contribution, not the round. ``quorum`` (a share of ``expected``)
        holds the first attempt open past its window until that many have come
        (``matchmaking.closing_time``); a retry's members arrive together and need none.
        """
        t0 = time.monotonic()
        result = await self._attempt(
            round_no,
            group,
            group,
            tensor,
            weight,
            expected,
            on_members,
            window,
            timeout,
            base,
            rebase,
            bounded=bounded,
            quorum=math.ceil(quorum * len(set(expected) | {self.peer_id})),
        )
        first = result
        while not result.ok and result.retryable and result.attempts <= self.retries:
            attempt = result.attempts + 1
            survivors = set(result.members) - set(result.lost)
            late = self.peer_id not in result.members
            log.info(
                "round %d group %s: attempt %d among the %d members still answering%s (%s)",
                round_no,
                group,
                attempt,
                len(survivors),
                ", if they form it" if late else "",
                result.error,
            )
            retry = await self._attempt(
                round_no,
                group,
                f"{group}~{attempt}",
                tensor,
                weight,
                survivors,
                None,
                None,
                relaxed_timeout(timeout, self.timeout),
                base,
                rebase,
                hold_until=result.deadline_at + HOLD,
                abort=result.doomed,
            )
            if late and not retry.ok and not (retry.retryable and self.peer_id not in retry.members):
                # it did not form again (its members applied the attempt we missed) or failed too: we
                # report the group we missed, whose result the caller may adopt, as one attempt of ours
                # (late for the retry as well, we may still join the next one)
                result.error = f"{result.error}; then {retry.error}"
                result.retryable = False
                break
            retry.attempts = attempt
            retry.bytes_sent += result.bytes_sent
            retry.bytes_received += result.bytes_received
            retry.retries += result.retries
            retry.transfer_seconds += result.transfer_seconds  # the link's speed is measured over all of them
            retry.lateness, retry.window = first.lateness, first.window  # the round's arrivals, not the retry's
            if not retry.ok and not retry.members:
                retry.members = result.members  # nobody came: report the group we had
            result = retry
        if result.ok:
            if not result.rows:  # (a grid reports the row members whose parts never came)
                result.lost = sorted(set(first.members) - set(result.members))
            if self.retries and len(result.members) > 1:
                # members whose attempt failed may be forming it again: they must not, we applied this one
                key = group_key(self.run_id, round_no, f"{group}~{result.attempts + 1}")
                task = asyncio.ensure_future(announce_done(self.dht, key, self.peer_id, self.owner, self.records_ttl))
                self._announcing.add(task)
                task.add_done_callback(self._announced)
        result.seconds = time.monotonic() - t0
        return result

    def _announced(self, task: asyncio.Future) -> None:
        self._announcing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.info("could not announce a finished group: %s", task.exception())

    async def _attempt(
        self,
        round_no: int,
        group: str,
        key: str,
        tensor: torch.Tensor | Callable[[], torch.Tensor],
        weight: float,
        expected: set[str],
        on_members: Callable[[], None] | None,
        window: float | None,
        timeout: float | None,
        base: Base | None,
        rebase: Rebase | None,
        hold_until: float | None = None,
        bounded: bool = False,
        quorum: int = 0,
        abort: bool = False,
    ) -> GroupResult:
        """One formation of ``group`` under DHT key ``key`` and its transfers (see :meth:`run`)."""
        t0 = time.monotonic()
        window = self.matchmaking_time if window is None else min(window, self.matchmaking_time)
        proposal = None if timeout is None else min(timeout, self.timeout)
        try:
            joined = await join_group(
                self.dht,
                group_key(self.run_id, round_no, key),
                self.peer_id,
                self.owner,
                set(expected) | {self.peer_id},
                weight,
                window,
                base,
                matchmaking_time=self.matchmaking_time,
                ttl=self.records_ttl,
                hold_until=hold_until,
                timeout=proposal,
                quorum=quorum,
                abort=abort,
            )
            members, lateness, agreed, bases = joined.members, joined.lateness, joined.window, joined.bases
            timeout = joined.deadline(self.timeout)  # the longest a member proposed (matchmaking.py)
            # when the attempt's transfers have ended for every member (each counts its deadline from when it
            # read the decision: up to DECISION_LAG past the window, by the DHT clock); the next attempt forms
            # after it. Counted from our own decision instead, the late peers (who know only the DHT clock)
            # and the members that failed at once formed the retry before the members that waited their
            # deadline out came (12 of 17 peers of a 24-peer churn run's round arrived 3.5 s too late)
            ended = time.monotonic() + joined.first + joined.window + DECISION_LAG + timeout - get_dht_time()
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
        if joined.done:
            # a member applied the attempt before: a new average would set the rest of us apart from it,
            # failing lets the caller take the result it agreed on
            result.error = f"{len(joined.done)} member(s) applied the earlier attempt: not forming it again"
            return result
        if self.peer_id not in members:
            result.error = "arrived after the group closed"
            if len(members) > 1 and not (bounded and make_grid(members, self.group_size) is not None):
                # if its transfers fail, its survivors form it again once they have ended for every member
                # (``ended``); we may join that attempt instead of losing the round with them
                result.retryable = True
                result.deadline_at = ended
            return result
        result.base = agreed_base(bases)
        deadline = time.monotonic() + timeout
        result.deadline_at = max(deadline, ended)
        if len(members) == 1 and key != group:
            # alone at a retry: the others applied the first attempt's result (or are gone); averaging
            # with nobody would set us apart from them, failing lets the caller take what they agreed on
            result.error = "nobody else came to form the group again"
            return result
        if len(members) == 1:
            self.solo(tensor() if callable(tensor) else tensor, result)
            result.seconds = time.monotonic() - t0
            return result
        grid = make_grid(members, self.group_size) if bounded else None
        if grid is not None:
            await self._grid(round_no, group, grid, tensor, weight, agreed, timeout, base, bases, rebase, result)
            result.seconds, result.transfer_seconds = time.monotonic() - t0, time.monotonic() - t_decided
            return result
        gid = hashlib.sha256(pack(members)).hexdigest()[:16]
        self.server.decided[(round_no, key)] = gid
        keys = [pack([round_no, key, gid, i]) for i in range(len(members))]
        mine = members.index(self.peer_id)
        part: Part | None = None
        sizes: list[int] = []
        sent_parts: list[torch.Tensor | None] = [None] * len(members)
        received: list[torch.Tensor | None] = [None] * len(members)

        async def prepare() -> list[torch.Tensor]:
            """Our contribution cut into encoded parts, once we hold the group's base; then our part is
            registered (a member's contribution that comes earlier waits for it)."""
            nonlocal part
            flat = await self._based(tensor, base, result, bases, rebase)
            chunks = torch.tensor_split(flat, len(members))
            sizes[:] = [len(c) for c in chunks]
            part = Part(members, gid, (sizes[mine],), deadline, name=group, start=sum(sizes[:mine]))
            self.server.register(keys[mine], part)
            return [self.codec.encode(c.contiguous()) for c in chunks]

        messages_out: list[torch.Tensor] = []
        suspects: set[str] = set()  # members that refused or failed us in this attempt
        contributed: set[str] = set()  # members that took our contribution

        async def contribute(i: int, peer: str) -> None:
            message = messages_out[i]
            sent_parts[i] = self.codec.decode(message, sizes[i])  # what the reducer will decode
            if peer == self.peer_id:
                self.server.add(part, peer, float(weight), sent_parts[i])
                return
            try:
                if await self.client.send(peer, keys[i], message, weight, result):
                    contributed.add(peer)
            except TruncatedStream:
                raise
            except TransportError as exc:
                suspects.add(peer)
                result.doomed |= isinstance(exc, Undelivered)  # its part can never be served
                raise

        async def fetch(i: int, peer: str) -> torch.Tensor:
            if peer == self.peer_id:
                await part.done.wait()
                return part.result
            try:
                (received[i],) = await self.client.fetch(peer, keys[i], result)
            except PartMissing:  # it answers: what it lacks is someone else's contribution
                raise
            except Exception:
                suspects.add(peer)
                raise
            return self.codec.result.decode(received[i], sizes[i])

        try:
            try:
                messages_out[:] = await asyncio.wait_for(prepare(), timeout)
            except Exception:
                result.doomed = True  # we contribute to no part: none can be served
                raise
            # a contribution that failed dooms the attempt for everyone (that reducer lacks it), and
            # parts fetched after our attempt failed are of no use: the others are cancelled
            await gather_or_cancel(
                (contribute(i, p) for i, p in enumerate(members)), max(deadline - time.monotonic(), 0.1)
            )
            parts = await gather_or_cancel(
                (fetch(i, p) for i, p in enumerate(members)), max(deadline - time.monotonic(), 0.1)
            )
            result.tensor, result.sent = torch.cat(parts), torch.cat(sent_parts)
            received[mine] = part.message
            result.messages = list(received)
        except Exception as exc:  # a failed attempt is discarded whatever went wrong
            if isinstance(exc, asyncio.TimeoutError):  # those that had not taken our contribution by the
                # deadline (a reducer that has not served its part may be waiting for someone else's)
                suspects.update(set(members) - contributed - {self.peer_id})
            result.error = f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} after {timeout:.0f} s"
            result.retryable, result.lost = True, sorted(suspects)
            log.warning("round %d group %s failed: %s", round_no, key, result.error)
        finally:
            self.server.forget_later(keys[mine], (round_no, key), self.timeout + self.matchmaking_time)
        result.seconds, result.transfer_seconds = time.monotonic() - t0, time.monotonic() - t_decided
        return result
