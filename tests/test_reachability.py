"""The dial-back probe (dht/reachability.py): which addresses a prober dials, a connect on loopback
(a libp2p greeting accepts; a bare accept or a closed port fails), the rate bound, the role the answers give,
and the handler between two libp2p daemons on loopback; and what the roles change in downloads: a
private peer never dials another, a reachable one asks private holders last, data comes from
reachable holders."""

from __future__ import annotations

import asyncio
import socket
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import SMALL_MODEL
from hivemind.p2p import P2P

from dht.bootstrap import Bootstrap, BootstrapOptions
from dht.reachability import (
    GREETING,
    MAX_TARGETS,
    Answer,
    Dial,
    DialbackServer,
    RateLimit,
    ask,
    askable,
    decide,
    dial_targets,
    reachable_first,
    tcp_address,
    try_connect,
)
from dht.records import PeerRecord, VersionRecord
from p2p_spes.averaging import TransportError, tensor_digest
from p2p_spes.cli_config import load_from_args
from p2p_spes.cli_parser import build_parser
from p2p_spes.config import load_config
from p2p_spes.model import MoETransformer
from p2p_spes.swarm import Swarm
from p2p_spes.swarm.agreement import Refresher, wait_versions
from p2p_spes.swarm.counters import SwarmCounters
from p2p_spes.swarm.data_server import peer_sources
from p2p_spes.swarm.membership import Membership
from p2p_spes.swarm.pacing import sync_deadline


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_addresses_and_what_a_prober_dials():
    assert tcp_address("/ip4/10.0.0.2/tcp/31337/p2p/QmPeer") == ("10.0.0.2", 31337)
    assert tcp_address("/ip6/::1/tcp/5/p2p/QmPeer") == ("::1", 5)
    assert tcp_address("/ip4/10.0.0.2/udp/1/quic") is None and tcp_address("/dns4/x.org/tcp/1") is None
    assert tcp_address("/ip4/300.0.0.1/tcp/1") is None and tcp_address("/ip4/1.2.3.4/tcp/0") is None
    # behind a NAT: its private address is not dialled (on our side it is a machine of our own network),
    # its port is, at the address its connection came from (the router's)
    assert dial_targets(["/ip4/192.168.2.2/tcp/4000/p2p/Qm"], ["10.47.0.2"]) == [("10.47.0.2", 4000)]
    # a public peer: its own address, once
    assert dial_targets(["/ip4/10.47.0.1/tcp/4000"], ["10.47.0.1"]) == [("10.47.0.1", 4000)]
    # loopback only when it came from loopback: never our own services for someone elsewhere
    assert dial_targets(["/ip4/127.0.0.1/tcp/4000"], ["10.0.0.9"]) == [("10.0.0.9", 4000)]
    assert dial_targets(["/ip4/127.0.0.1/tcp/4000"], ["127.0.0.1"]) == [("127.0.0.1", 4000)]
    # a globally routable announced address is dialled as announced; nothing but TCP; at most MAX_TARGETS
    assert dial_targets(["/ip4/8.8.8.8/tcp/1", "/ip4/10.1.1.1/udp/2"], []) == [("8.8.8.8", 1)]
    many = [f"/ip4/8.8.8.{i}/tcp/{1000 + i}" for i in range(10)]
    assert len(dial_targets(many, ["9.9.9.9"])) == MAX_TARGETS
    assert askable(["/ip4/1.2.3.4/tcp/5/p2p/QmA", "/ip4/1.2.3.5/tcp/5/p2p/QmMe", "/ip4/x/tcp/1"], "QmMe") == [
        ("QmA", "the initial peer at /ip4/1.2.3.4/tcp/5")
    ]
    assert reachable_first(["a", "b", "c", "d"], {"a", "c"}) == ["b", "d", "a", "c"]


def test_a_libp2p_listener_answers_and_a_bare_accept_or_a_closed_port_does_not():
    """Only a listener that greets like libp2p counts: a transparent proxy (a firewall, the lab's delay
    proxy) accepts every connection itself and closes it when its dial onward fails, and a plain TCP
    probe took that for a reachable peer."""

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(GREETING)
        await writer.drain()
        writer.close()

    async def dials() -> list[Dial]:
        libp2p = await asyncio.start_server(greet, "127.0.0.1", 0)
        proxy = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        async with libp2p, proxy:
            return [
                await try_connect("127.0.0.1", libp2p.sockets[0].getsockname()[1]),
                await try_connect("127.0.0.1", proxy.sockets[0].getsockname()[1]),
                await try_connect("127.0.0.1", closed_port()),
            ]

    greeted, bare, refused = asyncio.run(dials())
    assert greeted.ok and greeted.maddr.startswith("/ip4/127.0.0.1/tcp/")
    assert not bare.ok and "without a libp2p greeting" in bare.error
    assert not refused.ok and "refused" in refused.error.lower()


def test_a_requester_gets_a_few_probes_a_minute():
    limit = RateLimit(per_peer=3, total=5, window=60.0)
    assert [limit.admit("a", now=t) for t in (0, 1, 2, 3)] == [True, True, True, False]
    assert limit.admit("b", now=4) and limit.admit("b", now=5)
    assert not limit.admit("c", now=6), "all requesters together: at most 5 a minute"
    assert limit.admit("a", now=60.5), "a minute after its first probe, one more"


def test_the_role_the_answers_give():
    ok, refused = Dial("/ip4/10.47.0.1/tcp/4", True), Dial("/ip4/10.47.0.2/tcp/4", False, "Connection refused")
    public = decide([Answer("A", "the initial peer at X", (refused, ok))])
    assert public.role == "public" and "dialled /ip4/10.47.0.1/tcp/4 back" in public.reason
    private = decide([Answer("A", "the initial peer at X", (refused,)), Answer("B", "peer B", error="timeout")])
    assert private.role == "private" and private.source == "probe"
    assert "the initial peer at X could not dial /ip4/10.47.0.2/tcp/4 (Connection refused)" in private.reason
    assert private.describe().endswith("averaging as a client: contributing and fetching, reducing nothing")
    assert decide([]).role == "public" and decide([]).source == "alone"
    old = decide([Answer("A", "the initial peer at X", error="protocol not supported")])
    assert old.role == "public" and old.source == "assumed" and "protocol not supported" in old.reason


@pytest.mark.slow
def test_the_dialback_handler_between_two_daemons_on_loopback():
    """A requester asks a prober to dial its own listening address (accepted) and a closed port
    (failed); the fourth request within a minute is refused by the rate bound."""

    async def run() -> list[Answer]:
        prober = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        requester = await P2P.create(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await prober.get_visible_maddrs()
        )
        try:
            await DialbackServer(prober).start()
            peer = prober.peer_id.to_base58()
            mine = [str(m) for m in await requester.get_visible_maddrs()]
            closed = [f"/ip4/127.0.0.1/tcp/{closed_port()}"]
            return [
                await ask(requester, peer, "the prober", mine),
                await ask(requester, peer, "the prober", closed),
                await ask(requester, peer, "the prober", mine),
                await ask(requester, peer, "the prober", mine),
            ]
        finally:
            await requester.shutdown()
            await prober.shutdown()

    reachable, closed, _, limited = asyncio.run(run())
    assert reachable.conclusive and reachable.accepted, reachable
    assert closed.conclusive and not closed.accepted and "refused" in closed.dials[0].error.lower(), closed
    assert decide([reachable]).role == "public" and decide([closed]).role == "private"
    assert not limited.conclusive and "rate limited" in limited.error
    assert decide([limited]).role == "public"  # no answer: assumed public


class CopyServer:
    """Serves expert ``uid``s by peer: ``serves`` maps a peer to the attempt from which it serves (it
    refreshed its copy then); every other download is refused."""

    def __init__(self, tensors: list[torch.Tensor], serves: dict[str, int]) -> None:
        self.tensors, self.serves, self.calls = tensors, serves, []

    def deadline(self, like) -> float:
        return 1.0  # seconds a download may take: the wait for a reachable copy stays at its least

    def download(self, peer: str, uid: str, like, attempts: int = 4):
        self.calls.append(peer)
        if len(self.calls) > self.serves.get(peer, 10**9):
            return {"digest": tensor_digest(self.tensors)}, [t.clone() for t in self.tensors]
        raise TransportError(f"{peer} does not serve {uid}")


def test_a_private_peer_never_dials_a_private_holder_and_takes_a_reachable_copy(monkeypatch):
    monkeypatch.setattr("p2p_spes.swarm.agreement.time.sleep", lambda seconds: None)
    cfg = load_config(None, SMALL_MODEL)
    model = MoETransformer(cfg.model, cfg.moe, local_experts=[0])
    agreed = [t.detach() + 1 for t in model.expert_tensors(1)]
    digest = tensor_digest(agreed)
    peers = {
        "natted": PeerRecord("natted", [1], 10, 1, "fp", [], {"reachability": "private"}),
        "public": PeerRecord("public", [2], 10, 1, "fp", [], {"reachability": "public"}),
    }
    versions = {"natted": VersionRecord("natted", True, "s", {1: digest})}
    # the public peer's copy is the agreed one from its second ask on (it was still refreshing it)
    server = CopyServer(agreed, {"public": 1})
    natted_too = Refresher("me", server, SwarmCounters(), reachable=False)
    assert natted_too.refresh(model, peers, [1], versions, versions) == (1, 0)
    assert server.calls == ["public", "public"] and tensor_digest(model.expert_tensors(1)) == digest
    # a reachable peer asks a private holder too (a connection it opened to us carries it), but last
    model = MoETransformer(cfg.model, cfg.moe, local_experts=[0])
    peers["other"] = PeerRecord("other", [1], 10, 1, "fp", [], {})  # an older peer: says nothing, reachable
    versions["other"] = VersionRecord("other", True, "s", {1: digest})
    server = CopyServer(agreed, {"natted": 1})
    assert Refresher("me", server, SwarmCounters()).refresh(model, peers, [1], versions, versions) == (1, 0)
    assert server.calls == ["other", "natted"]


def test_a_private_holder_whose_group_missed_the_other_holder_takes_the_agreed_version(monkeypatch):
    """Two private holders of expert 0 each applied their own update (one was late for the round): the
    round agrees on one version (ties to the larger digest, the same for everyone), and the holder whose
    copy lost takes it from a reachable peer's copy, so next round their group has one anchor; the
    holder whose copy won keeps its own and downloads nothing."""
    monkeypatch.setattr("p2p_spes.swarm.agreement.time.sleep", lambda seconds: None)
    cfg = load_config(None, SMALL_MODEL)
    ours = MoETransformer(cfg.model, cfg.moe, local_experts=[0])
    theirs = [t.detach() + 1 for t in ours.expert_tensors(0)]
    mine, other = tensor_digest(ours.expert_tensors(0)), tensor_digest(theirs)
    peers = {
        "me": PeerRecord("me", [0], 10, 1, "fp", [], {"reachability": "private"}),
        "natted": PeerRecord("natted", [0], 10, 1, "fp", [], {"reachability": "private"}),
        "public": PeerRecord("public", [1], 10, 1, "fp", [], {"reachability": "public"}),
    }
    versions = {p: VersionRecord(p, True, "s", {0: d}) for p, d in (("me", mine), ("natted", other))}
    server = CopyServer(theirs, {"public": 0})  # the public peer serves the other holder's version
    refresher = Refresher("me", server, SwarmCounters(), reachable=False)
    taken = refresher.take_agreed(ours, peers, [0], versions, versions)
    if max(mine, other) == mine:
        assert taken == [] and server.calls == [], "our own version won: nothing to take"
    else:
        assert taken == [0] and server.calls == ["public"], server.calls
        assert tensor_digest(ours.expert_tensors(0)) == other
    # the same records seen from the other holder: exactly one of the two takes the other's version
    flipped = MoETransformer(cfg.model, cfg.moe, local_experts=[0])
    flipped.write_expert(0, theirs)
    server = CopyServer([t.detach() for t in MoETransformer(cfg.model, cfg.moe).expert_tensors(0)], {"public": 0})
    again = Refresher("natted", server, SwarmCounters(), reachable=False).take_agreed(
        flipped, peers, [0], versions, versions
    )
    assert len(taken) + len(again) == 1, (taken, again)


def test_data_comes_from_reachable_holders_when_there_are_any():
    manifest_holding = {"data": {"fingerprint": "f", "shards": [0]}}
    records = {
        p: PeerRecord(p, [], 0, 0, "fp", [], {**manifest_holding, "reachability": role})
        for p, role in (("a", "private"), ("b", "public"), ("c", "private"))
    }
    assert [s.peer for s in peer_sources(None, records, "f", "me", 0)] == ["b"]
    del records["b"]
    assert sorted(s.peer for s in peer_sources(None, records, "f", "me", 0)) == ["a", "c"]  # better than nothing


def test_flags_force_a_role_on_train_swarm_and_bootstrap():
    parser = build_parser()
    train = parser.parse_args(["train", "--reachability", "private", "--use-auto-relay", "--set", "train.lr=0.01"])
    cfg = load_from_args(train)
    assert (cfg.swarm.reachability, cfg.swarm.use_auto_relay, cfg.train.lr) == ("private", True, 0.01)
    # the local swarm passes it to every peer as one more --set
    assert parser.parse_args(["swarm", "--reachability", "public"]).overrides == ["swarm.reachability=public"]
    assert parser.parse_args(["bootstrap"]).reachability == "auto"
    assert parser.parse_args(["train"]).overrides == [] and load_config(None, []).swarm.reachability == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--reachability", "sometimes"])


@pytest.mark.slow
def test_a_bootstrap_serves_the_dialback_and_asks_its_initial_peers(tmp_path):
    first = Bootstrap(BootstrapOptions(str(tmp_path / "a.key"), ["/ip4/127.0.0.1/tcp/0"]))
    second: Bootstrap | None = None
    try:
        options = BootstrapOptions(str(tmp_path / "b.key"), ["/ip4/127.0.0.1/tcp/0"], initial_peers=first.start())
        second = Bootstrap(options)
        second.start()
        assert first.reachability.source == "alone" and first.reachability.reachable
        assert second.reachability.source == "probe" and second.reachability.reachable, second.reachability
        assert "the initial peer at /ip4/127.0.0.1/tcp/" in second.reachability.reason
    finally:
        if second is not None:
            second.shutdown()
        first.shutdown()


class Clock:
    """A fake monotonic clock that ``sleep`` advances."""

    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Behind:
    """``others()``: one peer still in round ``last - 1`` until ``until`` (fake) seconds, then done."""

    def __init__(self, clock: Clock, role: str, until: float, last: int) -> None:
        self.clock, self.role, self.until, self.last = clock, role, until, last

    def others(self) -> dict[str, PeerRecord]:
        r = self.last if self.clock.now >= self.until else self.last - 1
        return {"p": PeerRecord("p", [1], 10, r, "fp", [], {"reachability": self.role})}


@pytest.mark.parametrize("role", ["private", "public"])
def test_a_reachable_peer_lingers_for_a_private_peer_still_in_the_last_round(monkeypatch, role):
    """A private peer takes the experts only private peers train from a reachable peer's copy: a
    reachable peer that left 15 s after its last round left it without them (lab run, 1 public + 2
    NATed, the last round). It now waits for a private peer up to a whole round; for a public one the
    bound stays 15 s."""
    clock = Clock()
    monkeypatch.setattr("p2p_spes.swarm.pacing.time.monotonic", lambda: clock.now)
    monkeypatch.setattr("p2p_spes.swarm.pacing.time.sleep", clock.sleep)
    cfg = load_config(None, [])
    swarm = Swarm.__new__(Swarm)
    swarm.cfg, swarm.rounds = cfg, [SimpleNamespace(round=3)]
    swarm.runtime = SimpleNamespace(reachability=SimpleNamespace(reachable=True))
    swarm.membership = Behind(clock, role, until=60.0, last=3)
    swarm.linger()
    old_bound = cfg.swarm.matchmaking_time + cfg.swarm.averaging_timeout / 3
    assert sync_deadline(cfg.swarm, 2) > 60.0 > old_bound
    if role == "private":
        assert 60.0 <= clock.now < 61.0, clock.now
    else:
        assert old_bound <= clock.now < old_bound + 1.0, clock.now


class VersionsLater:
    """A runtime whose DHT holds peer "b"'s version record from fake second ``at`` on."""

    run_id = "r"

    def __init__(self, clock: Clock, at: float) -> None:
        self.clock, self.at = clock, at

    def get(self, key):
        return {"b": VersionRecord("b", True, "s", {}).to_value()} if self.clock.now >= self.at else {}

    def call(self, value):
        return value


def test_a_reducer_for_clients_waits_for_their_digests_while_it_reduces_their_groups(monkeypatch):
    """The outsider of the clients' expert groups finished its own groups first and stopped waiting for
    their digests a version window later (lab: 1 public + 3 NATed, the last round): it never refreshed
    the experts only they train. It now waits while a group it reduces for them is open."""
    clock = Clock()
    monkeypatch.setattr("p2p_spes.swarm.agreement.time.monotonic", lambda: clock.now)
    monkeypatch.setattr("p2p_spes.swarm.agreement.time.sleep", clock.sleep)
    runtime = VersionsLater(clock, at=30.0)
    assert wait_versions(runtime, 1, {"b"}, window=7.0) == {}
    clock.now = 0.0
    got = wait_versions(runtime, 1, {"b"}, window=7.0, hold=lambda: 60.0)
    assert set(got) == {"b"} and 30.0 <= clock.now < 31.0
    clock.now = 0.0
    runtime.at = 100.0  # a client that never publishes: the wait ends with the outsider's deadline
    assert wait_versions(runtime, 1, {"b"}, window=7.0, hold=lambda: 60.0) == {} and 60.0 <= clock.now < 61.0


class Reads:
    """A runtime whose DHT answers each read of the peers' records with the next of ``answers``."""

    run_id, peer_id = "r", "me"

    def __init__(self, answers: list[dict]) -> None:
        self.answers = answers

    def get(self, key):
        return self.answers.pop(0)

    def call(self, value):
        return value


def test_the_outsiders_a_group_of_clients_may_pick_survive_a_read_that_missed_them():
    """A NATed peer's DHT (a client of the few public peers) can lose them for a moment: a read of the
    records then misses the public peer, and the groups of NATed holders first arriving with that view
    named no outsider and failed (lab: 1 public + 3 NATed, the last round). The reachable peers read
    within the record's lifetime stay candidates (counted back from the latest read that found another peer);
    one that announced leaving does not."""
    cfg = load_config(None, [])
    fp = cfg.model_fingerprint()

    def record(peer: str, role: str, **more) -> dict:
        return {**PeerRecord(peer, [1], 10, 1, fp, [], {"reachability": role}).to_value(), **more}

    both = {"pub": record("pub", "public"), "nat": record("nat", "private"), "me": record("me", "private")}
    runtime = Reads([both, {"me": both["me"]}, {**both, "pub": record("pub", "public", left=True)}])
    membership = Membership(runtime, cfg, SwarmCounters(), experts=lambda: [1])
    seen = membership.reachable_seen
    assert set(membership.live_peers()) == {"pub", "nat", "me"}
    assert seen.within(15.0, "me") == ["pub"]
    assert set(membership.live_peers()) == {"me"}  # a read that missed everyone else
    assert seen.within(15.0, "me") == ["pub"]
    later = time.monotonic() + 16.0  # longer after it than a record lives
    seen.update(
        {"me": PeerRecord.from_value("me", both["me"])}, {}, later, "me"
    )  # our DHT cut off: the others do not age
    assert seen.within(15.0, "me") == ["pub"]
    seen.update(
        {"nat": PeerRecord.from_value("nat", both["nat"])}, {}, later, "me"
    )  # a read that found others, but not it
    assert seen.within(15.0, "me") == [], "seen longer before the latest read than a record lives"
    membership.live_peers()
    assert seen.within(15.0, "me") == [], "it announced leaving"
