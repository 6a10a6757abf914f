"""SPES placement in real loopback swarms: every peer gets its own block with no per-peer setting.

Peers of the 1B and 7B configs (shapes shrunk by ``--set`` so they run on a CPU) join without
``peer.index``: through ``p2p-spes swarm``, through ``launch/slurm.sh`` (run here under a stand-in
``srun`` that starts the per-node script once per fake node, all at the same moment, so their
claims race) and through the volunteer script's ``--config-from-swarm``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml
from helpers import ROOT, free_port, start_bootstrap, start_volunteer, volunteer_output, wait_for

from p2p_spes.config import load_config
from p2p_spes.local_swarm import LocalSwarm

pytestmark = pytest.mark.slow  # loopback swarms of several processes

# the big configs' model and schedule, shrunk to CPU size; placement, experts and peer.count stay theirs
SHRINK = {
    "model": {"vocab_size": 8192, "d_model": 64, "num_layers": 2, "num_heads": 4, "max_seq_len": 32},
    "moe": {"ffn_dim": 32, "impl": "torch"},
    "data": {"train": None, "validation": None, "tokenizer": None},
    "train": {
        "batch_size": 2,
        "grad_accum": 1,
        "max_steps": 60,
        "warmup_steps": 2,
        "eval_interval": 30,
        "eval_batches": 1,
        "checkpoint_interval": 30,
        "log_interval": 10,
        "threads": 1,
        "dtype": "fp32",
    },
    "swarm": {"sync_steps": 10, "matchmaking_time": 5.0, "averaging_timeout": 20.0, "merge_interval": 0},
}


def overrides(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += overrides(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={'null' if value is None else value}")
    return out


def assert_disjoint_blocks(held: list[list[int]], num_experts: int) -> None:
    per_peer = num_experts // len(held)
    assert all(len(h) == per_peer for h in held), held
    assert sorted(e for h in held for e in h) == list(range(num_experts)), f"blocks overlap or miss experts: {held}"
    assert all(h == list(range(h[0], h[0] + per_peer)) and h[0] % per_peer == 0 for h in held), (
        f"not SPES blocks: {held}"
    )


def test_four_peers_of_the_1b_config_train_four_disjoint_blocks(tmp_path):
    cfg = load_config("spes-1b")
    assert cfg.experts.placement == "spes" and cfg.peer.count == 4
    swarm = LocalSwarm("spes-1b", overrides(SHRINK), peers=4, run_dir=tmp_path)
    swarm.run(timeout=400, stagger=0.5)
    summaries = swarm.summaries()
    assert_disjoint_blocks([s["local_experts"] for s in summaries], cfg.moe.num_experts)
    assert sorted(s["data_partition"] for s in summaries) == [0, 1, 2, 3]
    assert all(s["experts_taken_over"] == 0 for s in summaries)


FAKE_SRUN = """#!/usr/bin/env bash
# stand-in for SLURM's srun on one machine: run the per-node command once per fake node, all at once
while [ "$1" != "bash" ]; do shift; done
pids=()
for i in $(seq 0 $((FAKE_NODES - 1))); do
  FAKE_HOST=node$i PORT=$((FAKE_PORT0 + i)) "$@" > "$FAKE_LOGS/node$i.log" 2>&1 &
  pids+=($!)
done
wait "${pids[@]}"
"""
FAKE_HOSTNAME = """#!/usr/bin/env bash
case "$1" in -s) echo "$FAKE_HOST" ;; -I) echo 127.0.0.1 ;; *) echo "$FAKE_HOST" ;; esac
"""


@pytest.mark.long  # over a minute: out of the default suite (which stays near 15 minutes), in CI's long one
def test_slurm_nodes_and_a_volunteer_of_the_7b_config_train_disjoint_blocks(tmp_path):
    base = yaml.safe_load((ROOT / "configs" / "spes-7b.yaml").read_text())
    for section, values in SHRINK.items():
        base.setdefault(section, {}).update(values)
    base["peer"].pop("index", None)
    config = tmp_path / "small-7b.yaml"
    config.write_text(yaml.safe_dump(base))
    cfg = load_config(config)
    assert cfg.experts.placement == "spes" and cfg.peer.count == 4 and cfg.moe.num_experts == 32

    run_id = "slurm7b"
    boot, out = start_bootstrap(tmp_path, free_port(), "boot", ["--run-id", run_id, "--config", str(config)])
    maddrs = json.loads(out.read_text())["maddrs"]
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("hostname", FAKE_HOSTNAME)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    logs = tmp_path / "nodes"
    logs.mkdir()
    env = dict(
        os.environ,
        PATH=f"{shims}:{os.environ['PATH']}",
        FAKE_NODES="3",
        FAKE_PORT0=str(free_port()),
        FAKE_LOGS=str(logs),
        VENV=sys.prefix,
        RUN_ROOT=str(tmp_path / "slurm"),
        P2P_HOST="127.0.0.1",
        PYTHONUNBUFFERED="1",
    )
    with open(tmp_path / "slurm.out", "w") as slurm_out:
        nodes = subprocess.Popen(
            [
                "bash",
                str(ROOT / "launch" / "slurm.sh"),
                "--initial-peers",
                *maddrs,
                "--run-id",
                run_id,
                "--",
                "--set",
                "train.threads=1",
            ],
            stdout=slurm_out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    volunteer = start_volunteer(tmp_path, maddrs, run_id)
    try:
        summaries = [tmp_path / "slurm" / f"node{i}" / "run" / "summary.json" for i in range(3)]
        summaries.append(tmp_path / "vol" / "run" / "summary.json")
        wait_for(lambda: all(p.exists() for p in summaries), 500, "every peer finishing", nodes, tmp_path / "slurm.out")
        assert nodes.wait(120) == 0, (tmp_path / "slurm.out").read_text()[-2000:]  # every node ended by itself
        assert volunteer.wait(120) == 0, volunteer_output(tmp_path)
    finally:
        for proc in (nodes, volunteer, boot):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    held = [json.loads(p.read_text())["local_experts"] for p in summaries]
    assert_disjoint_blocks(held, 32)
