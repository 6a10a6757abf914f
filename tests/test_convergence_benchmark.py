"""The convergence benchmark's ``--reuse``: which earlier runs a new result may take instead of running them."""

from __future__ import annotations

import pytest

from benchmarks.convergence import ARMS, reusable, take_runs
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
    "threads": 1,
}


def earlier(name: str = "x", final: float = 5.3, date: str = "2026-11-01", **changes) -> results.Result:
    """A convergence result as read from its file (JSON keys are strings, steps included) that ran spes at
    seeds 0 and 1, and spes-topk-dense at seed 0 with other overrides than that arm has now."""
    run = {"seed": 0, "final": final, "curve": {"150": 6.4, "750": final}, "distinct_weights": {"750": 1}}
    payload = {
        **SETUP,
        **changes,
        "arms": {"spes": ARMS["spes"], "spes-topk-dense": ["swarm.compression=int8"]},
        "runs": {"spes": [run, {**run, "seed": 1}], "spes-topk-dense": [run]},
    }
    return results.Result(results.path("convergence", name), payload, {"commit": f"{name}-commit", "date": date})


def test_runs_of_the_same_arm_and_setup_are_taken_with_their_steps_as_numbers_and_their_commit():
    taken = reusable(earlier(), SETUP, ["spes", "spes-topk-dense", "spes-topk-dense-lone5"])
    # spes-topk-dense ran there with other overrides than it has now: not the same arm, run again
    assert sorted(taken) == [("spes", 0), ("spes", 1)]
    run = taken[("spes", 1)]
    assert run["curve"] == {150: 6.4, 750: 5.3} and run["distinct_weights"] == {750: 1}
    assert run["seed"] == 1 and run["reused_from"] == {"variant": "x", "commit": "x-commit"}
    assert reusable(earlier(), SETUP, ["spes-topk-dense"]) == {}


def test_the_first_result_named_wins_a_run_keeps_where_it_was_measured_and_only_givers_are_merged():
    old, new = earlier("old", 5.0, "2026-10-01"), earlier("new", 5.1, "2026-11-01")
    taken, used = take_runs([new, old], SETUP, ["spes"], [0, 1])
    assert {k: r["final"] for k, r in taken.items()} == {("spes", 0): 5.1, ("spes", 1): 5.1}
    assert used == [new]  # old gave nothing: the provenance does not claim it
    taken, used = take_runs([new, old], SETUP, ["spes"], [2])  # seeds this run does not ask for
    assert taken == {} and used == []
    # a result that itself took a run names the file that measured it, not the one it passed through
    passed = earlier("passed")
    passed.payload["runs"]["spes"][0]["reused_from"] = {"variant": "old", "commit": "old-commit"}
    taken, _ = take_runs([passed], SETUP, ["spes"], [0, 1])
    assert taken[("spes", 0)]["reused_from"]["variant"] == "old"
    assert taken[("spes", 1)]["reused_from"]["variant"] == "passed"


@pytest.mark.parametrize("key,value", [("peers", 4), ("steps", 480), ("config", ["model.d_model=32"]), ("threads", 2)])
def test_a_result_of_another_setup_is_refused_naming_what_differs(key, value):
    with pytest.raises(results.ResultError, match=f"another setup \\({key} differ"):
        reusable(earlier(**{key: value}), SETUP, ["spes"])


def test_runs_from_another_machine_are_refused_with_the_fix():
    here = earlier()
    here.provenance["machine"] = {"platform": "Linux-a"}
    assert sorted(reusable(here, SETUP, ["spes"], "Linux-a")) == [("spes", 0), ("spes", 1)]
    with pytest.raises(results.ResultError, match="measured on Linux-a, this machine is Linux-b.*without --reuse"):
        reusable(here, SETUP, ["spes"], "Linux-b")
    # a file that recorded no machine is taken, as before
    assert sorted(reusable(earlier(), SETUP, ["spes"], "Linux-b")) == [("spes", 0), ("spes", 1)]


def test_another_machines_runs_are_taken_only_when_asked():
    there = earlier()
    there.provenance["machine"] = {"platform": "another platform"}
    with pytest.raises(results.ResultError, match="measured on another platform"):
        take_runs([there], SETUP, ["spes"], [0])
    taken, used = take_runs([there], SETUP, ["spes"], [0], other_machine=True)
    assert list(taken) == [("spes", 0)] and used == [there]


def test_a_reuse_may_name_the_arms_it_takes_from_a_file():
    taken, used = take_runs([earlier("a"), earlier("b", 5.0)], SETUP, ["spes"], [0], only=[["diloco"], None])
    assert taken[("spes", 0)]["reused_from"]["variant"] == "b" and used == [earlier("b", 5.0)]
    taken, used = take_runs([earlier("a")], SETUP, ["spes"], [0], only=[["diloco"]])
    assert taken == {} and used == []


def test_every_arm_is_a_valid_config_and_the_shares_it_names_are_what_it_runs():
    from p2p_spes.config import load_config

    def config(arm: str):  # a bad key or value raises, naming it (None: centralized)
        return load_config(None, [o.format(merge=60, experts=2) for o in ARMS[arm] or []])

    for arm in ARMS:
        config(arm)
    swarm = config("spes-topk-dense12-lone7").swarm
    assert (swarm.topk_result_fraction * 256, swarm.topk_lone_fraction * 256) == (12, 7)
