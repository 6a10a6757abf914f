"""The round simulation: its bookkeeping without faults, what the retry buys, healing, and group decisions."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.lab.simulation import SimConfig, simulate
from p2p_spes.averaging.compression import Codec
from p2p_spes.averaging.membership import decide
from p2p_spes.config import SwarmConfig

SMALL = SimConfig(
    peers=24,
    rounds=20,
    experts=8,
    shared_params=1_000_000,
    expert_params=200_000,
    swarm=SwarmConfig(compression="int8", matchmaking_time=10.0, averaging_timeout=120.0, group_size=0),
)
GRID = replace(SMALL, swarm=replace(SMALL.swarm, group_size=8))  # 24 peers: 3 rows of 8, 8 columns


def test_without_faults_every_round_applies_once_with_every_peer_and_the_bytes_of_the_protocol():
    result = simulate(replace(SMALL, fail_prob=0.0))
    assert all(r.applied and r.attempts == 1 and r.members == 24 and r.peers_applied == 24 for r in result.rounds)
    codec = Codec("int8")
    n, frozen = 24, 8 - 1  # 24 peers over 8 experts: one expert each
    shared = 4 * codec.wire_bytes(1_000_000) * (n - 1) / n  # two phases, up and down
    assert result.rounds[0].bytes_per_peer == pytest.approx(shared + frozen * codec.wire_bytes(200_000), rel=1e-6)
    assert result.summary()["coverage_min"] == 1.0


def test_denser_averaged_parts_cost_their_bytes_on_the_way_back_only():
    """``topk_result_fraction``: the members' contributions stay at k, the averaged parts come back at
    min(n x k, the result's k) a block, and a lone holder's expert update at the result's k."""
    sw = replace(SMALL.swarm, compression="topk", topk_result_fraction=4 / 64)
    result = simulate(replace(SMALL, fail_prob=0.0, swarm=sw))
    codec, n = Codec("topk", 1 / 64, 4 / 64), 24
    ring = 2 * (codec.wire_bytes(1_000_000) + codec.result.wire_bytes(1_000_000)) * (n - 1) / n
    assert result.rounds[0].bytes_per_peer == pytest.approx(ring + 7 * codec.result.wire_bytes(200_000), abs=1)
    plain = simulate(replace(SMALL, fail_prob=0.0, swarm=replace(sw, topk_result_fraction=None)))
    assert plain.rounds[0].bytes_per_peer < result.rounds[0].bytes_per_peer


def test_a_retry_among_survivors_applies_more_rounds_than_none():
    faulty = replace(SMALL, fail_prob=0.15, rounds=60)
    without = simulate(replace(faulty, swarm=replace(faulty.swarm, group_retries=0))).summary()
    with_retry = simulate(faulty).summary()
    assert without["retried_rounds"] == 0 and with_retry["retried_rounds"] > 0
    assert with_retry["rounds_applied"] > without["rounds_applied"]
    # a retried round that applied did so among fewer members than were live
    result = simulate(faulty)
    retried = [r for r in result.rounds if r.attempts > 1 and r.applied]
    assert retried and all(r.members < r.live for r in retried)


def test_a_grid_without_faults_applies_every_round_with_everyone_counted_and_flat_bytes():
    flat = simulate(replace(SMALL, fail_prob=0.0))
    grid = simulate(replace(GRID, fail_prob=0.0))
    assert all(r.applied and r.counted == 1.0 and r.peers_applied == 24 for r in grid.rounds)
    # each member moves its share of rows and results plus its columns' share twice more: about a flat group's
    ratio = grid.summary()["mb_per_peer_round"] / flat.summary()["mb_per_peer_round"]
    assert 0.9 < ratio < 1.1, ratio


def test_at_size_with_failures_a_grid_applies_rounds_a_flat_group_loses():
    """With one retry per round (two deaths in one attempt's retry lose a flat round; a grid's row loses
    only its part)."""
    faulty = replace(SMALL, peers=200, rounds=15, fail_prob=0.05, swarm=replace(SMALL.swarm, group_retries=1))
    flat = simulate(faulty).summary()
    grid = simulate(replace(faulty, swarm=replace(faulty.swarm, group_size=16))).summary()
    assert grid["rounds_applied"] >= 0.95 and grid["rounds_applied"] > flat["rounds_applied"], (grid, flat)
    # the price: some members' contributions miss some columns in rounds with failures
    assert 0.8 < grid["counted_mean"] < 1.0, grid["counted_mean"]


def test_killed_holders_experts_are_taken_over_and_the_same_seed_gives_the_same_run():
    faulty = replace(SMALL, peers=8, fail_prob=0.3, kill_share=1.0, rounds=30, seed=3)
    a, b = simulate(faulty), simulate(faulty)
    assert a.rounds == b.rounds
    assert min(r.live for r in a.rounds) < 8  # peers died ...
    assert all(r.coverage == 1.0 for r in a.rounds[1:]), [r.coverage for r in a.rounds]  # ... and were covered


def test_decide_takes_those_within_the_first_arrivals_window():
    records = {"a": {"t": 10.0, "m": 2.0}, "b": {"t": 11.5, "m": 5.0}, "c": {"t": 12.5, "m": 1.0}}
    joined = decide(records, matchmaking_time=8.0)
    assert joined.members == ["a", "b"] and joined.window == 2.0
    assert joined.lateness == {"a": 0.0, "b": 1.5, "c": 2.5}
    assert decide(records, matchmaking_time=1.0).members == ["a"]  # the window is capped
