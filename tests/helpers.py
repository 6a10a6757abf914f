"""What several test files share: the small configs, waiting and stopping processes, reading a peer's metrics.

Imported as ``from helpers import ...`` (pytest puts ``tests/`` on ``sys.path``, as it has no ``__init__.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

from hivemind.proto import averaging_pb2

from benchmarks.lab.chaos import group_alive
from dht.node import start_dht
from p2p_spes.averaging.allreduce import GroupAllReduce
from p2p_spes.averaging.reducer import PartServer
from p2p_spes.local_swarm import LocalSwarm, spawn_bootstrap
from p2p_spes.metrics_log import round_records

__all__ = [
    "P2P",
    "ROOT",
    "SMALL",
    "SMALL_MODEL",
    "assert_groups_applied_whole",
    "assert_identical_after_rounds",
    "free_port",
    "group_alive",
    "join_once",
    "last_step",
    "rounds",
    "start_bootstrap",
    "start_volunteer",
    "stop",
    "volunteer_output",
    "wait_for",
]

ROOT = Path(__file__).resolve().parent.parent
P2P = [sys.executable, "-m", "p2p_spes"]

# A model small enough for one-process unit tests (no data, no swarm): 8 experts top-2, vocab 97.
SMALL_MODEL = [
    "model.vocab_size=97",
    "model.d_model=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.max_seq_len=16",
    "moe.num_experts=8",
    "moe.top_k=2",
    "moe.ffn_dim=48",
]

# A loopback swarm run that trains in seconds per round on 2 shared cores: 6 experts, a round every 10 steps.
SMALL = [
    "model.d_model=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.max_seq_len=32",
    "moe.num_experts=6",
    "moe.ffn_dim=64",
    "train.batch_size=4",
    "train.warmup_steps=2",
    "train.eval_interval=30",
    "train.log_interval=5",
    "swarm.sync_steps=10",
    "swarm.matchmaking_time=8",
    "swarm.averaging_timeout=15",
]


# Processes ---------------------------------------------------------------------------------------
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
    log.unlink(missing_ok=True)
    proc = spawn_bootstrap(tmp_path / "boot.key", port, out, log, list(extra))
    wait_for(out.exists, 60, f"bootstrap {name} coming up", proc, log)
    return proc, out


# Runs a command with SIGINT back at its default. A suite started as a background job of a non-interactive
# shell inherits SIGINT ignored, and bash cannot trap a signal ignored on entry, so the volunteer script
# would never see the Ctrl-C the tests send it. (A preexec_fn would do it too, but is unsafe with threads.)
RESET_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])"
)
WITH_DEFAULT_SIGINT = [sys.executable, "-c", RESET_SIGINT]


def start_volunteer(tmp_path: Path, maddrs: list[str], run_id: str) -> subprocess.Popen:
    """launch/volunteer.sh on loopback, CPU, with the already-installed interpreter (no install step)."""
    with open(tmp_path / "volunteer.out", "w") as f:
        return subprocess.Popen(
            [
                *WITH_DEFAULT_SIGINT,
                "bash",
                str(ROOT / "launch" / "volunteer.sh"),
                "--initial-peers",
                *maddrs,
                "--run-id",
                run_id,
                "--no-install",
                "--device",
                "cpu",
                "--dir",
                str(tmp_path / "vol"),
                "--max-restarts",
                "0",
                "--",
                "--host-maddrs",
                "/ip4/127.0.0.1/tcp/0",
                "--set",
                "train.threads=1",
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1"),
        )


def volunteer_output(tmp_path: Path) -> str:
    log = tmp_path / "vol" / "peer.log"
    return (tmp_path / "volunteer.out").read_text() + (log.read_text()[-3000:] if log.exists() else "")


def join_once(run_dir: Path, maddrs: list[str], overrides: list[str]) -> subprocess.CompletedProcess:
    """A peer of run ``local`` with ``overrides`` started against ``maddrs`` and run to its end (or refusal)."""
    cmd = [
        *P2P,
        "train",
        "--no-progress",
        "--run-dir",
        str(run_dir),
        "--run-id",
        "local",
        "--initial-peers",
        *maddrs,
        "--set",
        "swarm.host_maddrs=[/ip4/127.0.0.1/tcp/0]",
    ]
    for item in overrides:
        cmd += ["--set", item]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, start_new_session=True)


def run_local_swarm(run_dir: Path, overrides: list[str], peers: int, timeout: float = 300) -> LocalSwarm:
    """A loopback swarm of ``peers`` started in ``run_dir`` and run to its end (stopped in any case), each
    peer having exited cleanly (else the end of each peer's log)."""
    swarm = LocalSwarm(None, overrides, peers=peers, run_dir=run_dir)
    try:
        swarm.start()
        codes = swarm.wait(timeout=timeout)
    finally:
        swarm.stop()
    assert codes == [0] * peers, [(run_dir / f"peer{i}.log").read_text()[-2000:] for i in range(peers)]
    return swarm


# A peer's metrics ----------------------------------------------------------------------------------
def rounds(run_dir: Path) -> dict[int, dict]:
    """The ``sync_round`` records of a peer's ``metrics.jsonl``, by round number."""
    return {record["sync_round"]: record for record in round_records(run_dir)}


def last_step(run_dir: Path) -> int:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1]).get("step", -1) if lines else -1


def assert_identical_after_rounds(dirs: list[Path], min_common: int) -> None:
    """Rounds in which every group and every refresh of every peer succeeded end bit-identical, and so
    does the last one.

    A group that failed (a peer was late or died) is discarded by design, and a frozen expert whose
    download failed keeps its previous version, so copies may differ after such a round; the next
    complete round brings them together again.
    """
    per_peer = [rounds(d) for d in dirs]
    common = sorted(set.intersection(*(set(r) for r in per_peer)))
    complete = [
        n
        for n in common
        if all(
            r[n]["shared_ok"]
            and r[n]["shared_members"] == len(dirs)
            and not r[n]["groups_failed"]
            and not r[n]["refresh_missed"]
            for r in per_peer
        )
    ]
    assert len(complete) >= min_common, (common, [{n: r[n]["shared_members"] for n in r} for r in per_peer])
    assert common[-1] in complete, "the last round should complete on every peer"
    for n in complete:
        digests = {r[n]["shared_digest"] for r in per_peer}
        assert len(digests) == 1, f"round {n}: shared parameters differ between peers"
        experts = {json.dumps(r[n]["expert_digests"], sort_keys=True) for r in per_peer}
        assert len(experts) == 1, f"round {n}: expert versions differ between peers"


def _held_digest(record: dict, group: str) -> str | None:
    """The digest of what a peer holds, after the round, of the values ``group`` averages."""
    if group == "shared":
        return record["shared_digest"]
    return record["expert_digests"].get(group.removeprefix("expert"))


def assert_groups_applied_whole(per_peer: dict[str, dict[int, dict]]) -> int:
    """No peer applied part of a group's result: checked on the ``sync_round`` records of the peers given
    (by name; peers that died are simply missing). Returns how many group results were compared.

    * The members of a group (same round, group and group id) all report the same size, and no more of
      them report it than that size.
    * Every member for which the group succeeded holds bit-identical values for it afterwards: the shared
      digest for the shared group, the expert's digest for an expert group (not in merge rounds, where the
      merge moves every expert after the averaging).
    * A peer whose shared group failed holds none of the values its round's successful shared groups
      ended with (a lone peer's included), unless it adopted one (then it holds exactly one of them): a
      failed group leaves the values as they were.
    """
    results: dict[tuple[int, str, str], dict[str, str | None]] = defaultdict(dict)
    sizes: dict[tuple[int, str, str], dict[str, int]] = defaultdict(dict)
    agreed = defaultdict(set)  # round -> what its successful shared groups (a lone peer's included) hold
    for peer, records in per_peer.items():
        for n, r in records.items():
            for group, g in r["groups"].items():
                assert "group_id" in g and "members" in g, (peer, n, group, g)
                if not g["ok"]:
                    assert g.get("error"), f"peer {peer} round {n}: failed group {group} gives no reason"
                    continue
                sizes[(n, group, g["group_id"])][peer] = g["members"]
                if group == "shared":
                    agreed[n].add(r["shared_digest"])
                if g["members"] > 1 and (group == "shared" or not r.get("merge_alpha")):
                    results[(n, group, g["group_id"])][peer] = _held_digest(r, group)
    for key, by_peer in sizes.items():
        assert len(set(by_peer.values())) == 1, f"round {key[0]} group {key[1]}: members disagree on its size {by_peer}"
        assert len(by_peer) <= next(iter(by_peer.values())), (
            f"round {key[0]} group {key[1]}: more members than its size"
        )
    for (n, group, gid), by_peer in results.items():
        assert None not in by_peer.values(), f"round {n}: a member of {group} does not hold it {by_peer}"
        assert len(set(by_peer.values())) == 1, (
            f"round {n}: members of {group} ({gid}) hold different results {by_peer}"
        )
    for peer, records in per_peer.items():
        for n, r in records.items():
            shared = r["groups"]["shared"]
            if shared["ok"] or shared.get("refused") or not agreed[n]:
                continue
            if r.get("adopted_shared_from"):
                assert r["shared_digest"] in agreed[n], f"peer {peer} round {n}: adopted a result nobody agreed on"
            else:
                assert r["shared_digest"] not in agreed[n], (
                    f"peer {peer} round {n}: its shared group failed, yet it holds the result others agreed on"
                )
    return len(results)


class Peers:
    """``n`` DHT peers and one event loop thread (as each trainer has), shared by a module's tests."""

    def __init__(self, n: int = 3) -> None:
        first, identity = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddrs = [str(m) for m in first.get_visible_maddrs()]
        others = [start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs) for _ in range(n - 1)]
        self.nodes = [first] + [dht for dht, _ in others]
        self.owners = [identity.owner] + [ident.owner for _, ident in others]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.p2ps = [self.call(node.replicate_p2p()) for node in self.nodes]

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def __len__(self) -> int:
        return len(self.nodes)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        for node in self.nodes:
            node.shutdown()


class Forgot(PartServer):
    """The handlers of a process that restarted and forgot the round: they refuse everyone at once."""

    async def contribute(self, stream, context):
        async for _ in stream:
            pass
        return averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)

    async def fetch(self, request, context):
        yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)


class Dies(GroupAllReduce):
    """A member that joins the group and is gone before the transfers: it sends nothing, and its
    handlers refuse everyone (as a restarted process that forgot the round would). It never retries."""

    handlers = Forgot

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.server = self.handlers(self.codec, self.aggregate, self.server.wait)

    async def run(self, round_no, group, tensor, weight, expected, **kwargs):
        self.retries = 0

        def gone():
            raise RuntimeError("this member died after joining")

        return await super().run(round_no, group, gone, weight, expected, **kwargs)
