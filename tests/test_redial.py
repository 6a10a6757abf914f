"""A peer whose DHT lost every neighbour finds the run again (``dht.node.Redial``, ``Membership.stay_connected``).

hivemind drops a neighbour after one unanswered request and never re-bootstraps, so a peer that was
stopped for a while and dropped by the others in turn reads no record again. These tests cut a real
loopback peer off that way and check that it reconnects through its initial peers, or, when those
died, through the peers it last read.
"""

from __future__ import annotations

import json
import time

import pytest
from hivemind.p2p import PeerID

from dht.auth import RunAuth
from dht.node import Redial, peer_id_of
from p2p_spes.config import load_config
from p2p_spes.swarm.counters import SwarmCounters
from p2p_spes.swarm.membership import Membership
from p2p_spes.swarm.runtime import Runtime

RUN = "redial"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RECORD_TTL = 6.0  # seconds: records a cut-off peer holds in its own storage lapse within a test


async def neighbours(_dht, node) -> list[str]:
    return [p.to_base58() for p in node.protocol.routing_table.uid_to_peer_id.values()]


class Drop:
    """Remove ``peer`` (or everyone, with None) from a node's routing table: what unanswered requests do."""

    def __init__(self, peer: str | None) -> None:
        self.peer = peer

    async def __call__(self, _dht, node) -> int:
        table = node.protocol.routing_table
        for uid, peer in list(table.uid_to_peer_id.items()):
            if self.peer is None or peer == PeerID.from_base58(self.peer):
                del table[uid]
        return len(table.uid_to_peer_id)


class Member:
    """One trainer's DHT side: a ``Runtime`` and a ``Membership`` that publishes a record with one expert."""

    def __init__(self, initial_peers: list[str], expert: int) -> None:
        self.cfg = load_config(
            overrides=[
                f"swarm.run_id={json.dumps(RUN)}",
                f"swarm.initial_peers={json.dumps(initial_peers)}",
                f"swarm.host_maddrs={json.dumps(LOOPBACK)}",
                f"swarm.record_ttl={RECORD_TTL}",
            ]
        )
        self.runtime = Runtime(self.cfg.swarm, RunAuth())
        self.stats = SwarmCounters()
        self.membership = Membership(self.runtime, self.cfg, self.stats, experts=lambda: [expert])
        self.peer_id = self.runtime.peer_id
        self.alive = True

    def others_seen(self, step: int = 0) -> set[str]:
        """The other peers whose record at ``step`` we can read (old records linger in our own storage)."""
        return {p for p, r in self.membership.live_peers().items() if p != self.peer_id and r.step == step}

    def neighbours(self) -> list[str]:
        return self.runtime.dht.run_coroutine(neighbours)

    def drop(self, peer: str | None) -> int:
        return self.runtime.dht.run_coroutine(Drop(peer))

    def stop(self, announce: bool = False) -> None:
        if self.alive:
            if announce:
                self.membership.announce_leaving()
            self.alive = False
            self.runtime.shutdown()


@pytest.fixture
def swarm():
    """Peers 0-2 joined through peer 0; the last one is the peer under test, joined through peer 0 too."""
    first = Member([], 0)
    maddrs = list(first.runtime.maddrs)
    members = [first] + [Member(maddrs, e) for e in (1, 2, 3)]
    try:
        announce_all(members)
        assert reads_the_rest(members), "the peer under test should read the others before it is cut off"
        yield members
    finally:
        for m in members:
            m.stop()


def announce_all(members: list[Member], step: int = 0) -> None:
    """Every live peer writes its record at ``step`` (as its heartbeat would)."""
    for m in members:
        if m.alive:
            m.membership.update_status(step=step)
            m.membership.announce()


def reads_the_rest(members: list[Member], step: int = 0) -> bool:
    """Whether the last peer reads every other live peer's record at ``step``."""
    return members[-1].others_seen(step) == {m.peer_id for m in members[:-1] if m.alive}


def cut_off(members: list[Member]) -> None:
    """The last peer drops everyone and everyone drops it: what a long stop does to both sides."""
    me = members[-1]
    assert me.drop(None) == 0
    for m in members[:-1]:
        if m.alive:
            m.drop(me.peer_id)


def reconnects(members: list[Member], through: set[str]) -> None:
    """One heartbeat's redial of the last peer reaches one of ``through``, and it reads the rest again."""
    me = members[-1]
    me.runtime.call(me.membership.stay_connected())
    assert me.stats.dht_redials == 1
    assert set(me.neighbours()) & through
    announce_all(members, step=2)
    assert reads_the_rest(members, step=2)


@pytest.mark.slow
def test_a_cut_off_peer_reconnects_through_its_initial_peer(swarm):
    me = swarm[-1]
    cut_off(swarm)
    me.membership.seen.clear()  # only the initial peer is left to try
    announce_all(swarm, step=1)
    assert me.others_seen(step=1) == set(), "a peer with no neighbour should not read new records"
    assert me.neighbours() == []
    reconnects(swarm, through={swarm[0].peer_id})


@pytest.mark.slow
def test_a_cut_off_peer_whose_initial_peer_died_reconnects_through_peers_it_read(swarm):
    me = swarm[-1]
    assert set(me.membership.seen) == {m.peer_id for m in swarm[:-1]}
    swarm[0].stop()  # the only address it was given
    cut_off(swarm)
    announce_all(swarm, step=1)
    assert me.others_seen(step=1) == set()
    started = time.monotonic()
    reconnects(swarm, through={swarm[1].peer_id, swarm[2].peer_id})
    assert time.monotonic() - started < 30, "a dead peer's ping must not hold the redial up for long"


@pytest.mark.slow
def test_a_connected_peer_or_the_runs_first_peer_sends_nothing(swarm):
    me = swarm[-1]
    before = me.neighbours()
    me.runtime.call(me.membership.stay_connected())
    assert me.stats.dht_redials == 0 and me.neighbours() == before
    # a node with no neighbour and nobody to ask: Redial sends nothing and says so
    alone = Member([], 9)
    try:
        assert alone.runtime.dht.run_coroutine(Redial(())) == (0, 0)
        alone.runtime.call(alone.membership.stay_connected())
        assert alone.stats.dht_redials == 0
    finally:
        alone.stop()


def test_peer_id_of_a_multiaddr():
    assert peer_id_of("/ip4/1.2.3.4/tcp/5/p2p/QmPeer") == "QmPeer"
    assert peer_id_of("/ip4/1.2.3.4/tcp/5") is None
    assert peer_id_of("/ip4/1.2.3.4/tcp/5/p2p/") is None


@pytest.mark.slow
def test_a_peer_that_reads_nobody_at_a_boundary_reconnects_before_believing_it_is_alone(swarm):
    """Cut off with neighbours in its table that no longer answer for it (here: none, and the others
    dropped it), a peer that read others before forces a redial and reads them again."""
    me = swarm[-1]
    cut_off(swarm)
    time.sleep(RECORD_TTL + 0.5)  # the records it holds itself lapse: it reads nobody now
    assert me.others_seen() == set() and me.neighbours() == []
    announce_all(swarm, step=3)  # the others go on writing records it cannot read
    started = time.monotonic()
    assert me.membership.reach_others(within=20.0)
    assert me.stats.reconnects == 1 and time.monotonic() - started < 20
    assert reads_the_rest(swarm, step=3)


@pytest.mark.slow
def test_a_peer_whose_run_left_waits_once_then_goes_on_alone(swarm):
    me = swarm[-1]
    for m in swarm[:-1]:
        m.stop(announce=True)
    started = time.monotonic()
    assert not me.membership.reach_others(within=3.0)
    assert 3.0 <= time.monotonic() - started < 15.0
    assert me.membership.seen == {} and me.stats.reconnects == 0
    started = time.monotonic()
    assert not me.membership.reach_others(within=3.0), "it forgot them: no second wait"
    assert time.monotonic() - started < 1.0


@pytest.mark.slow
def test_two_peers_cut_off_together_meet_the_rest_again(swarm):
    """The peer under test and peer 2 know only each other, and the rest dropped both (what a shared
    stop does): one heartbeat's probes of peers it read before and lacks bring the rest back."""
    me, partner = swarm[-1], swarm[2]
    for m in (me, partner):
        for other in swarm:
            if other not in (me, partner):
                m.drop(other.peer_id)
                other.drop(m.peer_id)
    assert set(me.neighbours()) == {partner.peer_id}
    time.sleep(RECORD_TTL + 0.5)
    announce_all(swarm, step=1)
    assert me.others_seen(step=1) <= {partner.peer_id}, "the pair reads nothing of the rest"
    me.runtime.call(me.membership.stay_connected())
    assert {swarm[0].peer_id, swarm[1].peer_id} <= set(me.neighbours())
    announce_all(swarm, step=2)
    assert reads_the_rest(swarm, step=2)


class CountingRuntime:
    """A runtime whose DHT reads of the peers key are counted (and find nobody)."""

    run_id, peer_id = RUN, "QmMe"

    def __init__(self) -> None:
        self.reads = 0

    def call(self, coro):
        coro.close()  # never awaited: the read is answered here
        self.reads += 1
        return {}

    def get(self, key: str):
        async def nothing() -> dict:
            return {}

        return nothing()


def test_a_recent_read_of_the_live_peers_stands_in_for_a_new_one_when_asked(monkeypatch):
    """At a boundary the reconnect check reads the live peers, then the are-we-behind check and the
    round would read them again before the peer arrives in its group: a read younger than ``max_age``
    is reused; without ``max_age`` every call reads."""
    clock = [100.0]
    monkeypatch.setattr("p2p_spes.swarm.membership.time.monotonic", lambda: clock[0])
    runtime = CountingRuntime()
    membership = Membership(runtime, load_config(None, []), SwarmCounters(), experts=lambda: [0])
    membership.live_peers()
    membership.others(max_age=2.0)
    membership.live_peers(max_age=2.0)
    assert runtime.reads == 1
    membership.others()
    assert runtime.reads == 2, "no max_age: a new read"
    clock[0] += 2.5
    membership.live_peers(max_age=2.0)
    assert runtime.reads == 3, "too old: a new read"
