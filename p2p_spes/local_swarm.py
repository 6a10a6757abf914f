"""``p2p-spes swarm``: N peers on 127.0.0.1 as separate processes, for a demo or a test.

Each peer runs ``p2p-spes train`` in its own process group, so stopping a peer stops its DHT and
p2pd children too. The first peer starts the run; the others join through its multiaddr. A
``place`` puts each peer elsewhere than loopback: a command prefix (a network namespace and a
cgroup of ``benchmarks/lab/netlab.py``'s lab) and the address it listens on, so the multiaddrs it prints
can be dialled by the others.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from p2p_spes.errors import SwarmError
from p2p_spes.metrics_log import MetricsTail, metrics_path
from p2p_spes.progress import ProgressView
from p2p_spes.run_summary import read_summary


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass(frozen=True)
class PeerPlace:
    """Where a peer runs: ``argv_prefix`` before its command (it must exec the command, keeping the
    process id) and the IPv4 address it listens on (any TCP port)."""

    argv_prefix: tuple[str, ...] = ()
    host: str = "127.0.0.1"

    @property
    def host_maddr(self) -> str:
        return f"/ip4/{self.host}/tcp/0"


def loopback(index: int) -> PeerPlace:
    """The default place of every peer: this machine's loopback, no prefix."""
    return PeerPlace()


class LocalSwarm:
    """Start, watch and stop peers (on loopback unless ``place`` says otherwise); every process is
    tracked by its own id."""

    def __init__(
        self,
        config: str | None,
        overrides: list[str],
        peers: int,
        run_dir: str | Path,
        run_id: str = "local",
        threads: int = 1,
        place: Callable[[int], PeerPlace] | None = None,
        tensorboard: str | Path | None = None,
        bootstrap_port: int | None = None,
        wandb_project: str | None = None,
    ) -> None:
        """``tensorboard``: a directory under which each peer writes TensorBoard scalars (``peerN``).
        ``wandb_project``: each peer logs to its own W&B run in that project (``train.wandb_project``).
        ``bootstrap_port``: start a ``p2p-spes bootstrap`` on that loopback port first, and have every
        peer join through it (as a real run does), instead of through the first peer."""
        if peers < 1:
            raise SwarmError("--peers must be at least 1")
        self.config, self.overrides, self.num_peers = config, list(overrides), peers
        self.run_dir = Path(run_dir)
        self.run_id, self.threads = run_id, threads
        self.place = place or loopback
        self.tensorboard = tensorboard
        self.wandb_project = wandb_project
        self.bootstrap_port = bootstrap_port
        self.bootstrap: subprocess.Popen | None = None
        self.procs: list[subprocess.Popen] = []
        self.retired: list[subprocess.Popen] = []  # earlier processes of restarted peers, stopped too

    def _command(self, index: int, initial_peers: list[str]) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "p2p_spes",
            "train",
            "--no-progress",
            "--run-dir",
            str(self.run_dir / f"peer{index}"),
        ]
        if self.config:
            cmd += ["--config", self.config]
        cmd += [
            "--set",
            f"peer.count={self.num_peers}",
            "--set",
            f"train.threads={self.threads}",
            "--set",
            f"swarm.host_maddrs=[{self.place(index).host_maddr}]",
            "--run-id",
            self.run_id,
        ]
        if self.tensorboard:
            cmd += ["--tensorboard", str(Path(self.tensorboard) / f"peer{index}")]
        if self.wandb_project:
            cmd += ["--wandb-project", self.wandb_project]
        for item in self.overrides:
            cmd += ["--set", item]
        cmd += ["--initial-peers", *initial_peers] if initial_peers else ["--swarm"]
        return cmd

    def start_peer(self, index: int, initial_peers: list[str], resume: bool = False) -> subprocess.Popen:
        """Start peer ``index``; with ``resume`` it restarts from its own run directory's checkpoint."""
        (self.run_dir / f"peer{index}").mkdir(parents=True, exist_ok=True)
        (self.run_dir / f"peer{index}" / "peer.json").unlink(missing_ok=True)  # its address changes on restart
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = [*self.place(index).argv_prefix, *self._command(index, initial_peers), *(["--resume"] if resume else [])]
        with open(self.run_dir / f"peer{index}.log", "a" if resume else "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if index < len(self.procs):
            self.retired.append(self.procs[index])
            self.procs[index] = proc
        else:
            self.procs.append(proc)
        return proc

    def wait_for_maddrs(self, index: int, timeout: float = 120.0) -> list[str]:
        path = self.run_dir / f"peer{index}" / "peer.json"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                return json.loads(path.read_text())["maddrs"]
            if self.procs[index].poll() is not None:
                raise SwarmError(f"peer {index} exited early:\n{_tail(self.run_dir / f'peer{index}.log')}")
            time.sleep(0.2)
        raise SwarmError(f"peer {index} did not come up within {timeout:.0f}s")

    def start_bootstrap(self, timeout: float = 60.0) -> list[str]:
        """Start (or start again) the run's bootstrap on ``bootstrap_port``, with the same identity each
        time so its multiaddr stays the one peers were given; returns that multiaddr."""
        out = self.run_dir / "bootstrap.json"
        if self.bootstrap is not None:
            self.retired.append(self.bootstrap)
        self.bootstrap = spawn_bootstrap(
            self.run_dir / "bootstrap.key",
            self.bootstrap_port,
            out,
            self.run_dir / "bootstrap.log",
            ["--run-id", self.run_id],
        )
        deadline = time.monotonic() + timeout
        while not out.exists():
            if self.bootstrap.poll() is not None or time.monotonic() > deadline:
                raise SwarmError(f"the bootstrap did not come up:\n{_tail(self.run_dir / 'bootstrap.log')}")
            time.sleep(0.2)
        return json.loads(out.read_text())["maddrs"]

    def start(self, stagger: float = 2.0) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.bootstrap_port is not None:
            maddrs = self.start_bootstrap()
            self.start_peer(0, maddrs)
        else:
            self.start_peer(0, [])
            maddrs = self.wait_for_maddrs(0)
        for i in range(1, self.num_peers):
            time.sleep(stagger)
            self.start_peer(i, maddrs)

    def wait(self, timeout: float | None = None) -> list[int | None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        for proc in self.procs:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.01)
            try:
                proc.wait(remaining)
            except subprocess.TimeoutExpired:
                break
        return [p.poll() for p in self.procs]

    def watch(self, view: ProgressView, timeout: float | None = None, interval: float = 1.0) -> list[int | None]:
        """Like :meth:`wait`, feeding ``view`` every ``interval`` seconds with what each peer appended to
        its ``metrics.jsonl`` and with the peers that exited (finished, died or failed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        tails: dict[int, MetricsTail] = {}
        reported: set[int] = set()
        while True:
            # one poll per peer and pass: the exit codes returned are the ones the view was told about
            codes = [p.poll() for p in self.procs]
            for i, code in enumerate(codes):
                name = f"peer{i}"
                view.add_peer(name)
                tail = tails.setdefault(i, MetricsTail(metrics_path(self.run_dir / name)))
                for record in tail.read():
                    view.update(name, record)
                if code is not None and i not in reported:
                    reported.add(i)
                    view.set_state(name, *_exit_state(code, self.run_dir / f"{name}.log"))
            view.refresh()
            if all(c is not None for c in codes) or (deadline is not None and time.monotonic() > deadline):
                view.refresh(force=True)
                return codes
            time.sleep(interval)

    def run(self, timeout: float | None = None, stagger: float = 2.0) -> list[int]:
        """Start every peer, wait for all of them to exit, and stop whatever is left, always.

        Returns the exit codes (all 0); raises :class:`SwarmError` naming the peers that failed or
        overran ``timeout`` and their logs, with the tail of the first failed peer's log.
        """
        try:
            self.start(stagger=stagger)
            codes = self.wait(timeout)
        finally:
            self.stop()
        failed = [i for i, code in enumerate(codes) if code != 0]
        if failed:
            logs = ", ".join(str(self.run_dir / f"peer{i}.log") for i in failed)
            raise SwarmError(
                f"peer(s) {failed} of {self.run_dir} failed (exit codes {codes}; None: still running after "
                f"{timeout} s, then stopped); logs: {logs}\nlast lines of peer {failed[0]}:\n"
                f"{_tail(self.run_dir / f'peer{failed[0]}.log')}"
            )
        return codes

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM every peer (they checkpoint and announce leaving) and the bootstrap, then SIGKILL their groups."""
        running = self.procs + ([self.bootstrap] if self.bootstrap else [])
        for proc in running:
            if proc.poll() is None:
                signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in running:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.all_processes:
            signal_group(proc, signal.SIGKILL)
            if proc.poll() is None:
                proc.wait(5)

    @property
    def all_processes(self) -> list[subprocess.Popen]:
        """Every process this swarm started: its peers, their earlier incarnations and the bootstrap."""
        return self.procs + self.retired + ([self.bootstrap] if self.bootstrap else [])

    def summaries(self) -> list[dict[str, Any]]:
        out = []
        for i in range(len(self.procs)):
            out.append(read_summary(self.run_dir / f"peer{i}"))
        return out

    def print_summary(self, console: Console | None = None) -> None:
        table = Table(title=f"local swarm: {len(self.procs)} peers, run dir {self.run_dir}")
        for col in (
            "peer",
            "exit",
            "experts",
            "steps from + computed / skipped / jumped",
            "train loss",
            "val loss",
            "rounds averaged / adopted / alone / failed",
            "tokens averaged",
            "sent MB",
            "recv MB",
        ):
            table.add_column(col, justify="left" if col in ("peer", "experts") else "right")
        for i, (proc, s) in enumerate(zip(self.procs, self.summaries())):
            averaged = s.get("tokens_averaged")
            table.add_row(
                str(i),
                str(proc.poll()),
                str(s.get("local_experts", "-")),
                _steps(s),
                _fmt(s.get("final_train_loss")),
                _fmt(s.get("final_val_loss")),
                _rounds(s),
                "-" if averaged is None or not s.get("tokens") else f"{averaged / s['tokens']:.0%}",
                _fmt(s.get("bytes_sent", 0) / 1e6 if s else None),
                _fmt(s.get("bytes_received", 0) / 1e6 if s else None),
            )
        (console or Console(width=150)).print(table)


def _steps(summary: dict[str, Any]) -> str:
    steps = summary.get("steps")
    if not steps:  # not a swarm peer, or no summary yet
        return str(summary.get("steps_computed", summary.get("step", "-")))
    return f"{steps.get('started_at', 0)} + {steps['computed']} / {steps['skipped']} / {steps['jumped']}"


def _rounds(summary: dict[str, Any]) -> str:
    rounds = summary.get("rounds")
    if not rounds:
        return "-"
    return f"{rounds['averaged']} / {rounds['adopted']} / {rounds['alone']} / {rounds['failed']}"


def spawn_bootstrap(
    identity: Path, port: int, maddrs_file: Path, log: Path, extra: list[str] | None = None
) -> subprocess.Popen:
    """``p2p-spes bootstrap`` on ``127.0.0.1:port`` in a session of its own, appending to ``log``; it writes
    its multiaddrs to ``maddrs_file`` (removed first, so that the file's appearance says it is up)."""
    maddrs_file.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "p2p_spes",
        "bootstrap",
        "--identity",
        str(identity),
        "--host-maddrs",
        f"/ip4/127.0.0.1/tcp/{port}",
        "--write-maddrs",
        str(maddrs_file),
        *(extra or []),
    ]
    with open(log, "a") as f:
        return subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1")
        )


def _exit_state(code: int, log: Path) -> tuple[str, str]:
    """What an exit code says about a peer, for the progress view."""
    if code == 0:
        return "finished", ""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return "died", f"killed by {name}; its log: {log}"
    return "failed", f"exit code {code}; its log: {log}"


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the process group ``proc`` leads (each peer has its own); nothing if it is gone."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
