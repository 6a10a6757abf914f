"""Several processes per peer (torchrun, gloo on CPU): averaged gradients, identical ranks, one peer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import SMALL, rounds

from p2p_spes.local_swarm import LocalSwarm

pytestmark = pytest.mark.slow  # torchrun process groups, a loopback swarm

ROOT = Path(__file__).resolve().parent.parent
NODE = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc-per-node",
    "2",
    "-m",
    "p2p_spes",
    "train",
    "--no-progress",
]


def start_node(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as f:
        return subprocess.Popen(
            NODE + args, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT
        )


def finish(proc: subprocess.Popen, log: Path, timeout: float) -> int:
    """Wait for a 2-process peer; kill its whole process group (torchrun and both ranks) if it overruns."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        raise AssertionError(f"the 2-process peer did not finish in {timeout:.0f}s\n{log.read_text()[-3000:]}")


def ranks(run_dir: Path) -> list[dict]:
    return [json.loads((run_dir / f"node-rank{r}.json").read_text()) for r in range(2)]


def settings(*extra: str) -> list[str]:
    out = []
    for item in SMALL + ["train.threads=1", "train.device=cpu", *extra]:
        out += ["--set", item]
    return out


def test_two_processes_average_gradients_and_stay_identical(tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "node.log"
    code = finish(
        start_node(["--run-dir", str(run_dir), *settings("train.max_steps=8", "train.checkpoint_interval=4")], log),
        log,
        300,
    )
    assert code == 0, (tmp_path / "node.log").read_text()[-3000:]
    zero, one = ranks(run_dir)
    # each rank read different windows: identical weights after 8 steps need averaged gradients
    assert zero["step"] == one["step"] == 8 and zero["digest"] == one["digest"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tokens"] == 8 * 4 * 32 * 2  # steps x batch x seq_len x ranks: the whole peer's tokens
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)), "only rank 0 logs"
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert saved == ["step_00000004", "step_00000008"]


@pytest.mark.long  # over a minute: out of the default suite (which stays near 15 minutes), in CI's long one
def test_only_rank_zero_joins_the_swarm_and_ranks_follow_its_rounds(tmp_path):
    """The 2-process peer starts the run, an ordinary peer joins it; they average every 10 steps."""
    run_dir, log = tmp_path / "node", tmp_path / "node.log"
    node = start_node(
        [
            "--run-dir",
            str(run_dir),
            "--run-id",
            "node",
            "--swarm",
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
            *settings("train.max_steps=120", "peer.count=2"),
        ],
        log,
    )
    swarm = LocalSwarm(None, SMALL + ["train.max_steps=120"], peers=2, run_dir=tmp_path / "swarm", run_id="node")
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "peer.json").exists():
            assert node.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        swarm.start_peer(1, json.loads((run_dir / "peer.json").read_text())["maddrs"])
        code = finish(node, log, 400)
        assert code == 0, log.read_text()[-3000:]
        assert swarm.wait(timeout=120) == [0]
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait(10)
        swarm.stop()
    zero, one = ranks(run_dir)
    assert zero["digest"] == one["digest"], "rank 1 must hold rank 0's weights after every round"
    assert zero["local_experts"] == one["local_experts"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_joined"] >= 2
    # the other peer's groups had two members, never three: rank 1 is not a peer
    other = rounds(tmp_path / "swarm" / "peer1")
    sizes = {r["groups"]["shared"]["members"] for r in other.values() if r["groups"]["shared"]["ok"]}
    assert 2 in sizes and max(sizes) == 2, sizes
