"""Weights & Biases logging (``p2p_spes/wandb_log.py``) with the real ``wandb`` package in offline mode.

Nothing goes to the network: W&B writes each run to a ``.wandb`` file (a LevelDB-style log of protobuf
``Record``s) under the test's directory, and the tests read those files back.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import P2P, SMALL

from p2p_spes.errors import ConfigError
from p2p_spes.metrics_log import read_metrics
from p2p_spes.wandb_log import RunViewLog, WandbLog, WandbTarget, dashboard_target, run_view, wandb_module

wandb = pytest.importorskip("wandb", reason="the wandb extra is not installed: pip install 'p2p-spes[wandb]'")
from wandb.proto import wandb_internal_pb2

BLOCK = 32768  # the .wandb log's block size: a record's 7-byte header never straddles two blocks


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """W&B offline, with everything it writes (runs, settings, caches) under the test's directory: $WANDB_DIR.

    W&B reads its environment once per process (``wandb.setup``), so each test tears that down around it."""
    root = tmp_path / "wandb-home"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(root / name.lower()))
        (root / name.lower()).mkdir(parents=True)
    wandb.teardown()
    yield root / "wandb_dir"
    wandb.teardown()


def read_records(path: Path) -> list[Any]:
    """The protobuf records of one ``.wandb`` file (header ``:W&B``, then chunks of <crc, length, type>)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pos, parts = [], 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # the block's tail is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def run_files(directory: Path) -> list[Path]:
    """The offline runs W&B wrote under ``directory`` (each in its ``wandb/offline-run-*``)."""
    return sorted(directory.glob("**/offline-run-*/run-*.wandb"))


def read_run(directory: Path) -> dict[str, Any]:
    """The one offline run under ``directory`` (see :func:`read_run_file`)."""
    files = run_files(directory)
    assert len(files) == 1, f"expected one offline run under {directory}, found {files}"
    return read_run_file(files[0])


def finished_records(path: Path, timeout: float = 30.0) -> list[Any]:
    """The records of a finished run's file: W&B's service may still be writing it when ``finish()`` returns."""
    deadline = time.monotonic() + timeout
    while True:
        records = read_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def read_run_file(path: Path) -> dict[str, Any]:
    """An offline run's name, group, project, job type, config, exit code and history rows (by ``_step``)."""
    run: dict[str, Any] = {"history": {}}
    for record in finished_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["name"], run["group"], run["project"] = (
                record.run.display_name,
                record.run.run_group,
                record.run.project,
            )
            run["job_type"] = record.run.job_type
            run["config"] = {u.key: json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            run["history"].setdefault(row["_step"], {}).update(row)
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


def test_a_peer_log_writes_each_records_numbers_at_its_step_and_reads_back(offline: Path, tmp_path: Path):
    target = WandbTarget(project="p2p-spes-test", name="peer0", group="run-a", dir=str(tmp_path / "w"))
    log = WandbLog(target, {"train": {"lr": 0.003}, "this_peer": {"peer_id": "QmPeer"}})
    log.write({"step": 1, "loss": 9.0, "lr": 1e-4, "skip_rate": [0.0], "time": 1.0})
    log.write({"step": 10, "loss": 7.5, "val_loss": 7.25, "time": 2.0})
    round_record = {
        "sync_round": 1,
        "step": 10,
        "sync_seconds": 1.5,
        "shared_ok": True,
        "bytes_sent": 1000,
        "bytes_received": 2000,
        "traffic": {"averaging": [600, 700], "serving": [400, 0]},
        "shared_digest": "ff",
    }
    log.write(round_record)
    log.write({"step": 5, "loss": 1.0})  # behind the last step: W&B would drop it, so it is not sent
    log.write({"step": 20, "loss": 6.0})
    log.close()

    run = read_run(tmp_path / "w")
    assert (run["name"], run["group"], run["project"]) == ("peer0", "run-a", "p2p-spes-test")
    assert run["config"]["train"] == {"lr": 0.003} and run["config"]["this_peer"] == {"peer_id": "QmPeer"}
    history = run["history"]
    assert sorted(history) == [1, 10, 20]
    assert {s: row.get("train/loss") for s, row in history.items()} == {1: 9.0, 10: 7.5, 20: 6.0}
    row = history[10]
    assert row["val/loss"] == 7.25 and row["sync/seconds"] == 1.5 and row["sync/shared_ok"] == 1.0
    assert row["sync/bytes_sent"] == 1000 and row["sync/traffic/averaging_received"] == 700
    assert "train/skip_rate" not in history[1] and run["exit_code"] == 0


def test_a_training_run_logs_its_config_and_losses(offline: Path, tmp_path: Path):
    from p2p_spes.config import load_config
    from p2p_spes.train import Trainer

    cfg = load_config(
        None,
        [
            *("model.d_model=64", "model.num_layers=2", "model.num_heads=4", "model.max_seq_len=32"),
            *("moe.num_experts=4", "moe.ffn_dim=64", "train.batch_size=4", "train.max_steps=4"),
            *("train.warmup_steps=1", "train.log_interval=1", "train.eval_interval=2", "train.eval_batches=1"),
            f"train.run_dir={tmp_path / 'run'}",
            "train.wandb_project=p2p-spes-test",
            "train.wandb_mode=offline",
            "swarm.run_id=alone",
        ],
    )
    Trainer(cfg).run(progress=False)
    run = read_run(offline)  # train.wandb_dir is empty: $WANDB_DIR
    assert (run["name"], run["group"]) == ("run", "alone")
    assert run["config"]["train"]["max_steps"] == 4 and run["config"]["this_peer"]["local_experts"] == [0, 1, 2, 3]
    logged = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    losses = {s: row["train/loss"] for s, row in run["history"].items() if "train/loss" in row}
    assert losses == {r["step"]: pytest.approx(r["loss"]) for r in logged}
    assert sorted(s for s, row in run["history"].items() if "val/loss" in row) == [2, 4]


def test_without_the_wandb_package_the_run_refuses_to_start(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'p2p-spes\[wandb\]'"):
        wandb_module()


def test_the_dashboard_logs_its_view_of_the_run(offline: Path, tmp_path: Path):
    from dht.dashboard import RunWatch

    peers = [
        {"peer_id": "QmAAAAAAAAAApeerA", "step": 20, "loss": 5.0, "tokens": 10, "tokens_per_s": 40.0, "experts": [0]},
        {"peer_id": "QmBBBBBBBBBBpeerB", "step": 10, "loss": 6.0, "tokens": 10, "tokens_per_s": 60.0, "experts": [1]},
    ]
    coverage = [
        {"expert": 0, "holders": 1, "peers": ["QmAAAAAAAAAApeerA"], "status": "ok"},
        {"expert": 1, "holders": 1, "peers": ["QmBBBBBBBBBBpeerB"], "status": "ok"},
        {"expert": 2, "holders": 0, "peers": [], "status": "missing"},
    ]
    round2 = {"round": 2, "step": 20, "participants": 2, "ok": 2, "alone": 0, "seconds": 3.5, "bytes_sent": 9}
    snapshot = {
        "peers": peers,
        "coverage": coverage,
        "rounds": [round2, {"round": 1, "step": 10, "participants": 1, "seconds": 1.0}],
        "run": {"peers": 2, "tokens_per_s": 100.0, "total_tokens": 20, "bytes_sent": 5, "bytes_received": 6},
    }
    view = run_view(snapshot)
    assert view["run/max_step"] == 20 and view["coverage/experts_missing"] == 1 and view["round/number"] == 2
    assert view["peer/AAApeerA/loss"] == 5.0

    target = dashboard_target("p2p-spes-test", "run-a")
    watch = RunWatch(["/ip4/127.0.0.1/tcp/1/p2p/QmX"], "run-a", wandb_log=RunViewLog(target))
    watch.take(snapshot, now=1.0)
    watch.take({**snapshot, "peers": [], "run": {**snapshot["run"], "peers": 0}}, now=2.0)  # an empty read: no row
    watch.take(snapshot, now=3.0)
    watch.stop()
    run = read_run(offline)
    assert (run["name"], run["group"], run["job_type"]) == ("dashboard-run-a", "run-a", "dashboard")
    assert sorted(run["history"]) == [1, 2]
    assert run["history"][1]["run/tokens_per_s"] == 100.0 and run["history"][2]["round/seconds"] == 3.5


def forward_only(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records W&B gets: none behind the step before it (a step a round's schedule jump overtook)."""
    out: list[dict[str, Any]] = []
    for record in records:
        if not out or record["step"] >= out[-1]["step"]:
            out.append(record)
    return out


@pytest.mark.slow  # a 2-peer swarm of 30 steps: about a minute on 2 cores
def test_a_swarm_logs_one_wandb_run_per_peer_with_losses_and_rounds(offline: Path, tmp_path: Path):
    from p2p_spes.config import load_config
    from p2p_spes.run_data import identify_data, prepare_data

    run_dir = tmp_path / "swarm"
    overrides = [*SMALL, "train.max_steps=30", "train.eval_interval=30", "train.wandb_mode=offline"]
    cfg = load_config(None, overrides)
    prepare_data(cfg, identify_data(cfg), 0, progress=False)  # the corpus tokenized before, so both peers train
    cmd = [*P2P, "swarm", "--run-dir", str(run_dir), "--run-id", "wandb-test", "--wandb-project", "p2p-spes-test"]
    cmd += ["--no-progress", "--no-plot", "--timeout", "240"]
    for item in overrides:
        cmd += ["--set", item]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    logs = [(run_dir / f"peer{i}.log").read_text()[-2000:] for i in range(2) if (run_dir / f"peer{i}.log").exists()]
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], logs)
    names, synced = set(), 0
    for i in range(2):
        peer_dir = run_dir / f"peer{i}"
        peer_id = json.loads((peer_dir / "peer.json").read_text())["peer_id"]
        # $WANDB_DIR is set, so each peer's run is found by its name among the runs there
        runs = [read_run_file(f) for f in run_files(offline)]
        (run,) = [r for r in runs if r["name"] == f"peer{i}-{peer_id[-8:]}"]
        names.add(run["name"])
        assert run["group"] == "wandb-test" and run["config"]["this_peer"]["peer_id"] == peer_id
        assert run["config"]["swarm"]["run_id"] == "wandb-test" and run["exit_code"] == 0
        metrics = forward_only(read_metrics(peer_dir))
        steps = {r["step"]: r["loss"] for r in metrics if "loss" in r}
        logged = {s: row["train/loss"] for s, row in run["history"].items() if "train/loss" in row}
        assert logged == {s: pytest.approx(loss) for s, loss in steps.items()}
        assert steps, f"peer{i} trained no step"
        rounds = [r for r in metrics if "sync_round" in r]
        synced += len(rounds)
        for r in rounds:
            row = run["history"][r["step"]]
            assert row["sync/bytes_sent"] == r["bytes_sent"] and row["sync/seconds"] == pytest.approx(r["sync_seconds"])
        last_val = [r for r in metrics if "val_loss" in r][-1]  # at the peer's last step (30, or where it stopped)
        assert run["history"][last_val["step"]]["val/loss"] == pytest.approx(last_val["val_loss"])
    assert len(names) == 2 and synced >= 3, "the peers should have synced at steps 10, 20 and 30"
