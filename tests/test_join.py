"""Joining and watching a run on loopback: bootstrap identity, volunteer script, inspector coverage."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from dht.inspector import collect, open_dht
from p2p_spes.local_swarm import LocalSwarm
from tests.test_swarm import SMALL, group_alive

ROOT = Path(__file__).resolve().parent.parent
P2P = [sys.executable, "-m", "p2p_spes"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.5)
    detail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"{what} did not happen within {timeout:.0f}s\n{detail}")


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
    """Signal ``proc`` by its id, wait, and SIGKILL its whole group if it did not exit."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
        return None
    return proc.returncode


def start_bootstrap(tmp_path: Path, port: int, name: str, extra: list[str] = ()) -> tuple[subprocess.Popen, Path]:
    out, log = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
    out.unlink(missing_ok=True)
    cmd = [*P2P, "bootstrap", "--identity", str(tmp_path / "boot.key"), "--host-maddrs",
           f"/ip4/127.0.0.1/tcp/{port}", "--write-maddrs", str(out), *extra]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wait_for(out.exists, 60, f"bootstrap {name} coming up", proc, log)
    return proc, out


def test_bootstrap_keeps_its_multiaddr_across_restarts_and_publishes_the_config(tmp_path):
    port = free_port()
    first, out = start_bootstrap(tmp_path, port, "first")
    try:
        before = json.loads(out.read_text())
    finally:
        rc = stop(first)
    assert rc == 0, (tmp_path / "first.log").read_text()[-2000:]
    assert "bootstrap stopped" in (tmp_path / "first.log").read_text()
    assert (tmp_path / "boot.key").exists()

    config = ["--config", "tiny", "--run-id", "pub", *[a for item in SMALL for a in ("--set", item)]]
    second, out = start_bootstrap(tmp_path, port, "second", config)
    try:
        after = json.loads(out.read_text())
        fetched = subprocess.run(
            [*P2P, "fetch-config", "--initial-peers", *after["maddrs"], "--run-id", "pub", "--fetch-timeout", "30",
             "--set", "train.batch_size=2"], capture_output=True, text=True, timeout=120, start_new_session=True,
        )
    finally:
        rc = stop(second)
    assert before["peer_id"] == after["peer_id"]
    assert before["maddrs"] == after["maddrs"] and after["maddrs"][0].endswith(f"/tcp/{port}/p2p/{after['peer_id']}")
    assert rc == 0
    assert fetched.returncode == 0, fetched.stderr[-2000:]
    assert "published by 1 peer(s)" in fetched.stderr
    import yaml

    got = yaml.safe_load(fetched.stdout)
    assert got["model"]["d_model"] == 64 and got["moe"]["num_experts"] == 6 and got["train"]["batch_size"] == 2


def test_volunteer_with_only_a_multiaddr_fetches_the_config_joins_and_trains(tmp_path):
    """The first peer publishes the run's config; the volunteer script needs nothing else."""
    swarm = LocalSwarm(None, SMALL + ["train.max_steps=60", "train.eval_interval=60"], peers=1,
                       run_dir=tmp_path / "swarm")
    volunteer = None
    try:
        swarm.start()
        maddrs = swarm.wait_for_maddrs(0)
        wait_for(lambda: (tmp_path / "swarm" / "peer0" / "metrics.jsonl").exists(), 120, "the first peer training")
        with open(tmp_path / "volunteer.out", "w") as f:
            volunteer = subprocess.Popen(
                ["bash", str(ROOT / "launch" / "volunteer.sh"), "--initial-peers", *maddrs, "--run-id", "local",
                 "--no-install", "--device", "cpu", "--dir", str(tmp_path / "vol"), "--max-restarts", "0",
                 "--", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--set", "train.threads=1"],
                stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                env=dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(ROOT)),
            )
        rc = volunteer.wait(300)
        codes = swarm.wait(120)
    finally:
        if volunteer is not None:
            stop(volunteer)
        swarm.stop()
    out = (tmp_path / "volunteer.out").read_text()
    log = (tmp_path / "vol" / "peer.log").read_text() if (tmp_path / "vol" / "peer.log").exists() else ""
    assert rc == 0, out + log[-3000:]
    assert "no NVIDIA GPU found" in out and "fetching the config of run 'local'" in out
    assert "batch " in out and "published by 1 peer(s)" in out and "reached its step budget" in out
    assert codes == [0]
    summary = json.loads((tmp_path / "vol" / "run" / "summary.json").read_text())
    first = json.loads((tmp_path / "swarm" / "peer0" / "summary.json").read_text())
    assert summary["step"] == 60 and summary["rounds_joined"] >= 1, summary
    assert summary["peer_id"] != first["peer_id"]
    assert sorted(summary["local_experts"] + first["local_experts"]) == list(range(6))
    assert "joined the run at round" in log


def test_inspector_lists_live_peers_and_coverage_changes_when_one_leaves(tmp_path):
    swarm = LocalSwarm(None, SMALL + ["train.max_steps=100000", "swarm.heartbeat=1"], peers=2,
                       run_dir=tmp_path, run_id="watch")
    dht = None
    try:
        swarm.start(stagger=1.0)
        maddrs = swarm.wait_for_maddrs(0)
        dht = open_dht(maddrs, "watch")

        def both_synced():
            snap = collect(dht, "watch")
            return snap if len(snap["peers"]) == 2 and snap["rounds"] else None

        snap = wait_for(both_synced, 180, "two peers and a sync round in the inspector")
        leaver = swarm.procs[1]
        stop(leaver, signal.SIGTERM, 60)
        after = wait_for(lambda: (s := collect(dht, "watch")) and len(s["peers"]) == 1 and s, 60, "the departure")
        assert not group_alive(leaver.pid)
    finally:
        if dht is not None:
            dht.shutdown()
        swarm.stop()
    experts = {p["peer_id"]: p["experts"] for p in snap["peers"]}
    assert sorted(e for ex in experts.values() for e in ex) == list(range(6))
    assert [c["status"] for c in snap["coverage"]] == ["ok"] * 6
    assert all(p["maddrs"] and p["device"] == "cpu" and p["version"] for p in snap["peers"])
    assert snap["run"]["config_hashes"] and len(snap["run"]["config_hashes"][0]["publishers"]) == 2
    assert snap["rounds"][0]["participants"] == 2
    gone = next(pid for pid in experts if pid != after["peers"][0]["peer_id"])
    status = {c["expert"]: c["status"] for c in after["coverage"]}
    assert {e for e, s in status.items() if s == "missing"} == set(experts[gone])
    assert {e for e, s in status.items() if s == "ok"} == set(after["peers"][0]["experts"])
    assert json.dumps(after)  # the --json output is this object
