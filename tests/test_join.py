"""Joining and watching a run on loopback: bootstrap identity, volunteer script, inspector coverage."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
from helpers import (
    P2P,
    SMALL,
    free_port,
    group_alive,
    start_bootstrap,
    start_volunteer,
    stop,
    volunteer_output,
    wait_for,
)

from dht.inspector import collect, open_dht
from p2p_spes.local_swarm import LocalSwarm


@pytest.mark.slow
def test_bootstrap_keeps_its_multiaddr_and_a_volunteer_trains_with_the_config_it_publishes(tmp_path):
    port = free_port()
    first, out = start_bootstrap(tmp_path, port, "first")
    try:
        before = json.loads(out.read_text())
    finally:
        rc = stop(first)
    assert rc == 0, (tmp_path / "first.log").read_text()[-2000:]
    assert "bootstrap stopped" in (tmp_path / "first.log").read_text()

    published = SMALL + ["train.max_steps=20", "train.eval_interval=20"]
    config = ["--config", "tiny", "--run-id", "pub", *[a for item in published for a in ("--set", item)]]
    second, out = start_bootstrap(tmp_path, port, "second", config)
    volunteer = None
    try:
        after = json.loads(out.read_text())
        assert before["peer_id"] == after["peer_id"], "the identity file must keep the peer id"
        assert before["maddrs"] == after["maddrs"], "same identity and port: same multiaddr"
        assert after["maddrs"][0] == f"/ip4/127.0.0.1/tcp/{port}/p2p/{after['peer_id']}"
        volunteer = start_volunteer(tmp_path, after["maddrs"], "pub")
        code = volunteer.wait(240)
        refused = subprocess.run(  # the run's config fixes the model: only local settings may be --set
            [
                *P2P,
                "train",
                "--config-from-swarm",
                "--run-id",
                "pub",
                "--initial-peers",
                *after["maddrs"],
                "--set",
                "model.num_layers=3",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            start_new_session=True,
        )
        other_model = subprocess.run(  # the bootstrap's published config alone is enough to refuse another model
            [
                *P2P,
                "train",
                "--config",
                "tiny",
                "--run-id",
                "pub",
                "--initial-peers",
                *after["maddrs"],
                "--host-maddrs",
                "/ip4/127.0.0.1/tcp/0",
                "--run-dir",
                str(tmp_path / "other"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            start_new_session=True,
        )
    finally:
        if volunteer is not None:
            stop(volunteer)
        rc = stop(second)
    assert rc == 0
    assert code == 0, volunteer_output(tmp_path)
    assert refused.returncode == 2 and "model.num_layers: the run's config fixes this setting" in refused.stderr
    assert other_model.returncode == 2 and "trains a different model" in other_model.stderr
    assert "model.d_model: ours 256, run's 64" in other_model.stderr and "--config-from-swarm" in other_model.stderr
    text = (tmp_path / "volunteer.out").read_text()
    assert "no NVIDIA GPU found" in text and "fetching the config of run 'pub'" in text
    assert "published by 1 peer(s)" in text and "batch 4 x 1" in text and "reached its step budget" in text
    assert "the run trains on the embedded corpus (no data.manifest)" in text
    summary = json.loads((tmp_path / "vol" / "run" / "summary.json").read_text())
    assert summary["step"] == 20 and summary["num_experts"] == 6
    fetched = (tmp_path / "vol" / "run-config.yaml").read_text()
    assert "d_model: 64" in fetched and "max_steps: 20" in fetched


@pytest.mark.slow
def test_volunteer_joins_a_live_run_the_inspector_sees_it_and_ctrl_c_leaves_cleanly(tmp_path):
    """Only a peer's multiaddr; the inspector's JSON lists both peers, then the coverage changes on leaving.

    ``max_experts_per_peer=3`` leaves the stayer no spare capacity, so it cannot heal the gap
    (test_healing covers that) and the departed peer's experts stay flagged.
    """
    overrides = SMALL + [
        "train.max_steps=100000",
        "swarm.heartbeat=1",
        "swarm.experts_per_peer=3",
        "swarm.max_experts_per_peer=3",
    ]
    swarm = LocalSwarm(None, overrides, peers=1, run_dir=tmp_path / "swarm", run_id="watch")
    dht = volunteer = None
    try:
        swarm.start()
        maddrs = swarm.wait_for_maddrs(0)
        volunteer = start_volunteer(tmp_path, maddrs, "watch")
        dht = open_dht(maddrs, "watch")

        def both_synced():
            snap = collect(dht, "watch")
            done = len(snap["peers"]) == 2 and any(r["participants"] == 2 for r in snap["rounds"])
            return snap if done and all(p["rounds_joined"] >= 1 for p in snap["peers"]) else None

        snap = wait_for(
            both_synced,
            240,
            "the volunteer in a sync round, seen by the inspector",
            volunteer,
            tmp_path / "vol" / "peer.log",
        )
        child = int((tmp_path / "vol" / "peer.pid").read_text())
        code = stop(volunteer, signal.SIGINT, 60)
        after = wait_for(lambda: (s := collect(dht, "watch")) and len(s["peers"]) == 1 and s, 30, "the departure")
        child_alive = group_alive(child)
    finally:
        if dht is not None:
            dht.shutdown()
        if volunteer is not None:
            stop(volunteer, signal.SIGKILL, 5)
        swarm.stop()
    assert code == 0, volunteer_output(tmp_path)
    assert not child_alive, "the peer must be gone when the script returns"
    assert "left the run" in (tmp_path / "volunteer.out").read_text()
    assert json.loads((tmp_path / "vol" / "run" / "summary.json").read_text())["rounds_joined"] >= 1

    experts = {p["peer_id"]: p["experts"] for p in snap["peers"]}
    assert sorted(e for ex in experts.values() for e in ex) == list(range(6))
    assert [c["status"] for c in snap["coverage"]] == ["ok"] * 6
    assert all(p["maddrs"] and p["device"] == "cpu" and p["version"] for p in snap["peers"])
    assert len(snap["run"]["config_hashes"]) == 1 and len(snap["run"]["config_hashes"][0]["publishers"]) == 2
    stayer = after["peers"][0]["peer_id"]
    gone = next(pid for pid in experts if pid != stayer)
    status = {c["expert"]: c["status"] for c in after["coverage"]}
    assert {e for e, s in status.items() if s == "missing"} == set(experts[gone])
    assert {e for e, s in status.items() if s == "ok"} == set(experts[stayer])
