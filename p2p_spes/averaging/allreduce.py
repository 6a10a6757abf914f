"""Deadline-bounded group all-reduce over hivemind's DHT and libp2p streams.

Why not hivemind's ``DecentralizedAverager``: each one is a forked process (one per expert group
starves a machine of few cores), its butterfly applies *deltas* so peers end a round a few ulps apart (not
bit-identical), and a peer lost mid-round can leave partially averaged tensors behind. This module
keeps hivemind's DHT, transport and compression and runs the protocol in the trainer's own event
loop:

1. **Join.** Each member writes ``(weight, arrival time, proposed window, proposed deadline, base)``
   under the group's DHT key. The group is everyone who arrived within the first arrival's proposed
   window (at most ``matchmaking_time``) of it; a member stops waiting early once every peer it expects
   has arrived, and every member adopts the membership and transfer deadline (the longest any member
   proposed) the first arrival published (``matchmaking.py``, computed by ``membership.py``).
   The sorted member list hashes to a group id (with who reduces and their bandwidths, when not every
   member reduces an equal part). The *base* is the digest (and round) of the value the
   tensor is relative to (a pseudo-gradient's anchor): the group agrees on the newest one its members
   name, and a member holding another first takes the agreed one from a member (``rebase``).
   A member's record also says whether it can be dialled (``reachable``) and, if it knows, its bandwidth.
2. **Transfers.** A flat group reduce-scatters and all-gathers its members' encoded parts
   (``flat_allreduce.py``); a bounded group larger than ``group_size`` runs in rows and columns
   (``grid_allreduce.py``). Every member that succeeds decodes bit-identical values.

**Reducers and clients** (``roles.py``). Only the members that can be dialled reduce, each a part of the
tensor; a member that cannot (``reachable=False``, behind a NAT) is a *client*: it sends its part to every
reducer and fetches every averaged part, and nobody opens a stream to it. A group with no reachable member
is reduced by a reachable *outsider*, one of the peers ``helpers`` names, which its first arrival picks.

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
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable

import torch
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time

from dht.keys import group_key
from p2p_spes.averaging.aggregation import Aggregator, weighted_mean
from p2p_spes.averaging.attempt import HOLD, Attempt, Contribution, GroupResult, Rebase, based_tensor, relaxed_timeout
from p2p_spes.averaging.compression import Codec
from p2p_spes.averaging.flat_allreduce import FlatRound
from p2p_spes.averaging.grid import Grid, make_grid
from p2p_spes.averaging.grid_allreduce import ColumnResult, GridRound
from p2p_spes.averaging.matchmaking import DECISION_LAG, announce_done, arrivals, join_group
from p2p_spes.averaging.membership import Base, Joined, agreed_base
from p2p_spes.averaging.part_client import PartClient
from p2p_spes.averaging.reducer import PartServer
from p2p_spes.averaging.roles import flat_group, no_outsider, outsider_candidates

__all__ = ["HOLD", "Attempt", "GroupAllReduce", "GroupResult", "relaxed_timeout"]

log = logging.getLogger(__name__)


def stands_aside(
    peer_id: str, group_size: int, attempt: Attempt, joined: Joined, result: GroupResult, ended: float
) -> bool:
    """Whether the decided group runs without us (``result.error`` says why; ``result.retryable`` when we
    may join its retry)."""
    if joined.done:
        # a member applied the attempt before: a new average would set the rest of us apart from it,
        # failing lets the caller take the result it agreed on
        result.error = f"{len(joined.done)} member(s) applied the earlier attempt: not forming it again"
        return True
    if peer_id not in joined.members:
        result.error = "arrived after the group closed"
        grid = make_grid(joined.members, group_size, joined.clients) if attempt.bounded else None
        if len(joined.members) > 1 and grid is None:
            # if its transfers fail, its survivors form it again once they have ended for every member
            # (``ended``); we may join that attempt instead of losing the round with them
            result.retryable = True
            result.deadline_at = ended
        return True
    return False


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
        reachable: bool = True,
        bandwidth: float | None = None,
        helpers: Callable[[], Iterable[str]] | None = None,
    ) -> None:
        """``reachable``: other peers can dial us (False: a client, see the module docstring).
        ``bandwidth`` (any unit the run's peers share, e.g. measured Mbit/s; None: not known) sizes the
        part we reduce; it may be updated between rounds. ``helpers`` gives the reachable peers we know
        (e.g. from the swarm's membership records), read when a group of ours has no reachable member."""
        self.dht, self.p2p, self.peer_id, self.run_id = dht, p2p, peer_id, run_id
        self.reachable, self.bandwidth, self.helpers = reachable, bandwidth, helpers
        self.owner = owner  # our signed subkey (dht/identity.py): nobody can join a group in our name
        self.codec = compression if isinstance(compression, Codec) else Codec(compression)
        self.matchmaking_time, self.timeout = matchmaking_time, timeout
        self.aggregate = aggregate or weighted_mean
        self.retries = retries  # attempts after a failed transfer, per group and round
        server = PartServer(self.codec, self.aggregate, matchmaking_time + timeout)
        self._announcing: set[asyncio.Future] = set()  # "done" records being stored (kept from the collector)
        self.client = PartClient(p2p, run_id)
        self.group_size = group_size  # a bounded group larger than this runs in rows and columns (grid.py)
        self.grid = GridRound(peer_id, self.codec, server, self.client)
        self.flat = FlatRound(peer_id, self.codec, server, self.client, keep=timeout + matchmaking_time)
        self.server = server

    @property
    def server(self) -> PartServer:
        """The parts we reduce for the groups we are in (``reducer.py``), for flat groups and grids alike."""
        return self.flat.server

    @server.setter
    def server(self, server: PartServer) -> None:  # replaceable before start()
        self.flat.server = self.grid.server = server
        server.peer_id = self.peer_id if self.reachable else ""  # only a reachable peer reduces for outsiders

    async def start(self) -> None:
        await self.p2p.add_protobuf_handler(
            self.client.contribute_name, self.server.contribute, averaging_pb2.AveragingData, stream_input=True
        )
        for name, handler in (
            (self.client.fetch_name, self.server.fetch),
            (self.client.column_name, self.server.column),
        ):
            await self.p2p.add_protobuf_handler(name, handler, averaging_pb2.AveragingData, stream_output=True)

    @property
    def records_ttl(self) -> float:
        """How long a group's records (arrivals, decision, "done") stay in the DHT: through its round and
        the next, so a peer one round behind (restarted) finds them and adopts the group's result instead
        of forming a group of its own."""
        return 2 * (self.matchmaking_time + self.timeout) + 30

    def solo(self, tensor: torch.Tensor, result: GroupResult | None = None) -> GroupResult:
        """A group of one: its result is our own tensor as the codec carries it (what a rebuild gets)."""
        result = result or GroupResult(None, [self.peer_id])
        message = self.codec.alone(tensor)  # served as the group's update, as a group's result is
        result.tensor = result.sent = self.codec.lone.decode(message, tensor.numel())
        result.messages = [message]
        return result

    async def run(
        self,
        round_no: int,
        group: str,
        tensor: Contribution,
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
        attempt = Attempt(
            round_no=round_no,
            group=group,
            key=group,
            tensor=tensor,
            weight=weight,
            expected=frozenset(expected),
            on_members=on_members,
            window=window,
            timeout=timeout,
            base=base,
            rebase=rebase,
            bounded=bounded,
            quorum=math.ceil(quorum * len(set(expected) | {self.peer_id})),
        )
        first = result = await self.form(attempt)
        while not result.ok and result.retryable and result.attempts <= self.retries:
            retry, stop = await self._retry(attempt, first, result)
            if stop:
                break
            result = retry
        if result.ok:
            self._succeeded(attempt, first, result)
        result.seconds = time.monotonic() - t0
        return result

    async def _retry(self, attempt: Attempt, first: GroupResult, result: GroupResult) -> tuple[GroupResult, bool]:
        """The next attempt after ``result`` failed in the transfers, among its members still answering;
        ``(result, True)`` when we stop instead (we were late and the group did not form again)."""
        number = result.attempts + 1
        survivors = set(result.members) - set(result.lost)
        late = self.peer_id not in result.members
        log.info(
            "round %d group %s: attempt %d among the %d members still answering%s (%s)",
            attempt.round_no,
            attempt.group,
            number,
            len(survivors),
            ", if they form it" if late else "",
            result.error,
        )
        retry = await self.form(
            dataclasses.replace(
                attempt,
                key=f"{attempt.group}~{number}",
                expected=frozenset(survivors),
                on_members=None,
                window=None,
                timeout=relaxed_timeout(attempt.timeout, self.timeout),
                hold_until=result.deadline_at + HOLD,
                bounded=False,
                quorum=0,
                abort=result.doomed,
                avoid=attempt.avoid | frozenset(set(result.lost) - set(result.members)),  # failed outsiders
            )
        )
        if late and not retry.ok and not (retry.retryable and self.peer_id not in retry.members):
            # it did not form again (its members applied the attempt we missed) or failed too: we
            # report the group we missed, whose result the caller may adopt, as one attempt of ours
            # (late for the retry as well, we may still join the next one)
            result.error = f"{result.error}; then {retry.error}"
            result.retryable = False
            return result, True
        retry.attempts = number
        retry.bytes_sent += result.bytes_sent
        retry.bytes_received += result.bytes_received
        retry.retries += result.retries
        retry.transfer_seconds += result.transfer_seconds  # the link's speed is measured over all of them
        retry.lateness, retry.window = first.lateness, first.window  # the round's arrivals, not the retry's
        if not retry.ok and not retry.members:
            retry.members = result.members  # nobody came: report the group we had
        return retry, False

    def _succeeded(self, attempt: Attempt, first: GroupResult, result: GroupResult) -> None:
        if not result.rows:  # (a grid reports the row members whose parts never came)
            result.lost = sorted(set(first.members) - set(result.members))
        if self.retries and len(result.members) > 1:
            # members whose attempt failed may be forming it again: they must not, we applied this one
            key = group_key(self.run_id, attempt.round_no, f"{attempt.group}~{result.attempts + 1}")
            task = asyncio.ensure_future(announce_done(self.dht, key, self.peer_id, self.owner, self.records_ttl))
            self._announcing.add(task)
            task.add_done_callback(self._announced)

    def _announced(self, task: asyncio.Future) -> None:
        self._announcing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.info("could not announce a finished group: %s", task.exception())

    async def form(self, attempt: Attempt) -> GroupResult:
        """One formation of ``attempt.group`` under ``attempt.key`` and its transfers (see :meth:`run`)."""
        t0 = time.monotonic()
        try:
            joined = await self._join(attempt)
            timeout = joined.deadline(self.timeout)  # the longest a member proposed (matchmaking.py)
            # when the attempt's transfers have ended for every member (each counts its deadline from when
            # it read the decision: up to DECISION_LAG past the window, by the DHT clock); the next attempt
            # forms after it. Counted from our own decision, a late peer (which knows only the DHT clock)
            # and the members that failed at once would form the retry before the members that waited
            # their deadline out arrive
            ended = time.monotonic() + joined.first + joined.window + DECISION_LAG + timeout - get_dht_time()
        except asyncio.TimeoutError:
            result = GroupResult(None, [])
            result.error, result.seconds = "the DHT did not answer during matchmaking", time.monotonic() - t0
            log.warning("round %d group %s failed: %s", attempt.round_no, attempt.group, result.error)
            return result
        finally:
            if attempt.on_members is not None:
                attempt.on_members()
        members = joined.members
        result = GroupResult(None, members, lateness=joined.lateness, window=joined.window)
        t_decided = time.monotonic()
        if stands_aside(self.peer_id, self.group_size, attempt, joined, result, ended):
            return result
        result.base = agreed_base(joined.bases)
        deadline = time.monotonic() + timeout
        result.deadline_at = max(deadline, ended)
        if len(members) == 1 and attempt.is_retry:
            # alone at a retry: the others applied the first attempt's result (or are gone); averaging
            # with nobody would set us apart from them, failing lets the caller take what they agreed on
            result.error = "nobody else came to form the group again"
            return result
        if len(members) == 1:
            self.solo(attempt.tensor() if callable(attempt.tensor) else attempt.tensor, result)
            result.seconds = time.monotonic() - t0
            return result
        if not joined.reducers:
            result.error = no_outsider(outsider_candidates(self.helpers, attempt.avoid, self.peer_id))
            return result
        grid = make_grid(members, self.group_size, joined.clients) if attempt.bounded else None
        if grid is not None:
            await self._grid(attempt, grid, joined.window, timeout, joined.bases, result)
        else:
            await self.flat.run(attempt, flat_group(joined, timeout, deadline), result)
        result.seconds, result.transfer_seconds = time.monotonic() - t0, time.monotonic() - t_decided
        return result

    async def _join(self, attempt: Attempt) -> Joined:
        """Matchmaking for ``attempt``: the decided membership, window, bases and deadline proposals."""
        return await join_group(
            self.dht,
            group_key(self.run_id, attempt.round_no, attempt.key),
            self.peer_id,
            self.owner,
            set(attempt.expected) | {self.peer_id},
            attempt.weight,
            self.matchmaking_time if attempt.window is None else min(attempt.window, self.matchmaking_time),
            attempt.base,
            matchmaking_time=self.matchmaking_time,
            ttl=self.records_ttl,
            hold_until=attempt.hold_until,
            timeout=None
            if attempt.timeout is None
            else min(attempt.timeout, self.timeout * max(len(attempt.expected), 1)),
            quorum=attempt.quorum,
            abort=attempt.abort,
            reachable=self.reachable,
            bandwidth=self.bandwidth,
            helpers=outsider_candidates(self.helpers, attempt.avoid, self.peer_id),
        )

    async def _grid(
        self,
        attempt: Attempt,
        grid: Grid,
        window: float,
        timeout: float,
        bases: dict[str, Base],
        result: GroupResult,
    ) -> None:
        """A large group's transfers in rows and columns (``grid_allreduce.py``), into ``result``. Each
        column is a flat group of its holders; the stages' deadlines leave room for a column's retry."""
        round_no = attempt.round_no
        try:
            flat = await asyncio.wait_for(based_tensor(attempt, result, bases), timeout)
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
            return await arrivals(self.dht, group_key(self.run_id, round_no, uid), self.matchmaking_time)

        out = await self.grid.run(
            round_no, attempt.group, grid, flat, attempt.weight, column_run, row_deadline, deadline, column_members
        )
        result.tensor, result.error, result.rows = out.tensor, out.error, len(grid.rows)
        result.sent = out.sent if out.counted else None  # not counted everywhere: nothing to carry over
        result.bytes_sent, result.bytes_received, result.retries = out.bytes_sent, out.bytes_received, out.retries
        result.lost = out.missing
