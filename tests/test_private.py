"""Private runs: an outsider can neither write the run's records, nor join its groups, nor read its
weights; with an allow-list, a peer that is not on it is refused even with valid signatures."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from helpers import SMALL
from hivemind.utils import get_dht_time

from dht.auth import RunAuth, load_auth
from dht.identity import load_identity
from dht.keys import peers_key
from dht.node import start_dht
from dht.records import signed_values
from p2p_spes.averaging.transport import TransportError
from p2p_spes.config import load_config
from p2p_spes.errors import ConfigError
from p2p_spes.local_swarm import LocalSwarm
from p2p_spes.swarm import Swarm

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
SECRET = b"correct horse battery staple 42"


def status(peer_id: str, step: int) -> dict:
    return {"peer_id": peer_id, "experts": [0], "step": step, "round": 0, "fingerprint": "f" * 16, "maddrs": []}


def wait_for(dht, key, wanted: set[str], seconds: float = 20.0) -> set[str]:
    """The peer ids with a valid record under ``key``, once ``wanted`` are there (bounded)."""
    deadline = time.monotonic() + seconds
    while True:
        found = set(signed_values(dht.get(key, latest=True, return_future=True).result(seconds)))
        if wanted <= found or time.monotonic() > deadline:
            return found
        time.sleep(0.3)


@pytest.mark.slow
def test_records_without_the_secret_are_refused():
    auth = RunAuth(SECRET)
    run = auth.keyspace("priv")
    assert run.startswith("priv-") and run != RunAuth(b"another secret of 16+ bytes").keyspace("priv")
    insider, me = start_dht(None, [run], auth=auth, host_maddrs=LOOPBACK)
    maddrs = [str(m) for m in insider.get_visible_maddrs()]
    reader, _ = start_dht(None, [run], auth=auth, initial_peers=maddrs, client_mode=True)
    # outsiders run the same software and sign correctly, but lack the secret (or have a wrong one);
    # client mode, so the only node that stores is the insider (any DHT node may drop records)
    outsider, stranger = start_dht(None, [run], initial_peers=maddrs, client_mode=True)
    guesser, guess = start_dht(
        None, [run], auth=RunAuth(b"a wrong secret of enough bytes"), initial_peers=maddrs, client_mode=True
    )
    try:
        key, expiry = peers_key(run), get_dht_time() + 60
        assert insider.store(key, status(me.peer_id, 1), expiry, subkey=me.owner)
        assert not outsider.store(key, status(stranger.peer_id, 2), expiry, subkey=stranger.owner)
        assert not guesser.store(key, status(guess.peer_id, 3), expiry, subkey=guess.owner)
        assert wait_for(reader, key, {me.peer_id}) == {me.peer_id}
    finally:
        for dht in (guesser, outsider, reader, insider):
            dht.shutdown()


@pytest.mark.slow
def test_records_of_peers_off_the_allow_list_are_refused_even_when_signed(tmp_path):
    me = load_identity(tmp_path / "me.key")
    auth = RunAuth(None, frozenset({me.peer_id}))
    insider, _ = start_dht(str(tmp_path / "me.key"), ["allow"], auth=auth, host_maddrs=LOOPBACK)
    maddrs = [str(m) for m in insider.get_visible_maddrs()]
    # the stranger is a full DHT node: it keeps its own record, which readers must still refuse
    outsider, stranger = start_dht(None, ["allow"], initial_peers=maddrs, host_maddrs=LOOPBACK)
    reader, _ = start_dht(None, ["allow"], auth=auth, initial_peers=maddrs, client_mode=True)
    try:
        key, expiry = peers_key("allow"), get_dht_time() + 60
        assert insider.store(key, status(me.peer_id, 1), expiry, subkey=me.owner)
        outsider.store(key, status(stranger.peer_id, 2), expiry, subkey=stranger.owner)
        assert wait_for(reader, key, {me.peer_id}) == {me.peer_id}
        assert auth.admits(me.peer_id) and not auth.admits(stranger.peer_id)
    finally:
        for dht in (reader, outsider, insider):
            dht.shutdown()


def test_secret_is_read_from_a_file_and_checked(tmp_path, monkeypatch):
    monkeypatch.delenv("P2P_SPES_SECRET", raising=False)
    with pytest.raises(ConfigError, match="no such file"):
        load_auth(str(tmp_path / "missing"), [])
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(ConfigError, match="shorter than 16 bytes"):
        load_auth(str(tmp_path / "short"), [])
    (tmp_path / "ok").write_text(SECRET.decode() + "\n")
    assert load_auth(str(tmp_path / "ok"), []).secret == SECRET
    monkeypatch.setenv("P2P_SPES_SECRET", SECRET.decode())
    assert load_auth(None, []).private and not load_auth(None, []).allowed


# the shared small swarm run with 4 experts and shorter deadlines (later overrides win)
PRIVATE = SMALL + [
    "moe.num_experts=4",
    "train.eval_interval=1000",
    "swarm.matchmaking_time=4",
    "swarm.averaging_timeout=8",
]


@pytest.mark.slow
@pytest.mark.long  # over a minute: out of the default suite (which stays near 15 minutes), in CI's long one
def test_outsider_gets_nothing_in_and_nothing_out_of_a_private_run(tmp_path):
    secret = tmp_path / "run.secret"
    secret.write_bytes(SECRET)
    swarm = LocalSwarm(
        None,
        PRIVATE + ["train.max_steps=40", f"swarm.secret_file={secret}"],
        peers=2,
        run_dir=tmp_path / "run",
        run_id="priv",
    )
    outsider = None
    try:
        swarm.start(stagger=1.0)
        maddrs = swarm.wait_for_maddrs(0)
        # an outsider with the same model and run id, without the secret, trains "with" the run
        cmd = [
            sys.executable,
            "-m",
            "p2p_spes",
            "train",
            "--no-progress",
            "--run-dir",
            str(tmp_path / "outsider"),
            "--run-id",
            "priv",
            "--initial-peers",
            *maddrs,
            "--set",
            "swarm.host_maddrs=[/ip4/127.0.0.1/tcp/0]",
            "--set",
            "train.max_steps=40",
        ]
        for item in PRIVATE:
            cmd += ["--set", item]
        outsider = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        # and one that knows the secret-derived name but not the secret asks a member for its weights
        cfg = load_config(None, PRIVATE + ["swarm.host_maddrs=[/ip4/127.0.0.1/tcp/0]"])
        cfg.swarm.initial_peers = maddrs
        cfg.swarm.run_id = "priv"
        thief = Swarm(cfg)
        thief.runtime.run_id = RunAuth(SECRET).keyspace("priv")
        member = json.loads((tmp_path / "run" / "peer0" / "peer.json").read_text())["peer_id"]
        with pytest.raises(TransportError, match="not authorized"):
            thief.download(member, "shared", [torch.empty(1)], attempts=1)
        thief.shutdown()
        codes = swarm.wait(timeout=300)
        out, _ = outsider.communicate(timeout=300)
    finally:
        swarm.stop()
        if outsider is not None and outsider.poll() is None:
            outsider.kill()
    assert codes == [0, 0], [(tmp_path / "run" / f"peer{i}.log").read_text()[-2000:] for i in range(2)]
    assert outsider.returncode == 0, out[-2000:]
    outsider_peer = json.loads((tmp_path / "outsider" / "peer.json").read_text())["peer_id"]
    members = [json.loads((tmp_path / "run" / f"peer{i}" / "peer.json").read_text())["peer_id"] for i in range(2)]
    for i in range(2):
        rounds = [
            json.loads(line)
            for line in (tmp_path / "run" / f"peer{i}" / "metrics.jsonl").read_text().splitlines()
            if '"sync_round"' in line
        ]
        assert rounds and max(r["shared_members"] for r in rounds) == 2, "only the two members ever average"
    summary = json.loads((tmp_path / "outsider" / "summary.json").read_text())
    # nothing of the run: the one answer it may get is to its dial-back (dht/reachability.py), which any peer
    # gives anyone (a bootstrap may not hold the secret) and which names no run, only which of its ports opened
    received = {p: t["received"] for p, t in summary["traffic"].items() if t["received"]}
    assert set(received) <= {"other"} and received.get("other", 0) < 200, received
    assert summary["bytes_received"] == sum(received.values()), "the outsider received nothing else from the members"
    assert outsider_peer not in members
