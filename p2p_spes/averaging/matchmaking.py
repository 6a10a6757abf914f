"""Who averages together: a group's members, its join window and the base its tensors are relative to.

Each member writes ``(weight, arrival time, proposed window, proposed transfer deadline, base)`` under
the group's DHT key (a signed subkey: nobody joins in another's name). The group is everyone who
arrived within the first arrival's proposed window (at most ``matchmaking_time``) of it; a member
stops waiting early once every peer it expects has arrived, and re-reads once after a grace period so
that records landing just before the cutoff are seen by everyone. Every member computes the same
members, window, transfer deadline and agreed base from the same records, and the first arrival
publishes what it computed for the others to adopt.

**A quorum holds the group open past its window** (:func:`closing_time`). The first arrival also says how
many arrivals it waits for (``q``: a share of the live peers it saw, ``swarm.quorum``); a group that has
fewer when its window ends stays open until the arrival that makes them, at most ``STRETCH`` x
``matchmaking_time`` after the first. Without it, a round opened by a peer that left the last one early
(it ran it alone, or caught up) closes before the others finish their step: a small early group decides
and the rest adopt its result, their own progress replaced.

**A retry forms at once when its attempt cannot have succeeded** (``ABORT_HOLD``). Normally a retry waits out
the failed attempt's deadline, so that a member that finished it can say so first (:func:`announce_done`).
A member whose contribution certainly never reached a reducer (``part_client.Undelivered``: a killed peer
refuses every dial) knows nobody can have finished; its arrival record says when it learned that (``x``),
and everyone reading it forms the retry ``ABORT_HOLD`` later instead.

**Who reduces.** A member nobody can dial (behind a NAT) says so in its record (``c``); one that measured
or declared its bandwidth says that too (``bw``). The group's reducers are its reachable members
(:attr:`Joined.reducers`), which split the tensor in proportion to their bandwidths
(``flat_allreduce.py``); a group with no reachable member has the first arrival pick a reachable outsider
from the peers it knows (:func:`choose_outsider`, by the hash of the group's key: the same pick for every
member that knows the same peers) and publish it in its decision, which every member adopts. All of it
hashes into the group id, so members that decided differently fail loudly.

The transfer deadline is the longest any member proposed: each member measures its own from the
rates it saw, and a member that gives up at its own short deadline while another still sends within
its longer one would fail an attempt the slower one could finish, then retry it while that one is still
inside it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from hivemind.utils import get_dht_time

from dht.keys import decided_key
from dht.records import signed_values

log = logging.getLogger(__name__)
SETTLE = 5.0  # seconds past the join window a member waits for the first arrival's decision
# seconds past the join window (DHT clock) by which members have read the decision, as a rule: each counts
# its transfer deadline from then, so the group's attempt may end this much later for some than for others
DECISION_LAG = SETTLE + 1.0
# seconds past a record saying the attempt failed for everyone (``x``) its retry forms: members start their
# transfers up to DECISION_LAG apart, and each meets the lost reducer as it starts them
ABORT_HOLD = DECISION_LAG + 1.0
STRETCH = 3.0  # a group short of its quorum stays open up to this many matchmaking_time after its first arrival


@dataclass(frozen=True)
class Base:
    """What a member's tensor is relative to: the digest of its anchor and the round that set it."""

    digest: str
    round: int


def agreed_base(bases: dict[str, Base]) -> Base | None:
    """The base a group uses, the same for every member (all read the same records): by digest, the
    newest round that names it, then the most members naming it, then the larger digest."""
    if not bases:
        return None
    rounds: dict[str, int] = {}
    counts: dict[str, int] = {}
    for b in bases.values():
        rounds[b.digest] = max(rounds.get(b.digest, b.round), b.round)
        counts[b.digest] = counts.get(b.digest, 0) + 1
    digest = max(counts, key=lambda d: (rounds[d], counts[d], d))
    return Base(digest, rounds[digest])


def first_arrival(records: dict[str, dict]) -> str:
    """The member whose record says it arrived first (ties by peer id): it decides the membership."""
    return min(records, key=lambda p: (records[p]["t"], p))


def proposed(value: object) -> float | None:
    """A positive number from a record (window or deadline), or None: a bool or anything else is refused."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def arrival_delays(records: dict[str, dict]) -> dict[str, float]:
    """Every arrival's delay after the first, from a group key's records (malformed ones and ``done``
    records left out): what the next join window is fitted to (``pacing.Deadlines``)."""
    times = {p: v["t"] for p, v in records.items() if isinstance(v, dict) and isinstance(v.get("t"), float)}
    if not times:
        return {}
    first = min(times.values())
    return {p: t - first for p, t in times.items()}


def quorum_of(records: dict[str, dict]) -> int:
    """The arrivals the first arrival's record asks the group to wait for (0: none, also when malformed)."""
    q = records[first_arrival(records)].get("q")
    return q if type(q) is int and q > 0 else 0


def longest_wait(matchmaking_time: float) -> float:
    """The longest a group stays open after its first arrival (its quorum missing)."""
    return STRETCH * matchmaking_time


def closing_time(records: dict[str, dict], matchmaking_time: float) -> float:
    """When the group closes (DHT clock), the same for every member reading the same records: its agreed
    window after the first arrival when its quorum has arrived by then, else the arrival that makes the
    quorum, at most :func:`longest_wait` after the first (that, while the arrival has not come)."""
    times = sorted(v["t"] for v in records.values())
    first, need = times[0], quorum_of(records)
    end = first + agreed_window(records, matchmaking_time)
    if need <= 1 or sum(t <= end for t in times) >= need:
        return end
    cap = first + longest_wait(matchmaking_time)
    return min(times[need - 1], cap) if len(times) >= need else cap


def agreed_timeout(records: dict[str, dict], members: list[str]) -> float:
    """The transfer deadline of a group: the longest the members proposed (0.0 when none did, as peers
    of an earlier version do not; each then keeps its own)."""
    return max((d for p in members if (d := proposed(records.get(p, {}).get("d"))) is not None), default=0.0)


def agreed_window(records: dict[str, dict], matchmaking_time: float) -> float:
    """The join window the first arrival proposed (ties by peer id), at most ``matchmaking_time``."""
    window = proposed(records[first_arrival(records)].get("m"))
    return matchmaking_time if window is None else min(window, matchmaking_time)


@dataclass
class Joined:
    """A decided membership: sorted members, every arrival's delay after the first, the window used, the
    bases the members named and the transfer deadline they agreed on (0.0: none proposed)."""

    members: list[str]
    lateness: dict[str, float] = field(default_factory=dict)
    window: float = 0.0
    bases: dict[str, Base] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)  # peers that said they applied an earlier attempt (a retry's key)
    timeout: float = 0.0
    first: float = 0.0  # the first arrival's time (DHT clock): the group's transfers end by first + window + deadline
    clients: set[str] = field(default_factory=set)  # members nobody can dial: they reduce nothing
    bandwidths: dict[str, float] = field(default_factory=dict)  # what members declared (any unit, all the same)
    outsiders: list[str] = field(default_factory=list)  # reachable non-members that reduce for an all-client group

    @property
    def reducers(self) -> list[str]:
        """Who reduces the group's parts, in order: its reachable members, else the outsiders picked."""
        return [p for p in self.members if p not in self.clients] or list(self.outsiders)

    def deadline(self, configured: float) -> float:
        """The transfer deadline the group runs with: the agreed one, at most ``configured``; the
        configured one when no member proposed any."""
        return min(self.timeout, configured) if self.timeout > 0 else configured


async def join_group(
    dht,
    key: str,
    peer_id: str,
    owner: bytes,
    expected: set[str],
    weight: float,
    window: float,
    base: Base | None,
    *,
    matchmaking_time: float,
    ttl: float,
    hold_until: float | None = None,
    timeout: float | None = None,
    quorum: int = 0,
    abort: bool = False,
    reachable: bool = True,
    bandwidth: float | None = None,
    helpers: Sequence[str] = (),
) -> Joined:
    """Join the group under ``key`` and return its decided membership (see the module docstring).

    A retry's key may also hold ``done`` records (:func:`announce_done`): peers that applied the attempt
    before. Seeing one ends the wait (the retry must not form: its result would differ from theirs).
    ``hold_until`` (monotonic time) keeps the wait going until then even once every expected peer has
    arrived, so that a member still finishing the earlier attempt can say it applied it; a record saying
    that attempt failed for everyone (ours with ``abort``) ends the hold ``ABORT_HOLD`` after it.
    ``timeout`` is the transfer deadline this member proposes (the group's is the longest proposed),
    ``quorum`` the arrivals it asks the group to wait for should it arrive first (:func:`closing_time`).
    ``reachable`` and ``bandwidth`` go into our record (who reduces, and how much); ``helpers`` are the
    reachable peers we know, from which we pick the outsider that reduces for a group of clients.
    Every DHT request is bounded: one that never answers raises ``asyncio.TimeoutError``.
    """
    now = get_dht_time()
    held_to = None if hold_until is None else now + hold_until - time.monotonic()  # (DHT clock)
    if abort and held_to is not None:
        held_to = min(held_to, now + ABORT_HOLD)
    # a retry forms when the hold ends: a member that saw the failure at once (a refused dial) counts as
    # arriving one window before it, so that the window closes when the hold ends: neither before those
    # that waited the deadline out come (as it would counted from when the first noticed) nor a window after
    arrival = now if held_to is None else max(now, held_to - window)
    give_up = time.monotonic() + (longest_wait(matchmaking_time) if quorum > 1 else matchmaking_time) + 10
    mine = {"peer_id": peer_id, "w": float(weight), "t": arrival, "m": float(window)}
    if quorum > 1:
        mine["q"] = int(quorum)
    if abort:
        mine["x"] = now
    if base is not None:
        mine.update(b=base.digest, br=int(base.round))
    if timeout is not None:
        mine["d"] = float(timeout)
    if not reachable:
        mine["c"] = True
    if bandwidth is not None and bandwidth > 0:
        mine["bw"] = float(bandwidth)
    expires = arrival + ttl

    async def publish() -> None:
        await asyncio.wait_for(
            dht.store(key, mine, expiration_time=expires, subkey=owner, return_future=True), matchmaking_time + 10
        )

    await publish()
    if hold_until is not None:
        give_up = max(give_up, hold_until + 1)
    records: dict[str, dict] = {}
    done: set[str] = set()

    async def read() -> tuple[set[str], float, float | None]:
        nonlocal records
        found = await asyncio.wait_for(
            dht.get(key, latest=True, return_future=True), max(give_up - time.monotonic(), 0.0) + 5
        )
        signed = signed_values(found)
        done.update(p for p, v in signed.items() if isinstance(v, dict) and v.get("done") is True)
        records = {p: v for p, v in signed.items() if isinstance(v, dict) and isinstance(v.get("t"), float)}
        records.setdefault(peer_id, mine)
        return set(records), closing_time(records, matchmaking_time), aborted(records, now - ttl)

    while True:
        arrived, closes, failed_at = await read()
        if held_to is not None and failed_at is not None and failed_at + ABORT_HOLD < held_to:
            held_to = failed_at + ABORT_HOLD  # the attempt failed for everyone: no member can say it applied it
            moved = max(get_dht_time(), held_to - window)
            if moved < mine["t"]:  # arrive with the others, not a deadline later (a later expiry replaces)
                mine["t"], expires = moved, expires + 1
                await publish()
        held = held_to is not None and get_dht_time() < held_to
        closed = expected <= arrived or get_dht_time() >= closes
        if done or (closed and not held) or time.monotonic() > give_up:
            break
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.5)
    await read()
    joined = decide(records, matchmaking_time)
    joined.done = set(done)
    if not joined.reducers:
        joined.outsiders = choose_outsider(key, helpers, joined.members)
    if done:
        return joined
    return await settle(dht, key, peer_id, owner, records, joined, ttl)


def aborted(records: dict[str, dict], since: float) -> float | None:
    """The earliest time (DHT clock, after ``since``) a member's record says the attempt before failed
    for everyone, if one does."""
    times = [x for v in records.values() if type(x := v.get("x")) is float and since <= x <= get_dht_time() + 1]
    return min(times, default=None)


def choose_outsider(key: str, helpers: Sequence[str], members: Sequence[str]) -> list[str]:
    """The reachable peer that reduces for a group none of whose ``members`` can be dialled: one of
    ``helpers`` (not a member), picked by the hash of the group's key so that members knowing the same
    peers pick the same one, and a retry (another key) most likely another. Empty when there is none."""
    candidates = sorted(set(helpers) - set(members))
    if not candidates:
        return []
    return [candidates[int(hashlib.sha256(key.encode()).hexdigest(), 16) % len(candidates)]]


async def settle(
    dht, key: str, peer_id: str, owner: bytes, records: dict[str, dict], own: Joined, ttl: float
) -> Joined:
    """The membership the first arrival decided, which every member adopts (module docstring); ``own``
    (what we read ourselves) if we are the first arrival, or if no decision comes in time."""
    where = decided_key(key)
    leader = first_arrival(records)
    rank = (records[leader]["t"], leader)
    if leader == peer_id:
        try:
            await asyncio.wait_for(
                dht.store(
                    where,
                    decision(own, peer_id, records[peer_id]["t"]),
                    expiration_time=get_dht_time() + ttl,
                    subkey=owner,
                    return_future=True,
                ),
                SETTLE,
            )
        except asyncio.TimeoutError:
            log.warning("could not publish the membership of %s: the DHT did not answer", key)
    until = time.monotonic() + own.window + SETTLE
    while True:
        try:
            found = await asyncio.wait_for(
                dht.get(where, latest=True, return_future=True), max(until - time.monotonic(), 0.0) + 1
            )
        except asyncio.TimeoutError:
            found = None
        published = {
            p: v for p, v in signed_values(found).items() if isinstance(v.get("t"), float) and (v["t"], p) <= rank
        }
        for p in sorted(published, key=lambda p: (published[p]["t"], p)):
            joined = adopted(published[p], own)
            if joined is not None:
                if joined.members != own.members:
                    log.info(
                        "%s: adopted the membership %s decided (%d members; we read %d)",
                        key,
                        p,
                        len(joined.members),
                        len(own.members),
                    )
                return joined
        if time.monotonic() >= until:
            log.warning("%s: no decision from its first arrival %s, going by our own reading", key, leader)
            return own
        await asyncio.sleep(0.2)


def decision(joined: Joined, peer_id: str, arrival: float) -> dict:
    """The record the first arrival publishes: the members, the window and the agreed base with the
    indices of the members that hold it (what a member needs to rebase)."""
    value = {"peer_id": peer_id, "t": arrival, "members": list(joined.members), "w": joined.window}
    if joined.timeout > 0:
        value["d"] = joined.timeout
    if joined.clients:
        value["c"] = [i for i, p in enumerate(joined.members) if p in joined.clients]
    if joined.bandwidths:
        value["bw"] = [joined.bandwidths.get(p, 0.0) for p in joined.members]
    if joined.outsiders:
        value["r"] = list(joined.outsiders)
    base = agreed_base(joined.bases)
    if base is not None:
        value.update(
            b=base.digest,
            br=base.round,
            h=[i for i, p in enumerate(joined.members) if p in joined.bases and joined.bases[p].digest == base.digest],
        )
    return value


def adopted(value: dict, own: Joined) -> Joined | None:
    """The membership a decision record holds, with our own arrivals' lateness; None if malformed."""
    members, window, holders = value.get("members"), proposed(value.get("w")), value.get("h", [])
    timeout = proposed(value["d"]) if "d" in value else 0.0
    clients, bandwidths, outsiders = value.get("c", []), value.get("bw", []), value.get("r", [])
    if (
        not isinstance(members, list)
        or not members
        or not all(isinstance(p, str) for p in members)
        or members != sorted(set(members))
        or window is None
        or timeout is None
        or not isinstance(holders, list)
        or not all(type(i) is int and 0 <= i < len(members) for i in holders)
        or not isinstance(clients, list)
        or not all(type(i) is int and 0 <= i < len(members) for i in clients)
        or not isinstance(bandwidths, list)
        or len(bandwidths) not in (0, len(members))
        or not all(isinstance(b, float) and b >= 0 for b in bandwidths)
        or not isinstance(outsiders, list)
        or not all(isinstance(p, str) and p not in members for p in outsiders)
    ):
        return None
    bases = {}
    if isinstance(value.get("b"), str) and type(value.get("br")) is int:
        bases = {members[i]: Base(value["b"], value["br"]) for i in holders}
    return Joined(
        list(members),
        dict(own.lateness),
        window,
        bases,
        timeout=timeout,
        first=own.first,
        clients={members[i] for i in clients},
        bandwidths={p: b for p, b in zip(members, bandwidths) if b > 0},
        outsiders=list(outsiders),
    )


async def announce_done(dht, key: str, peer_id: str, owner: bytes, ttl: float) -> None:
    """Say under a retry's ``key`` that we applied the attempt before it (see :func:`join_group`)."""
    now = get_dht_time()
    await dht.store(
        key, {"peer_id": peer_id, "done": True}, expiration_time=now + ttl, subkey=owner, return_future=True
    )


def decide(records: dict[str, dict], matchmaking_time: float) -> Joined:
    """The membership every member computes from the same arrival records (``{peer: {"t": arrival,
    "m": proposed window, "q": quorum, "d": proposed deadline, "b"/"br": base, "c": not reachable,
    "bw": bandwidth}}``): everyone who arrived
    before the group closed (:func:`closing_time`; with its quorum still missing, everyone who came up to
    now), with the longest deadline they proposed.
    Also what ``benchmarks/lab/simulation.py`` runs, so the model forms groups as peers do."""
    times = {p: v["t"] for p, v in records.items()}
    first = min(times.values())
    closes = closing_time(records, matchmaking_time)
    agreed = closes - first
    members = sorted(p for p, t in times.items() if t <= closes)
    bases = {
        p: Base(records[p]["b"], records[p]["br"])
        for p in members
        if isinstance(records[p].get("b"), str) and type(records[p].get("br")) is int
    }
    return Joined(
        members,
        arrival_delays(records),
        agreed,
        bases,
        timeout=agreed_timeout(records, members),
        first=first,
        clients={p for p in members if records[p].get("c") is True},
        bandwidths={p: b for p in members if (b := proposed(records[p].get("bw"))) is not None},
    )
