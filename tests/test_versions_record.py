"""VersionRecord: the per-round digest records (``version_key``) as a typed value, on the same wire format."""

from __future__ import annotations

import asyncio
import time

import pytest
from hivemind.utils import get_dht_time

from dht.keys import config_key, peers_key, run_config_key, version_key
from dht.node import start_dht
from dht.records import RunSchema, VersionRecord, signed_values
from p2p_spes.swarm.agreement import adoptable, all_published, expert_version, wait_versions

D1, D2, D3 = "a" * 64, "b" * 64, "c" * 64


def wire(**changes) -> dict:
    """A value as the swarm stores it today (``Swarm._sync``), with the writer's peer id added by ``_store``."""
    value = {"ok": True, "shared": D1, "experts": {"0": D2, "3": D3}, "copies": {"5": D1}, "peer_id": "QmPeer"}
    return {**value, **changes}


def test_round_trip_keeps_the_wire_format():
    record = VersionRecord("QmPeer", True, D1, {0: D2, 3: D3}, {5: D1})
    value = record.to_value()
    assert value == wire(), "the dict keys and their string expert indices must not change"
    assert VersionRecord.from_value("QmPeer", value) == record
    assert VersionRecord.from_value("QmPeer", wire()) == record
    empty = VersionRecord("QmPeer", False, D1, {})
    assert empty.to_value()["copies"] == {} and VersionRecord.from_value("QmPeer", empty.to_value()) == empty


def test_tolerated_variations():
    no_copies = {k: v for k, v in wire().items() if k != "copies"}
    assert VersionRecord.from_value("QmPeer", no_copies).copies == {}
    assert VersionRecord.from_value("QmPeer", wire(loss=3.5)).experts == {0: D2, 3: D3}, "extra fields are ignored"
    without_id = {k: v for k, v in wire().items() if k != "peer_id"}
    assert VersionRecord.from_value("QmPeer", without_id).peer_id == "QmPeer", "the checked writer names the record"


@pytest.mark.parametrize(
    "value",
    [
        None,
        "text",
        [1, 2],
        7,
        {k: v for k, v in wire().items() if k != "experts"},
        {k: v for k, v in wire().items() if k != "shared"},
        {k: v for k, v in wire().items() if k != "ok"},
        wire(experts=[0, 3]),
        wire(experts=None),
        wire(copies=[5]),
        wire(copies=None),
        wire(experts={"x": D2}),
        wire(experts={"01": D2}),
        wire(experts={"-1": D2}),
        wire(experts={"": D2}),
        wire(experts={0: D2}),
        wire(experts={"0": None}),
        wire(experts={"0": 1}),
        wire(copies={"5": b"digest"}),
        wire(ok=1),
        wire(ok="true"),
        wire(ok=None),
        wire(shared=None),
        wire(shared=7),
    ],
)
def test_malformed_values_are_rejected(value):
    assert VersionRecord.from_value("QmPeer", value) is None


def test_run_schema_fields_are_the_fixed_key_names():
    run = "r"
    assert {f"{run}_{name}" for name in RunSchema.__fields__} == {peers_key(run), config_key(run), run_config_key(run)}
    assert version_key(run, 3) == "r.round3.versions", "a per-round key: outside the static schema"


@pytest.mark.slow
def test_a_version_record_passes_the_run_dht_and_reads_back():
    dht, identity = start_dht(None, ["vr"], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        record = VersionRecord(identity.peer_id, True, D1, {1: D2}, {})
        key = version_key("vr", 4)
        assert dht.store(key, record.to_value(), get_dht_time() + 30, subkey=identity.owner)
        values = signed_values(dht.get(key, latest=True))
        assert VersionRecord.from_value(identity.peer_id, values[identity.peer_id]) == record
    finally:
        dht.shutdown()


class ScriptedReads:
    """A runtime whose reads of a round's version key return ``reads`` in turn (the last one repeats)."""

    run_id = "r"

    def __init__(self, reads: list[dict[str, VersionRecord]]) -> None:
        self.reads, self.count = reads, 0

    def call(self, coro):
        return asyncio.run(coro)

    async def get(self, key: str) -> dict:
        assert key == version_key("r", 3)
        read = self.reads[min(self.count, len(self.reads) - 1)]
        self.count += 1
        return {p: v.to_value() for p, v in read.items()}


def rec(peer: str, ok: bool = True) -> VersionRecord:
    return VersionRecord(peer, ok, D1, {})


def test_wait_versions_keeps_records_that_lapse_between_reads():
    reads = [{"A": rec("A")}, {"B": rec("B")}]  # A's record expired before B's was stored
    versions = wait_versions(ScriptedReads(reads), 3, {"A", "B"}, window=5.0)
    assert set(versions) == {"A", "B"}


def test_an_adopter_stops_waiting_once_it_has_a_result():
    runtime = ScriptedReads([{"A": rec("A", ok=False)}, {"B": rec("B")}])  # C never publishes
    start = time.monotonic()
    versions = wait_versions(
        runtime, 3, {"A", "B", "C"}, window=20.0, after=0.3, enough=lambda vs: any(v.ok for v in vs.values())
    )
    assert time.monotonic() - start < 5.0, "one result is enough for a peer that adopts"
    assert set(versions) == {"A", "B"}
    start = time.monotonic()
    versions = wait_versions(
        ScriptedReads([{"A": rec("A", ok=False)}]),
        3,
        {"A", "C"},
        window=1.0,
        after=0.3,
        enough=lambda vs: any(v.ok for v in vs.values()),
    )
    assert time.monotonic() - start >= 1.0, "without a result to adopt, the whole window is waited"
    assert set(versions) == {"A"}


def test_an_adopter_that_knows_the_group_ends_its_wait_with_the_members():
    """Members of the attempt that succeeded hold the same bits and wait for each other's records: an
    adopter waits for the records of that many of them (each says how many members its group had), so
    it ends the round when they do, neither a window later nor before them. A result from a peer
    outside the group it missed is not taken."""
    members = {"A", "B", "C"}
    assert set(adoptable({"A": rec("A", ok=False), "B": rec("B"), "X": rec("X"), "me": rec("me")}, "me", members)) == {
        "B"
    }
    assert set(adoptable({"B": rec("B"), "X": rec("X"), "me": rec("me")}, "me")) == {"B", "X"}
    b, c = (VersionRecord(p, True, D1, {}, group=2) for p in "BC")  # A was lost before the retry of B and C
    runtime = ScriptedReads([{"X": rec("X")}, {"B": b}, {"C": c}, {"A": rec("A", ok=False)}])
    start = time.monotonic()
    versions = wait_versions(
        runtime,
        3,
        members,
        window=20.0,
        after=20.0,
        enough=lambda vs: bool(adoptable(vs, "me", members)),
        complete=lambda vs: all_published(adoptable(vs, "me", members)),
    )
    assert time.monotonic() - start < 2.0 and runtime.count == 3, "ended once B and C had both published"
    assert set(versions) == {"X", "B", "C"}
    start = time.monotonic()  # records of an earlier version say nothing of their group: the wait is bounded
    versions = wait_versions(
        ScriptedReads([{"B": rec("B")}]),
        3,
        members,
        window=20.0,
        after=0.5,
        enough=lambda vs: bool(adoptable(vs, "me", members)),
        complete=lambda vs: all_published(adoptable(vs, "me", members)),
    )
    assert 0.5 <= time.monotonic() - start < 2.0 and set(versions) == {"B"}


def test_the_group_size_rides_on_the_record():
    record = VersionRecord("QmPeer", True, D1, {0: D2}, group=5)
    assert record.to_value()["n"] == 5 and VersionRecord.from_value("QmPeer", record.to_value()) == record
    assert "n" not in VersionRecord("QmPeer", False, D1, {}).to_value(), "nothing to say: the old wire format"
    assert VersionRecord.from_value("QmPeer", wire()).group == 0, "a record of an earlier version"
    for bad in (True, -1, 2.0, "5"):
        assert VersionRecord.from_value("QmPeer", wire(n=bad)) is None, bad


def test_failed_experts_ride_on_the_record():
    record = VersionRecord("QmPeer", True, D1, {0: D2, 3: D3}, failed=frozenset({3}))
    assert record.to_value()["failed"] == ["3"] and VersionRecord.from_value("QmPeer", record.to_value()) == record
    assert "failed" not in VersionRecord("QmPeer", True, D1, {0: D2}).to_value(), "nothing to say: the old wire format"
    assert VersionRecord.from_value("QmPeer", wire()).failed == frozenset(), "a record of an earlier version"
    for bad in ([3], ["03"], ["-1"], "3", [True]):
        assert VersionRecord.from_value("QmPeer", wire(failed=bad)) is None, bad


def test_the_agreed_version_counts_holders_whose_group_succeeded_first():
    failed = VersionRecord("A", True, D1, {0: D3}, failed=frozenset({0}))
    ok = VersionRecord("B", True, D1, {0: D2})
    assert expert_version({"A": failed, "B": ok}, 0) == D2, "a 1-1 tie went to the failed holder's larger digest"
    assert expert_version({"A": failed}, 0) == D3, "with no other holder, the failed one's version stands"
    assert expert_version({"A": failed, "B": ok}, 0, exclude="B") == D3
    two_failed = {p: VersionRecord(p, True, D1, {0: D3}, failed=frozenset({0})) for p in "AC"}
    assert expert_version({**two_failed, "B": ok}, 0) == D2, "failed holders outvoted the one that succeeded"
    assert expert_version({"A": failed, "B": ok}, 1) is None
    assert expert_version({"A": VersionRecord("A", True, D1, {0: D2}, failed=frozenset({1})), "B": ok}, 0) == D2
