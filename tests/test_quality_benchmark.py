"""The quality benchmark's bookkeeping: paired gaps, bytes and memory per arm, merging over sessions."""

from __future__ import annotations

import json

import pytest

from benchmarks import quality
from benchmarks.lab import results


def swarm_run(seed: int, final: float, sent: int, received: int, rounds: int, memory: int) -> dict:
    peers = [
        {
            "bytes_sent": sent,
            "bytes_received": received,
            "rounds_joined": rounds,
            "memory": {"total": memory},
            "sync_memory": {"total": memory // 2},
        }
        for _ in range(4)
    ]
    return {
        "seed": seed,
        "final": final,
        "tokens_trained": 100,
        "distinct_weights": {"100": 1},
        "swarm": {"peers": peers, "round_outcomes": {"averaged": rounds * 4}},
    }


def central_run(seed: int, final: float, memory: int) -> dict:
    return {
        "seed": seed,
        "final": final,
        "tokens_trained": 100,
        "distinct_weights": {"100": 1},
        "swarm": None,
        "memory": {"total": memory},
    }


def test_gaps_are_paired_per_seed_and_bytes_and_memory_are_per_peer():
    runs = {
        "centralized": [central_run(0, 4.0, 20_000_000), central_run(1, 5.0, 20_000_000)],
        "default": [
            swarm_run(0, 4.4, 3_000_000, 5_000_000, 8, 15_000_000),
            swarm_run(1, 5.25, 3_000_000, 5_000_000, 8, 15_000_000),
        ],
        "alone": [central_run(0, 6.0, 20_000_000)],
    }
    summary = quality.summarise(runs)
    gap = summary["default"]["gap"]
    assert gap["mean"] == pytest.approx((0.10 + 0.05) / 2)  # per seed, then the mean: not 4.825 / 4.5 - 1
    assert (gap["min"], gap["max"]) == (pytest.approx(0.05), pytest.approx(0.10))
    assert summary["default"]["mb_per_round"] == pytest.approx(1.0)  # (3 + 5) MB over 8 rounds
    assert summary["default"]["mb_per_run"] == pytest.approx(8.0)
    assert summary["default"]["memory_mb"] == pytest.approx(15.0)
    assert summary["default"]["sync_memory_mb"] == pytest.approx(7.5)
    assert summary["default"]["rounds"] == {"averaged": 64}
    assert summary["centralized"]["gap"]["mean"] == 0.0 and summary["centralized"]["mb_per_round"] == 0.0
    assert summary["alone"]["gap"]["mean"] == pytest.approx(0.5)  # only the seeds both arms have
    assert summary["default"]["not_identical_steps"] == []


def test_only_this_scripts_results_of_the_same_setup_are_merged(tmp_path):
    setup = {"config": ["a=1"], "steps": 400, "batch": 8, "validation": {"windows": 1024}}
    assert quality.load_previous("main", setup, base=tmp_path) is None  # nothing stored yet: nothing to merge
    results.write("quality", "main", {**setup, "runs": {"default": []}}, [0], argv=[], base=tmp_path)
    assert quality.load_previous("main", setup, base=tmp_path).payload["runs"] == {"default": []}
    with pytest.raises(SystemExit, match="another steps"):
        quality.load_previous("main", {**setup, "steps": 300}, base=tmp_path)
    # a file without provenance (written before benchmarks/lab/results.py, or by hand) is not merged
    (tmp_path / "quality" / "old.json").write_text(json.dumps({**setup, "runs": {"default": []}}))
    with pytest.raises(SystemExit, match="no provenance"):
        quality.load_previous("old", setup, base=tmp_path)
    # nor one another script wrote
    results.write("convergence", "main", {**setup, "runs": {}}, [0], argv=[], base=tmp_path)
    (tmp_path / "convergence" / "main.json").replace(tmp_path / "quality" / "other.json")
    with pytest.raises(SystemExit, match="written by 'convergence'"):
        quality.load_previous("other", setup, base=tmp_path)


def test_every_arm_is_scored_against_a_centralized_run_of_its_own_tokens():
    for name, arm in quality.ARMS.items():
        base = quality.ARMS[arm.baseline]
        assert base.overrides is None, name
        if arm.overrides is not None:  # a swarm of P peers at batch 8 against one process at batch 8 P
            assert base.peers == arm.peers, name
