"""Short chaos run: a 4-peer loopback swarm goes through a kill inside averaging, a freeze longer than
the averaging deadline, and a restart from a checkpoint, and must come out consistent and learning.

``benchmarks/chaos.py`` runs the same checks over many random faults.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from helpers import free_port

from benchmarks.lab.chaos import Chaos, analyse, orphaned
from p2p_spes.checkpoint import find_checkpoint, read_state
from p2p_spes.config import load_config
from p2p_spes.local_swarm import LocalSwarm
from p2p_spes.metrics_log import read_metrics
from p2p_spes.swarm import sync_deadline

pytestmark = pytest.mark.slow  # a 4-peer loopback swarm through faults

MATCHMAKING, TIMEOUT, SYNC = 4.0, 8.0, 10
CHAOS = [
    "model.d_model=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.max_seq_len=32",
    "moe.num_experts=8",
    "moe.ffn_dim=64",
    "train.batch_size=4",
    "train.warmup_steps=2",
    "train.eval_interval=1000",
    "train.log_interval=1",
    "train.checkpoint_interval=10",
    f"swarm.sync_steps={SYNC}",
    f"swarm.matchmaking_time={MATCHMAKING}",
    f"swarm.averaging_timeout={TIMEOUT}",
    "swarm.replicas=2",
]


def wait_for_round(swarm: LocalSwarm, peers: list[int], round_no: int, timeout: float) -> None:
    """Until each of ``peers`` has logged a sync round numbered ``round_no`` or later."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reached = [
            max((r["sync_round"] for r in read_metrics(swarm.run_dir / f"peer{i}") if "sync_round" in r), default=-1)
            for i in peers
        ]
        if min(reached) >= round_no:
            return
        time.sleep(0.5)
    raise AssertionError(f"peers {peers} did not reach round {round_no} within {timeout}s")


@pytest.mark.long
def test_swarm_survives_kill_in_sync_freeze_and_restart(tmp_path):
    # 200 steps (20 rounds): the frozen peer catches up to wherever the others are when its failed round
    # ends (round 11 to 14 of them, by the machine's load), and must still have rounds to average in
    swarm = LocalSwarm(None, CHAOS + ["train.max_steps=200"], peers=4, run_dir=tmp_path, run_id="chaos")
    deadline = sync_deadline(load_config(None, CHAOS).swarm, peers=4)
    # frozen past one group attempt's deadline (the others retry without it), not past the retry's too:
    # a longer freeze lets the others near the end of their steps before the killed peer restarts
    attempt = sync_deadline(load_config(None, CHAOS + ["swarm.group_retries=0"]).swarm, peers=4)
    chaos = Chaos(swarm, SYNC, freeze_seconds=attempt + 2, seed=1)
    try:
        swarm.start(stagger=1.0)
        wait_for_round(swarm, [0, 1, 2, 3], 2, timeout=240)
        chaos.kill(3, in_sync=True)
        chaos.freeze(2)
        wait_for_round(swarm, [0, 1], 6, timeout=240)
        chaos.restart(3)
        codes = swarm.wait(timeout=400)
    finally:
        swarm.stop()
    logs = [(tmp_path / f"peer{i}.log").read_text()[-3000:] for i in range(4)]
    assert codes == [0, 0, 0, 0], logs
    restarted = (tmp_path / "peer3.log").read_text()
    # the restart resumed from its own checkpoint and then took the run's current state (its first start
    # may or may not have: before the run's first round it holds the seeded weights the others serve)
    resumed = restarted.rfind("resumed from")
    assert resumed >= 0 and "joined the run at round" in restarted[resumed:], restarted[-3000:]

    report = analyse(tmp_path, 4, chaos.faults, deadline)
    report.orphans = orphaned(swarm)
    print(report.to_dict())
    assert report.faults == {"kill-in-sync": 1, "freeze": 1, "restart": 1}
    assert report.orphans == 0, "a killed peer left its DHT or p2pd processes behind"
    assert report.consistency_checks >= 10 and not report.consistency_failures, report.consistency_failures
    assert report.rounds_completed > 2 * report.rounds_discarded, report
    recovered = max(f.end for f in chaos.faults)
    for i in range(4):  # everyone, the restarted and the frozen peer included, averages again afterwards
        after = [r for r in read_metrics(tmp_path / f"peer{i}") if "sync_round" in r and r["time"] > recovered]
        assert sum(r["shared_ok"] for r in after) >= 2, (i, [(r["sync_round"], r["shared_ok"]) for r in after])
    assert report.longest_stall_s <= report.stall_bound_s, report
    assert report.loss_fell, (report.loss_first, report.loss_last)


@pytest.mark.long  # over a minute: out of the default suite (which stays near 15 minutes), in CI's long one
def test_a_run_outlives_its_bootstrap_and_a_full_disk_during_a_checkpoint(tmp_path):
    # peers join through a bootstrap (as in a real run); the bootstrap is killed and started again, and
    # one peer's disk (a tmpfs of its own: root only) fills up through a checkpoint. Both peers finish
    # with no error, the full disk cost that peer one checkpoint, and its final checkpoint is written.
    if os.geteuid() != 0:
        pytest.skip("filling a disk needs a tmpfs of its own: run as root")
    swarm = LocalSwarm(
        None, CHAOS + ["train.max_steps=90"], peers=2, run_dir=tmp_path, run_id="boot", bootstrap_port=free_port()
    )
    chaos = Chaos(swarm, SYNC, freeze_seconds=0, seed=2)
    (tmp_path / "peer1").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(tmp_path / "peer1")], check=True)
    try:
        try:
            swarm.start(stagger=1.0)
            wait_for_round(swarm, [0, 1], 1, timeout=180)
            chaos.kill_bootstrap(down_seconds=3)
            chaos.fill_disk(1, checkpoint_interval=10)
            codes = swarm.wait(timeout=400)
        finally:
            swarm.stop()
        assert codes == [0, 0], [(tmp_path / f"peer{i}.log").read_text()[-3000:] for i in range(2)]
        assert orphaned(swarm) == 0
        log = (tmp_path / "peer1.log").read_text()
        assert "could not write checkpoint" in log and "training goes on" in log
        assert read_state(find_checkpoint(tmp_path / "peer1"))["step"] == 90
        assert [f.kind for f in chaos.faults] == ["bootstrap-kill", "disk-full"]
        after = [r for r in read_metrics(tmp_path / "peer0") if "sync_round" in r and r["time"] > chaos.faults[-1].end]
        assert any(r["shared_ok"] and r["shared_members"] == 2 for r in after)  # both still average together
    finally:
        subprocess.run(["umount", str(tmp_path / "peer1")], check=False)


def test_analyse_names_the_experts_and_peers_whose_versions_differ(tmp_path: Path) -> None:
    """Pure: two clean members of one shared group that hold different versions of expert 3 fail the
    check, and the failure says which expert and which peers; the round before, with equal versions, passes."""

    def row(rnd: int, digests: dict[str, str]) -> dict:
        return {
            "time": 100.0 + rnd,
            "step": 10 * rnd,
            "sync_round": rnd,
            "shared_ok": True,
            "groups_failed": [],
            "refresh_missed": [],
            "shared_group": "g",
            "shared_digest": "s",
            "expert_digests": digests,
        }

    same = {"1": "a", "3": "b"}
    for i, third in enumerate(("b", "c")):
        (tmp_path / f"peer{i}").mkdir()
        lines = [row(1, same), row(2, {"1": "a", "3": third})]
        (tmp_path / f"peer{i}" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    report = analyse(tmp_path, 2, [], deadline=10.0)
    assert report.consistency_checks == 4
    assert report.consistency_failures == [
        "round 2: clean members of group g (peers [0, 1]) hold different versions of experts ['3']"
    ]
