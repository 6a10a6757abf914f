"""Compressed pseudo-gradient rounds on a loopback swarm: identical weights, delta refreshes, run-wide codec."""

from __future__ import annotations

import pytest
from helpers import SMALL, assert_identical_after_rounds, join_once, rounds

from p2p_spes.config import load_config
from p2p_spes.local_swarm import LocalSwarm
from p2p_spes.model import MoETransformer


def expert_bytes() -> int:
    """fp32 bytes of one expert of the SMALL config (all layers)."""
    cfg = load_config(None, SMALL)
    model = MoETransformer(cfg.model, cfg.moe, local_experts=[0], device="meta")
    return sum(t.numel() for t in model.expert_tensors(0)) * 4


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["topk", "int8"])
def test_compressed_rounds_end_bit_identical_and_refresh_frozen_experts_by_delta(tmp_path, compression):
    swarm = LocalSwarm(None, SMALL + ["train.max_steps=50", "swarm.merge_interval=0",
                                      f"swarm.compression={compression}"], peers=2, run_dir=tmp_path)
    try:
        swarm.start()
        codes = swarm.wait(timeout=300)
    finally:
        swarm.stop()
    assert codes == [0, 0], [(tmp_path / f"peer{i}.log").read_text()[-2000:] for i in range(2)]
    dirs = [tmp_path / f"peer{i}" for i in range(2)]
    # every member applies the same decoded average to the same anchor: bit-identical, checked by SHA-256
    assert_identical_after_rounds(dirs, min_common=3)
    summaries = swarm.summaries()
    for s, d in zip(summaries, dirs):
        assert s["rounds_joined"] >= 4 and s["updates_refused"] == 0
        # top-k sends 1/64 of each pseudo-gradient per round (the rest follows through error feedback):
        # in 5 rounds it has moved less of the local progress than int8
        assert s["final_val_loss"] < s["first_train_loss"] - {"topk": 0.2, "int8": 0.5}[compression]
        # each peer holds the other's 3 experts frozen. Once both have averaged together once, their copies
        # are the groups' anchors and every refresh comes as an encoded average (before, a joiner's experts
        # may have moved while their copies here were still at the seeded values: those come whole, once)
        records = sorted(rounds(d).items())
        first = min(n for n, r in records if r["outcome"] == "averaged")
        later = [r for n, r in records if n > first]
        assert later and all(r["refreshed_by_delta"] == r["refreshed"] == 3 for r in later), \
            [(r["refreshed"], r["refreshed_by_delta"]) for r in later]
        assert s["delta_refreshes"] >= 3 * len(later)
        # anchors (shared + 3 own experts) and the residuals of what our messages dropped, on the CPU
        memory = s["sync_memory"]
        assert memory["device"] == "cpu" and memory["anchors"] > 3 * expert_bytes()
        assert memory["residuals"] == memory["anchors"], "one residual per anchored value"
        limit = {"topk": 0.05, "int8": 0.3}[compression] * 3 * expert_bytes()
        assert all(r["downloaded_bytes"] < limit for r in later), \
            f"refreshes downloaded {[r['downloaded_bytes'] for r in later]} bytes, 3 whole experts are {3 * expert_bytes()}"


@pytest.mark.slow
def test_a_peer_with_another_codec_is_refused_before_sending_anything(tmp_path):
    swarm = LocalSwarm(None, SMALL + ["train.max_steps=200", "swarm.compression=topk"], peers=1, run_dir=tmp_path)
    try:
        swarm.start()
        maddrs = swarm.wait_for_maddrs(0)
        proc = join_once(tmp_path / "other", maddrs, SMALL + ["swarm.compression=int8"])
    finally:
        swarm.stop()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "encodes its sync rounds differently" in proc.stderr, proc.stderr[-2000:]
    assert "compression topk (topk_fraction 0.015625) there, compression int8 here" in proc.stderr
    assert "run-wide" in proc.stderr
    assert not (tmp_path / "other" / "metrics.jsonl").exists() or "sync_round" not in \
        (tmp_path / "other" / "metrics.jsonl").read_text()
