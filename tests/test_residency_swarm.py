"""Loopback swarms with partial residency: training, traffic, takeover of a dead holder's experts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import SMALL, last_step, rounds

from dht.inspector import collect, open_dht
from p2p_spes.averaging.transport import tensor_digest
from p2p_spes.local_swarm import LocalSwarm

pytestmark = pytest.mark.slow  # loopback swarms of several processes

# wider experts than test_swarm's so that expert traffic is visible next to the shared parameters
BASE = [o for o in SMALL if not o.startswith("moe.ffn_dim")] + [
    "moe.ffn_dim=256",
    "swarm.merge_interval=0",
    "swarm.record_ttl=6",
    "swarm.heartbeat=1.5",
]
PARTIAL = ["swarm.residency=partial"]
D, F, LAYERS, VOCAB = 64, 256, 2, 8192
EXPERT_BYTES = 3 * F * D * LAYERS * 4
# embed and lm_head; per layer attention, q/k-norms, two RMSNorms, router (6 experts); final norm
SHARED_BYTES = 4 * (2 * VOCAB * D + LAYERS * (4 * D * D + 2 * D + 2 * D + 6 * D) + D)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def downloads(summary: dict) -> int:
    """Bytes received outside the averaging groups: catch-up, refreshes, adoptions and takeovers."""
    return summary["traffic"]["downloading"]["received"]


def exported_expert_digests(hf_dir: Path, num_experts: int) -> dict[str, str]:
    """Each expert's digest over our layout (per layer w1, v1, w2) from a Hugging Face export."""
    from safetensors.torch import load_file

    weights = load_file(str(hf_dir / "model.safetensors"))
    out = {}
    for e in range(num_experts):
        tensors = []
        for i in range(LAYERS):
            prefix = f"model.layers.{i}.mlp.experts.{e}"
            tensors += [
                weights[f"{prefix}.gate_proj.weight"],
                weights[f"{prefix}.up_proj.weight"],
                weights[f"{prefix}.down_proj.weight"].t().contiguous(),
            ]
        out[str(e)] = tensor_digest(tensors)
    return out


@pytest.mark.long  # over a minute: out of the default suite (which stays near 15 minutes), in CI's long one
def test_partial_swarm_trains_and_moves_only_its_own_experts(tmp_path):
    swarm = LocalSwarm(None, BASE + PARTIAL + ["train.max_steps=140"], peers=3, run_dir=tmp_path)
    try:
        swarm.start()
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not all(
            (tmp_path / f"peer{i}" / "metrics.jsonl").exists() and len(rounds(tmp_path / f"peer{i}")) >= 3
            for i in range(3)
        ):
            time.sleep(0.3)
        # no peer holds every expert, yet the full model can be assembled from the holders
        export = subprocess.run(
            [
                sys.executable,
                "-m",
                "p2p_spes",
                "export",
                "--from-swarm",
                "--run-id",
                "local",
                "--out",
                str(tmp_path / "hf"),
                "--initial-peers",
                *swarm.wait_for_maddrs(0),
            ],
            capture_output=True,
            text=True,
            timeout=240,
            start_new_session=True,
        )
        codes = swarm.wait(timeout=400)
    finally:
        swarm.stop()
    assert codes == [0, 0, 0], [(tmp_path / f"peer{i}.log").read_text()[-2000:] for i in range(3)]
    assert export.returncode == 0, export.stdout[-2000:] + export.stderr[-3000:]
    assembled_round = int(re.search(r"assembled round (\d+)", export.stdout).group(1))
    assert "6 experts from a holder" in export.stdout
    published: dict[str, set[str]] = {}  # every version of each expert its holder published from that round on
    for i in range(3):
        for n, r in rounds(tmp_path / f"peer{i}").items():
            if n >= assembled_round:
                for e, digest in r["expert_digests"].items():
                    published.setdefault(e, set()).add(digest)
    for e, digest in exported_expert_digests(tmp_path / "hf", 6).items():
        assert digest in published[e], f"expert {e} in the assembled export is not a version its holder published"
    summaries = swarm.summaries()
    # a partial peer's own checkpoint is not a full model: exporting it is refused with the way out
    fewest = min(range(3), key=lambda i: len(summaries[i]["local_experts"]))
    assert len(summaries[fewest]["local_experts"]) < 6
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "p2p_spes",
            "export",
            "--checkpoint",
            str(tmp_path / f"peer{fewest}"),
            "--out",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert refused.returncode == 2 and "--from-swarm" in refused.stderr
    assert {e for s in summaries for e in s["local_experts"]} == set(range(6))
    for i, s in enumerate(summaries):
        run_dir = tmp_path / f"peer{i}"
        own = s["local_experts"]
        assert s["final_val_loss"] < summaries[0]["first_train_loss"] - 1.0  # peer 0 started the run
        # only its own experts have storage: no frozen copies at all
        params = s["memory"]["parameters"]
        assert params["frozen_experts"] == 0 and params["local_experts"] == len(own) * EXPERT_BYTES
        assert params["shared"] == SHARED_BYTES
        done = rounds(run_dir)
        assert len(done) >= 4
        for r in done.values():  # averaged: the shared group and its own experts (it may take some over)
            held = {e for e in r["expert_digests"]}
            assert set(r["groups"]) == {"shared"} | {f"expert{e}" for e in held} and held <= {str(e) for e in own}
            assert r["refreshed"] == 0
        # outside the groups it downloaded at most the catch-up at join (shared weights and its experts)
        # and once more per round it missed (the result the others agreed on): no other expert, ever
        # (an expert it took over came from a holder, a full peer, or its seeded init if nobody had it)
        allowed = (1 + s["rounds_failed"] + s["rounds_adopted"]) * (SHARED_BYTES + len(own) * EXPERT_BYTES) + s[
            "experts_taken_over"
        ] * EXPERT_BYTES
        assert downloads(s) <= 1.02 * allowed
        steps = [r for r in records(run_dir) if "skip_rate" in r]
        assert steps and all(len(r["skip_rate"]) == LAYERS and all(0 <= x <= 1 for x in r["skip_rate"]) for r in steps)
        mean_skip = sum(sum(r["skip_rate"]) for r in steps) / (LAYERS * len(steps))
        assert 0 < mean_skip < 1  # it holds 2 of 6 experts: some assignments are skipped, not all


@pytest.mark.long  # over a minute: out of the default suite (which stays near 15 minutes), in CI's long one
def test_mixed_swarm_stays_consistent_and_a_dead_holders_experts_are_taken_over(tmp_path):
    swarm = LocalSwarm(None, BASE + ["train.max_steps=90"], peers=3, run_dir=tmp_path)
    try:
        # peer 0 is full but has no spare capacity; peers 1 and 2 are partial
        swarm.overrides.append("swarm.max_experts_per_peer=2")
        swarm.start_peer(0, [])
        swarm.overrides.remove("swarm.max_experts_per_peer=2")
        maddrs = swarm.wait_for_maddrs(0)
        swarm.overrides += PARTIAL
        swarm.start_peer(1, maddrs)
        victim = swarm.start_peer(2, maddrs)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (
            (tmp_path / "peer2" / "metrics.jsonl").exists() and len(rounds(tmp_path / "peer2")) >= 2
        ):
            time.sleep(0.3)
        assert len(rounds(tmp_path / "peer2")) >= 2, (tmp_path / "peer2.log").read_text()[-2000:]
        killed_step = last_step(tmp_path / "peer2")
        victim_experts = {int(e) for e in rounds(tmp_path / "peer2")[max(rounds(tmp_path / "peer2"))]["expert_digests"]}
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        # the inspector shows the coverage heal: the partial peer's takeover, and no expert left uncovered
        dht = open_dht(maddrs, "local")
        try:
            healed, deadline = None, time.monotonic() + 180
            while healed is None and time.monotonic() < deadline:
                snap = collect(dht, "local")
                covered = all(snap["coverage"][e]["holders"] for e in victim_experts)
                if any(p["experts_taken_over"] for p in snap["peers"]) and covered:
                    healed = snap
                time.sleep(1.0)
        finally:
            dht.shutdown()
        codes = [swarm.procs[i].wait(400) for i in (0, 1)]
    finally:
        swarm.stop()
    assert codes == [0, 0], [(tmp_path / f"peer{i}.log").read_text()[-2000:] for i in (0, 1)]
    assert healed is not None, "the inspector never showed a takeover covering the dead peer's experts"
    assert [p["residency"] for p in healed["peers"] if p["experts_taken_over"]] == ["partial"]
    s0, s1 = swarm.summaries()[:2]
    taken = [r for r in records(tmp_path / "peer1") if "took_over" in r]
    assert taken, (tmp_path / "peer1.log").read_text()[-3000:]
    took = sorted(e for r in taken for e in r["took_over"])
    first_own = set(s1["local_experts"]) - set(took)
    # it took over exactly the dead peer's experts that neither the full peer nor its own first choice hold
    assert took and took == sorted(victim_experts - set(s0["local_experts"]) - first_own)
    assert taken[0]["step"] > killed_step
    assert s1["experts_taken_over"] == len(took) and victim_experts <= set(s0["local_experts"]) | set(
        s1["local_experts"]
    )
    # the partial peer holds exactly its experts, those it took over included
    assert s1["memory"]["parameters"]["local_experts"] == len(s1["local_experts"]) * EXPERT_BYTES
    assert s1["memory"]["parameters"]["frozen_experts"] == 0
    assert s0["memory"]["parameters"]["frozen_experts"] == 4 * EXPERT_BYTES
    # every expert is covered after the takeover, and both peers agree on every expert they both hold
    r0, r1 = rounds(tmp_path / "peer0"), rounds(tmp_path / "peer1")
    last = max(set(r0) & set(r1))
    assert r0[last]["shared_digest"] == r1[last]["shared_digest"]
    assert set(r0[last]["expert_digests"]) == {str(e) for e in range(6)}
    for e, digest in r1[last]["expert_digests"].items():
        assert r0[last]["expert_digests"][e] == digest, f"expert {e} differs between the full and the partial peer"
