"""The convergence benchmark's ``--reuse``: which earlier runs a new result may take instead of running them."""

from __future__ import annotations

import pytest

from benchmarks.convergence import ARMS, reusable
from benchmarks.lab import results

SETUP = {
    "config": ["model.d_model=64", "swarm.sync_steps=5"],
    "peers": 8,
    "batch": 4,
    "steps": 750,
    "sync_steps": 5,
    "eval_every": 150,
    "merge_interval": 60,
    "pacing": "lockstep (boundary barrier)",
    "validation": {"windows": 1024, "seq_len": 64},
}


def earlier(**changes) -> results.Result:
    """A convergence result as read from its file: JSON keys are strings, steps included."""
    run = {"seed": 0, "final": 5.3, "curve": {"150": 6.4, "750": 5.3}, "distinct_weights": {"750": 1}, "swarm": None}
    payload = {
        **SETUP,
        **changes,
        "arms": {"spes": ARMS["spes"], "spes-topk-dense": ["swarm.compression=int8"]},
        "runs": {"spes": [run, {**run, "seed": 1}], "spes-topk-dense": [run]},
    }
    return results.Result(results.path("convergence", "x"), payload, {"commit": "abc1234"})


def test_runs_of_the_same_arm_and_setup_are_taken_with_their_steps_as_numbers_and_their_commit():
    taken = reusable(earlier(), SETUP, ["spes", "spes-topk-dense", "spes-topk-dense-lone5"])
    # spes-topk-dense ran there with other overrides than it has now: not the same arm, run again
    assert sorted(taken) == [("spes", 0), ("spes", 1)]
    run = taken[("spes", 1)]
    assert run["curve"] == {150: 6.4, 750: 5.3} and run["distinct_weights"] == {750: 1}
    assert run["seed"] == 1 and run["reused_from"] == {"variant": "x", "commit": "abc1234"}
    assert reusable(earlier(), SETUP, ["spes-topk-dense-lone5"]) == {}


@pytest.mark.parametrize("key,value", [("peers", 4), ("steps", 480), ("config", ["model.d_model=32"])])
def test_a_result_of_another_setup_is_refused_naming_what_differs(key, value):
    with pytest.raises(results.ResultError, match=f"another setup \\({key} differ"):
        reusable(earlier(**{key: value}), SETUP, ["spes"])
