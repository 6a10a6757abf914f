"""Group formation on real hivemind DHTs: members whose readings of the arrivals differ still end with
one membership, the first arrival's."""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers import Peers
from hivemind.utils import ValueWithExpiration, get_dht_time

from dht.identity import peer_id_of_owner
from dht.keys import group_key
from p2p_spes.averaging import matchmaking
from p2p_spes.averaging.matchmaking import ABORT_HOLD, aborted, join_group
from p2p_spes.averaging.membership import (
    QUORUM_GRACE,
    Base,
    Joined,
    adopted,
    arrival_delays,
    closing_time,
    decide,
    decision,
    longest_wait,
)

WINDOW = 2.0


@pytest.fixture(scope="module")
def dhts():
    peers = Peers()
    yield peers
    peers.close()


class Blind:
    """A DHT whose reads of the arrival records never show one peer's record (it landed too late for
    us): the view a member on a loaded machine can have at the cutoff."""

    def __init__(self, dht, hidden: str) -> None:
        self.dht, self.hidden = dht, hidden

    def store(self, *args, **kwargs):
        return self.dht.store(*args, **kwargs)

    async def get(self, key, **kwargs):
        found = await self.dht.get(key, **kwargs)
        if found is None or key.endswith(".decided") or not isinstance(found.value, dict):
            return found
        kept = {k: v for k, v in found.value.items() if peer_id_of_owner(k) != self.hidden}
        return ValueWithExpiration(kept, found.expiration_time)


def form(
    peers: Peers,
    run_id: str,
    delays: list[float],
    blind: dict[int, int] | None = None,
    present: list[int] | None = None,
    timeouts: list[float] | None = None,
    hold: float | None = None,
    quorum: int = 0,
    expected: set[str] | None = None,
    aborts: frozenset[int] = frozenset(),
) -> list[Joined]:
    """Every member in ``present`` joins the same group, member i ``delays[i]`` seconds after the first
    (proposing the transfer deadline ``timeouts[i]``); member i reads the arrivals without member
    ``blind[i]``'s record. With ``hold``, it is a retry that forms ``hold`` seconds after the first
    member starts joining (the failed attempt's deadline). Each asks for ``quorum`` arrivals and expects
    ``expected`` (every node when None); the members in ``aborts`` saw the failed attempt fail for everyone."""
    ids = [node.peer_id.to_base58() for node in peers.nodes]
    present = list(range(len(ids))) if present is None else present
    key = group_key(run_id, 0, "shared")

    start = time.monotonic()

    async def member(i: int) -> Joined:
        await asyncio.sleep(delays[i])
        dht = Blind(peers.nodes[i], ids[blind[i]]) if blind and i in blind else peers.nodes[i]
        return await join_group(
            dht,
            key,
            ids[i],
            peers.owners[i],
            set(ids) if expected is None else expected,
            1.0,
            WINDOW,
            None,
            matchmaking_time=WINDOW,
            ttl=30.0,
            timeout=timeouts[i] if timeouts else None,
            hold_until=None if hold is None else start + hold,
            quorum=quorum,
            abort=i in aborts,
        )

    async def everyone() -> list[Joined]:
        return list(await asyncio.gather(*(member(i) for i in present)))

    return peers.call(everyone())


@pytest.mark.slow
def test_a_member_that_missed_a_record_adopts_the_first_arrivals_membership(dhts):
    """Member 1 never sees member 2's arrival. Going by its own reading it would form a group of two
    while the others form one of three (a split round); it adopts member 0's decision instead."""
    ids = [node.peer_id.to_base58() for node in dhts.nodes]
    joined = form(dhts, "mm-missed", [0.0, 0.3, 0.6], blind={1: 2})
    assert [j.members for j in joined] == [sorted(ids)] * 3


@pytest.mark.slow
def test_every_member_keeps_the_deadline_the_first_arrival_decided(dhts):
    """Members propose 5, 23 and 9 s; member 1 never sees member 2's record. All keep the longest
    proposed among the decided members, 23 s, whatever they read themselves."""
    joined = form(dhts, "mm-deadline", [0.0, 0.3, 0.6], blind={1: 2}, timeouts=[5.0, 23.0, 9.0])
    assert [j.timeout for j in joined] == [23.0] * 3


@pytest.mark.slow
def test_a_retry_counts_arrivals_from_when_it_can_form_not_from_the_first_to_notice(dhts):
    """Member 0 saw the attempt fail at once (a refused dial); members 1 and 2 waited out its deadline,
    3.5 s later, longer than the join window. The retry forms at the deadline, so all three are in it."""
    ids = [node.peer_id.to_base58() for node in dhts.nodes]
    joined = form(dhts, "mm-retry", [0.0, 3.5, 3.5], hold=4.0)
    assert [j.members for j in joined] == [sorted(ids)] * 3


@pytest.mark.slow
def test_a_retry_forms_at_once_after_a_member_saw_its_attempt_fail_for_everyone(dhts):
    """The failed attempt's deadline is 25 s away. Members 1 and 2 join its retry first, holding for it;
    member 0 then says the attempt failed for everyone (a reducer never got its contribution). All three
    form the retry ABORT_HOLD after that, moving their arrivals forward, not 25 s later."""
    ids = [node.peer_id.to_base58() for node in dhts.nodes]
    start = time.monotonic()
    joined = form(dhts, "mm-abort", [1.0, 0.0, 0.5], hold=25.0, aborts=frozenset({0}))
    seconds = time.monotonic() - start
    assert [j.members for j in joined] == [sorted(ids)] * 3
    # member 0's record at ~1 s, then ABORT_HOLD, the 0.5 s re-read and the decision's DHT round trips
    assert seconds < 1.0 + ABORT_HOLD + 4.0, seconds


def test_only_a_well_formed_recent_abort_time_counts():
    now = get_dht_time()
    records = {
        "a": {"t": now},
        "b": {"t": now, "x": now - 5.0},
        "c": {"t": now, "x": now - 2.0},
        "d": {"t": now, "x": True},
        "e": {"t": now, "x": "soon"},
        "f": {"t": now, "x": now - 100.0},
        "g": {"t": now, "x": now + 60.0},
    }
    assert aborted(records, since=now - 30.0) == now - 5.0  # the earliest, from b
    assert aborted({p: records[p] for p in "adefg"}, since=now - 30.0) is None


@pytest.mark.slow
def test_a_member_the_first_arrival_did_not_see_is_late_whatever_it_read(dhts):
    """The first arrival never sees member 2: its decision leaves it out, and everyone, member 2
    included, goes by that decision (member 2 is then the late one)."""
    ids = [node.peer_id.to_base58() for node in dhts.nodes]
    joined = form(dhts, "mm-leader-blind", [0.0, 0.3, 0.6], blind={0: 2})
    assert [j.members for j in joined] == [sorted(ids[:2])] * 3
    assert ids[2] not in joined[2].members


@pytest.mark.slow
def test_without_a_decision_members_go_by_their_own_reading_after_a_bounded_wait(dhts, monkeypatch):
    """The first arrival wrote its arrival and died before deciding: the others wait the window plus
    SETTLE for its decision, then each goes by its own (identical) reading."""
    monkeypatch.setattr(matchmaking, "SETTLE", 1.0)
    ids = [node.peer_id.to_base58() for node in dhts.nodes]
    key = group_key("mm-dead-leader", 0, "shared")
    now = get_dht_time()
    assert dhts.nodes[0].store(
        key, {"peer_id": ids[0], "w": 1.0, "t": now, "m": WINDOW}, expiration_time=now + 30, subkey=dhts.owners[0]
    )
    t0 = time.monotonic()
    joined = form(dhts, "mm-dead-leader", [0.0, 0.2, 0.2], present=[1, 2])
    assert [j.members for j in joined] == [sorted(ids)] * 2
    assert time.monotonic() - t0 >= 1.0  # waited for the decision before going it alone


@pytest.mark.slow
def test_a_group_short_of_its_quorum_waits_for_the_arrival_that_makes_it(dhts):
    """Member 0 opens the round and asks for 3 arrivals; members 1 and 2 come 3 and 4 s later, past the
    2 s window (they were finishing their step). Everyone also expects a dead peer, so nobody sees all
    it expects. All three are members, and the group closed at the third arrival, not at the longest
    wait."""
    ids = [node.peer_id.to_base58() for node in dhts.nodes]
    expected = set(ids) | {"QmDeadPeer"}
    joined = form(dhts, "mm-quorum", [0.0, 3.0, 4.0], quorum=3, expected=expected)
    assert [j.members for j in joined] == [sorted(ids)] * 3
    assert all(3.5 <= j.window < longest_wait(WINDOW) for j in joined), [j.window for j in joined]
    # without a quorum the same arrivals leave the two late ones out
    late = form(dhts, "mm-no-quorum", [0.0, 3.0, 4.0], expected=expected)
    assert [j.members for j in late] == [[ids[0]]] * 3


def test_a_quorum_holds_the_window_open_up_to_the_longest_wait():
    records = {"a": {"t": 10.0, "m": 2.0, "q": 3}, "b": {"t": 11.0}, "c": {"t": 14.0}, "d": {"t": 14.5}}
    records["e"] = {"t": 14.0 + QUORUM_GRACE + 0.1}
    assert closing_time(records, 5.0) == 14.0 + QUORUM_GRACE  # the third arrival past the 2 s window, and a moment
    # the one right behind the third (it was finishing the same work) is in; one that came later is not
    assert decide(records, 5.0).members == ["a", "b", "c", "d"] and decide(records, 5.0).window == 4.0 + QUORUM_GRACE
    third = {"a": {"t": 10.0, "m": 2.0, "q": 3}, "b": {"t": 11.0}, "c": {"t": 10.0 + longest_wait(5.0) - 0.5}}
    assert closing_time(third, 5.0) == 10.0 + longest_wait(5.0)  # the grace never passes the longest wait
    del records["c"], records["d"], records["e"]
    assert closing_time(records, 5.0) == 10.0 + longest_wait(5.0)  # still short: it waits the longest
    assert decide(records, 5.0).members == ["a", "b"] and decide(records, 5.0).window == longest_wait(5.0)
    records["late"] = {"t": 10.0 + longest_wait(5.0) + 1}
    assert closing_time(records, 5.0) == 10.0 + longest_wait(5.0)
    assert "late" not in decide(records, 5.0).members  # after the longest wait
    records = {"a": {"t": 10.0, "m": 2.0, "q": 2}, "b": {"t": 11.0}, "c": {"t": 14.0}}
    assert closing_time(records, 5.0) == 12.0 and decide(records, 5.0).members == ["a", "b"]  # met in the window
    for bad in (True, 2.5, "3", -1):  # only the first arrival's whole count is a quorum
        records = {"a": {"t": 10.0, "m": 2.0, "q": bad}, "b": {"t": 14.0, "q": 5}}
        assert closing_time(records, 5.0) == 12.0, bad


def test_the_deadline_is_the_longest_a_decided_member_proposed():
    records = {
        "a": {"t": 1.0, "m": 2.0, "d": 5.0},
        "b": {"t": 1.5, "m": 2.0, "d": 23.0},
        "c": {"t": 1.2, "m": 2.0, "d": True},
        "late": {"t": 9.0, "m": 2.0, "d": 60.0},
    }
    joined = decide(records, 2.0)
    assert joined.members == ["a", "b", "c"] and joined.timeout == 23.0  # not the late one's; a bool is no number
    assert decide({"a": {"t": 1.0, "m": 2.0}}, 2.0).timeout == 0.0  # none proposed: each keeps its own


def test_arrival_delays_count_every_arrival_and_nothing_else():
    records = {
        "a": {"t": 101.0, "m": 2.0},
        "b": {"t": 100.5},
        "late": {"t": 112.5},
        "done": {"done": True},
        "bad": {"t": "soon"},
        "worse": "text",
    }
    assert arrival_delays(records) == {"a": 0.5, "b": 0.0, "late": 12.0}
    assert arrival_delays({"done": {"done": True}}) == {}


def test_a_decision_round_trips_and_a_malformed_one_is_refused():
    own = Joined(
        ["a", "b", "c"],
        {"a": 0.0, "b": 0.4},
        2.0,
        {"a": Base("d1", 3), "c": Base("d1", 3), "b": Base("d0", 2)},
        timeout=23.0,
    )
    back = adopted(decision(own, "a", 10.0), Joined(["a", "b"], {"a": 0.0}, 2.0))
    assert back.members == ["a", "b", "c"] and back.window == 2.0 and back.timeout == 23.0
    assert back.bases == {"a": Base("d1", 3), "c": Base("d1", 3)}  # the agreed base and who holds it
    assert back.lateness == {"a": 0.0}  # our own reading's
    good = decision(own, "a", 10.0)
    for bad in (
        {"members": ["b", "a"]},
        {"members": []},
        {"members": ["a", "a"]},
        {"members": "ab"},
        {"w": 0},
        {"w": True},
        {"h": [5]},
        {"h": [True]},
        {"h": "0"},
        {"d": 0},
        {"d": True},
        {"d": "23"},
    ):
        assert adopted({**good, **bad}, own) is None, bad
    old = {k: v for k, v in good.items() if k != "d"}  # a first arrival of an earlier version
    assert adopted(old, own).timeout == 0.0
