"""The round-against-its-anchor benchmark: its limits and ratios, and both arms run on loopback."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import round_anchor
from benchmarks.lab.netlab import InterfaceCounts


def args(**kw) -> argparse.Namespace:
    base = {
        "peers": 2,
        "mbit": 8.0,
        "numel": 1000,
        "rounds": 1,
        "slot": 30.0,
        "window": 5.0,
        "codecs": ["none"],
        "loopback": False,
    }
    return argparse.Namespace(**{**base, **kw})


def row(arm: str, peer: int, seconds: float, digest: str = "d") -> dict:
    return {
        "round": 0,
        "arm": arm,
        "peer": peer,
        "ok": True,
        "members": 2,
        "seconds": seconds,
        "digest": digest,
        "mean_abs_error": 0.0,
    }


@pytest.fixture(autouse=True)
def no_warmup(monkeypatch):
    monkeypatch.setattr(round_anchor, "WARMUP", 0)  # the rows here are all measured rounds


def test_each_slot_is_held_to_the_least_time_its_bytes_need_on_the_link():
    a = args()
    slots = [(0, "hivemind"), (0, "ours-none")]
    rows = [
        row("hivemind", 0, 4.0, "x"),
        row("hivemind", 1, 5.0, "y"),
        row("ours-none", 0, 3.0),
        row("ours-none", 1, 2.0),
    ]
    zero = InterfaceCounts(0, 0, 0, 0)
    counts = [  # at each slot's start, then after the last: 1 MB/s links (8 Mbit/s)
        [zero, zero],
        [InterfaceCounts(2_000_000, 1_000_000, 0, 0), InterfaceCounts(1_000_000, 2_000_000, 0, 0)],
        [InterfaceCounts(3_000_000, 2_000_000, 0, 0), InterfaceCounts(2_000_000, 3_000_000, 0, 0)],
    ]
    out = round_anchor.summarise(a, slots, rows, counts, None)
    hive, ours = out["arms"]["hivemind"], out["arms"]["ours-none"]
    assert out["slots"][0]["limit_seconds"] == pytest.approx(2.0)  # 2 MB up on a 1 MB/s link
    assert hive["over_limit"] == pytest.approx(5.0 / 2.0) and hive["identical"] == 0  # its peers' bits differ
    assert ours["over_limit"] == pytest.approx(3.0 / 1.0) and ours["identical"] == 1
    assert hive["bytes_per_peer"] == 3_000_000 and ours["bytes_per_peer"] == 2_000_000
    assert ours["hivemind_bytes_over_ours"] == pytest.approx(1.5) and ours["seconds_vs_hivemind"] == pytest.approx(0.6)


def test_a_lossless_round_short_of_the_exact_mean_or_of_a_member_is_not_ok():
    """hivemind's averager reports success when a peer got part of the results and kept its own values
    for the rest; such a round is not counted as averaged, nor one with a member missing."""
    partial = {**row("hivemind", 1, 5.0), "mean_abs_error": 0.017}
    short = {**row("ours-none", 1, 2.0), "members": 1}
    rows = [row("hivemind", 0, 4.0), partial, row("ours-none", 0, 3.0), short]
    out = round_anchor.summarise(args(loopback=True), [(0, "hivemind"), (0, "ours-none")], rows, [[None] * 2] * 3, None)
    assert out["arms"]["hivemind"]["ok"] == 0 and out["arms"]["ours-none"]["ok"] == 0


def test_a_slot_a_peer_missed_is_not_ok():
    out = round_anchor.summarise(
        args(loopback=True), [(0, "hivemind"), (0, "ours-none")], [row("hivemind", 0, 1.0)], [[None, None]] * 3, None
    )
    assert out["arms"]["hivemind"]["ok"] == 0 and out["arms"]["ours-none"]["seconds"] is None


@pytest.mark.long  # eight DHT daemons and two slots of averaging on 127.0.0.1: about a minute
def test_both_arms_average_on_loopback_and_ours_ends_exact_and_identical(tmp_path):
    a = args(loopback=True, numel=50_000, slot=20.0, run_dir=tmp_path, codecs=["none"])
    out = round_anchor.run(a, tmp_path)
    hive, ours = out["arms"]["hivemind"], out["arms"]["ours-none"]
    assert hive["ok"] == ours["ok"] == 1, out["slots"]
    assert ours["identical"] == 1 and ours["mean_abs_error"] == 0.0  # the exact mean, the same bits everywhere
    assert hive["mean_abs_error"] < 1e-6  # hivemind's mean, to float rounding
