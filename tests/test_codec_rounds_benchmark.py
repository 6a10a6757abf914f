"""The long codec benchmark: its gaps, bytes and merging, and one short run of it end to end."""

from __future__ import annotations

import json

import pytest

from benchmarks import codec_rounds, comms
from benchmarks.lab import results
from p2p_spes.averaging.compression import Codec


def fake_run(curve: dict[int, float]) -> dict:
    return {"curve": {str(k): v for k, v in curve.items()}, "final": curve[max(curve)], "seconds": 1.0}


def test_gaps_are_taken_per_seed_against_uncompressed_and_the_curve_is_their_mean():
    runs = {
        "4": {
            "none": {"0": fake_run({5: 6.0, 10: 5.0}), "1": fake_run({5: 6.0, 10: 4.0})},
            "sparse": {"0": fake_run({5: 6.6, 10: 5.05}), "1": fake_run({5: 6.3, 10: 4.12})},
        }
    }
    summary = codec_rounds.summarise(runs, 1_000_000)["4"]
    sparse = summary["sparse"]
    assert sparse["gaps"] == pytest.approx({"0": 0.01, "1": 0.03})
    assert sparse["gap"]["mean"] == pytest.approx(0.02) and sparse["gap"]["max"] == pytest.approx(0.03)
    assert sparse["gap_curve"] == pytest.approx({"5": (0.1 + 0.05) / 2, "10": 0.02})
    assert summary["none"]["gap"] is None


def test_bytes_are_the_protocols_every_byte_against_the_fp32_reference():
    numel, peers = 1_000_000, 4
    row = codec_rounds.round_bytes("sparse", numel, peers)
    assert row["per_peer"] == comms.ours(Codec("sparse"), numel, 0, 0, peers)["total"]
    assert row["reference_fp32"] == 2 * 4 * numel  # upload the model, download it
    assert row["less"] == pytest.approx(row["reference_fp32"] / row["per_peer"])
    dense = codec_rounds.round_bytes("topk-dense", numel, peers)
    assert dense["per_peer"] > codec_rounds.round_bytes("topk", numel, peers)["per_peer"]  # denser parts back


def test_each_codec_of_a_merge_is_compared_with_the_uncompressed_run_of_its_own_share(tmp_path, monkeypatch):
    monkeypatch.setenv(results.ROOT_ENV, str(tmp_path))
    setup = {"steps": 10, "sync": 5, "eval_rounds": 1, "parameters": 1_000_000, "validation": {"windows": 4}}

    def share(variant: str, runs: dict) -> None:
        results.start("codec_rounds", variant, seeds=[0], argv=[]).write({**setup, "runs": {"4": runs}})

    share("a", {"int8": {"0": fake_run({1: 6.1, 2: 5.1})}, "none": {"0": fake_run({1: 6.0, 2: 5.0})}})
    # none seed 0 again beside sparse, ending elsewhere (another machine): sparse is measured against it
    share("b", {"none": {"0": fake_run({1: 6.0, 2: 5.2})}, "sparse": {"0": fake_run({1: 6.6, 2: 5.72})}})
    codec_rounds.main(["--merge", "a", "b", "--variant", "ab"])
    payload = json.loads(results.path("codec_rounds", "ab", base=tmp_path).read_text())
    runs, summary = payload["runs"]["4"], payload["summary"]["4"]
    assert list(runs) == list(summary) == ["none", "int8", "sparse"]  # the arms in the script's order
    assert list(payload["spes_1b"]["peers"]["4"]) == ["none", "int8", "sparse"]
    assert summary["none"]["finals"] == {"0": 5.0}  # the first share's run is the one listed
    assert summary["int8"]["gaps"] == pytest.approx({"0": 5.1 / 5.0 - 1})
    assert summary["sparse"]["gaps"] == pytest.approx({"0": 0.1})  # against 5.2, not 5.0
    assert summary["sparse"]["gap_curve"] == pytest.approx({"1": 0.1, "2": 0.1})
    [repeat] = payload["repeats"]
    assert repeat["variant"] == "b" and repeat["apart"] == pytest.approx(0.04)
    share("c", {"none": {"0": fake_run({1: 6.0, 2: 5.0})}, "int8": {"0": fake_run({1: 6.1, 2: 5.1})}})
    with pytest.raises(SystemExit, match="4 peers: int8 seed 0 is in more than one variant"):
        codec_rounds.main(["--merge", "a", "c", "--variant", "ac"])
    share("d", {"none": {"1": fake_run({1: 6.0, 2: 5.0})}, "int8": {"2": fake_run({1: 6.1, 2: 5.1})}})
    with pytest.raises(SystemExit, match="int8 seed 2 in d has no none run of its own share"):
        codec_rounds.main(["--merge", "a", "d", "--variant", "ad"])
    none = {"0": fake_run({1: 6.0, 2: 5.1}), "1": fake_run({1: 6.0, 2: 5.0})}
    share("e", {"none": none, "int8": {"1": fake_run({1: 6.1, 2: 5.05})}})
    codec_rounds.main(["--merge", "ab", "e", "--variant", "again"])  # a merged result merges on, repeats kept
    again = json.loads(results.path("codec_rounds", "again", base=tmp_path).read_text())
    assert [r["variant"] for r in again["repeats"]] == ["b", "e"]
    assert again["summary"]["4"]["int8"]["gaps"] == pytest.approx({"0": 0.02, "1": 0.01})
    assert again["summary"]["4"]["sparse"]["gaps"] == pytest.approx({"0": 0.1})
    assert again["optimizer"] == "muon"  # shares written before --optimizer trained with Muon
    results.start("codec_rounds", "f", seeds=[3], argv=[]).write(
        {**setup, "optimizer": "adamw", "runs": {"4": {"none": {"3": fake_run({1: 6.0, 2: 5.0})}}}}
    )
    with pytest.raises(SystemExit, match=r"differ in \['optimizer'\]"):
        codec_rounds.main(["--merge", "a", "f", "--variant", "af"])


def test_the_adamw_replicas_train_adamw_alone_and_the_default_is_the_trainers_muon():
    assert codec_rounds.probe("sparse", 4, 5).muon and codec_rounds.probe("sparse", 4, 5).muon_adamw_scale == 4.0
    adamw = codec_rounds.probe("topk-dense", 4, 5, "adamw")
    assert not adamw.muon and adamw.muon_adamw_scale == 1.0
    assert adamw.codec == "topk" and adamw.result_fraction == codec_rounds.DENSE


@pytest.mark.long  # two short runs of the micro model and their validation: 40-60 s on 2 cores
def test_a_short_run_writes_curves_and_a_merge_joins_two_shares(tmp_path, monkeypatch):
    monkeypatch.setenv(results.ROOT_ENV, str(tmp_path))
    common = ["--arms", "none", "sparse", "--peers", "2", "--sync", "1", "--rounds", "2", "--eval-rounds", "1"]
    common += ["--val-windows", "64"]
    codec_rounds.main([*common, "--seeds", "0", "--variant", "s0"])
    codec_rounds.main([*common, "--seeds", "1", "--variant", "s1"])
    codec_rounds.main(["--merge", "s0", "s1", "--variant", "both"])
    payload = json.loads(results.path("codec_rounds", "both", base=tmp_path).read_text())
    assert payload["provenance"]["merged"] and payload["seeds"] == [0, 1]
    runs = payload["runs"]["2"]
    assert sorted(runs["sparse"]) == ["0", "1"] and sorted(runs["sparse"]["0"]["curve"]) == ["1", "2"]
    assert runs["sparse"]["0"]["final"] != runs["none"]["0"]["final"]  # the codec changed what was applied
    gap = payload["summary"]["2"]["sparse"]["gap"]
    assert gap["min"] <= gap["mean"] <= gap["max"]
