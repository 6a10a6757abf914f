"""Merging a benchmark's shares: the setup they must share, and each arm against its own share's baseline."""

from __future__ import annotations

import pytest

from benchmarks.lab import shares
from benchmarks.lab.spread import spread


def run(final: float) -> dict:
    return {"final": final, "curve": {"1": final}}


def test_a_validation_set_is_the_same_wherever_its_cache_lives_but_not_with_other_windows():
    a = {"steps": 10, "validation": {"directory": "/root/.cache/x", "shards": ["s"], "windows": 1024}}
    b = {"steps": 10, "validation": {"directory": "/home/u/.cache/x", "shards": ["s"], "windows": 1024}}
    c = {"steps": 10, "validation": {"directory": "/root/.cache/x", "shards": ["s"], "windows": 512}}
    assert shares.differing([a, b], ("steps", "validation")) == []
    assert shares.differing([a, b, c], ("steps", "validation")) == ["validation"]


def test_each_arm_keeps_its_own_shares_baseline_and_a_repeated_baseline_is_listed_once():
    joined, repeats = shares.join(
        [
            ("a", {"base": {"0": run(5.0)}, "x": {"0": run(5.5)}}),
            ("b", {"base": {"0": run(5.2)}, "y": {"0": run(5.3)}}),
        ],
        "base",
    )
    assert joined["base"] == {"0": run(5.0)}
    assert joined["x"]["0"]["baseline"]["final"] == 5.0 and joined["y"]["0"]["baseline"]["final"] == 5.2
    assert shares.baselines(joined["y"], joined["base"])["0"]["final"] == 5.2
    assert repeats == [{"seed": "0", "variant": "b", "final": 5.2, "kept": 5.0, "apart": pytest.approx(0.04)}]
    with pytest.raises(shares.MergeError, match="x seed 0 is in more than one variant"):
        shares.join([("a", {"base": {"0": run(5.0)}, "x": {"0": run(5.5)}})] * 2, "base")
    with pytest.raises(shares.MergeError, match="x seed 1 in a has no base run of its own share"):
        shares.join([("a", {"base": {"0": run(5.0)}, "x": {"1": run(5.5)}})], "base")


def test_a_spread_is_mean_min_max_and_sample_std_and_none_of_no_seeds():
    assert spread([1.0, 2.0, 4.0]) == {"mean": 7 / 3, "min": 1.0, "max": 4.0, "std": pytest.approx(1.5275252)}
    assert spread([3.0]) == {"mean": 3.0, "min": 3.0, "max": 3.0, "std": 0.0}
    with pytest.raises(ValueError, match="no values"):
        spread([])
