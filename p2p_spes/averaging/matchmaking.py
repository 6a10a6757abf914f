"""Who averages together: a group's members, its join window and the base its tensors are relative to.

Each member writes ``(weight, arrival time, proposed window, proposed transfer deadline, base)`` under
the group's DHT key (a signed subkey: nobody joins in another's name). The group is everyone who
arrived within the first arrival's proposed window (at most ``matchmaking_time``) of it; a member
stops waiting early once every peer it expects has arrived, and re-reads once after a grace period so
that records landing just before the cutoff are seen by everyone. Every member computes the same
members, window, transfer deadline and agreed base from the same records, and the first arrival
publishes what it computed for the others to adopt. What the records decide is computed in
``membership.py``; this module reads and writes them.

**A quorum holds the group open past its window** (``membership.closing_time``). The first arrival also
says how many arrivals it waits for (``q``: a share of the live peers it saw, ``swarm.quorum``); a group
that has fewer when its window ends stays open until a moment (``membership.QUORUM_GRACE``) after the
arrival that makes them, at most ``membership.STRETCH`` x ``matchmaking_time`` after the first. Without
it, a round opened by a peer that left the last one early (it ran it alone, or caught up) closes before
the others finish their step: a small early group decides and the rest adopt its result, their own
progress replaced.

**A retry forms at once when its attempt cannot have succeeded** (``ABORT_HOLD``). Normally a retry waits out
the failed attempt's deadline, so that a member that finished it can say so first (:func:`announce_done`).
A member whose contribution certainly never reached a reducer (``part_client.Undelivered``: a killed peer
refuses every dial) knows nobody can have finished; its arrival record says when it learned that (``x``),
and everyone reading it forms the retry ``ABORT_HOLD`` later instead.

**Who reduces.** A member nobody can dial (behind a NAT) says so in its record (``c``); one that measured
or declared its bandwidth says that too (``bw``). The group's reducers are its reachable members
(``membership.Joined.reducers``), which split the tensor in proportion to their bandwidths
(``flat_allreduce.py``); a group with no reachable member has the first arrival pick a reachable outsider
from the peers it knows (``roles.choose_outsider``, by the hash of the group's key: the same pick for every
member that knows the same peers) and publish it in its decision, which every member adopts. All of it
hashes into the group id, so members that decided differently fail loudly.

The transfer deadline is the longest any member proposed (``membership.agreed_timeout``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from hivemind.utils import get_dht_time

from dht.keys import decided_key
from dht.records import signed_values
from p2p_spes.averaging.membership import (
    Base,
    Joined,
    adopted,
    closing_time,
    decide,
    decision,
    first_arrival,
    longest_wait,
)
from p2p_spes.averaging.roles import MAX_NAMED, choose_outsider, named_outsiders

log = logging.getLogger(__name__)
SETTLE = 5.0  # seconds past the join window a member waits for the first arrival's decision
# seconds past the join window (DHT clock) by which members have read the decision, as a rule: each counts
# its transfer deadline from then, so the group's attempt may end this much later for some than for others
DECISION_LAG = SETTLE + 1.0
# seconds past a record saying the attempt failed for everyone (``x``) its retry forms: members start their
# transfers up to DECISION_LAG apart, and each meets the lost reducer as it starts them
ABORT_HOLD = DECISION_LAG + 1.0


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
    ``quorum`` the arrivals it asks the group to wait for should it arrive first
    (``membership.closing_time``).
    ``reachable`` and ``bandwidth`` go into our record (who reduces, and how much); ``helpers`` are the
    reachable peers we know, from which (and from those the other clients' records name) we pick the
    outsider that reduces for a group of clients.
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
    if not reachable and helpers:
        mine["o"] = sorted(helpers)[:MAX_NAMED]  # the first arrival may know none (its DHT lost them a while)
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
        joined.outsiders = choose_outsider(key, [*helpers, *named_outsiders(records)], joined.members)
    if done:
        return joined
    return await settle(dht, key, peer_id, owner, records, joined, ttl)


def aborted(records: dict[str, dict], since: float) -> float | None:
    """The earliest time (DHT clock, after ``since``) a member's record says the attempt before failed
    for everyone, if one does."""
    times = [x for v in records.values() if type(x := v.get("x")) is float and since <= x <= get_dht_time() + 1]
    return min(times, default=None)


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


async def announce_done(dht, key: str, peer_id: str, owner: bytes, ttl: float) -> None:
    """Say under a retry's ``key`` that we applied the attempt before it (see :func:`join_group`)."""
    now = get_dht_time()
    await dht.store(
        key, {"peer_id": peer_id, "done": True}, expiration_time=now + ttl, subkey=owner, return_future=True
    )


async def arrivals(dht, key: str, timeout: float) -> list[str]:
    """The peers whose arrival records are under ``key``, sorted (``done`` records and malformed ones left
    out): a grid's column members, read by its holders. Raises ``asyncio.TimeoutError`` after ``timeout``."""
    found = await asyncio.wait_for(dht.get(key, latest=True, return_future=True), timeout)
    return sorted(p for p, v in signed_values(found).items() if isinstance(v, dict) and isinstance(v.get("t"), float))
