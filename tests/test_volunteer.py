"""``p2p-spes volunteer`` without a network: the supervisor's restarts and stops, the machine checks, and
``launch/volunteer.sh`` handing over to the installed command. test_join runs it against a live run."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from helpers import P2P, ROOT

from p2p_spes.cli_parser import build_parser
from p2p_spes.cli_train import volunteer_train_command
from p2p_spes.volunteer import REFUSED, Restarts, Supervisor, check_machine

FAST = Restarts(limit=2, first_delay=0.05, max_delay=0.1)


def exits_with(code: int, starts: Path) -> list[str]:
    """A peer that notes its start and exits with ``code``."""
    script = f"open({str(starts)!r}, 'a').write('start\\n'); raise SystemExit({code})"
    return [sys.executable, "-c", script]


def test_a_crashing_peer_is_restarted_with_backoff_then_given_up(tmp_path, capsys):
    starts = tmp_path / "starts"
    outcome = Supervisor(lambda n: exits_with(3, starts), tmp_path / "peer.log", FAST).run()
    out = capsys.readouterr()
    assert outcome.code == REFUSED and outcome.starts == 3 == len(starts.read_text().split())
    assert "restarting in 0.05s (attempt 1 of 2)" in out.out and "restarting in 0.1s (attempt 2 of 2)" in out.out
    assert "crashed 2 times in a row (last exit code 3); giving up" in out.err


def test_a_peer_that_refuses_to_start_is_not_restarted(tmp_path, capsys):
    starts = tmp_path / "starts"
    outcome = Supervisor(lambda n: exits_with(2, starts), tmp_path / "peer.log", FAST).run()
    out = capsys.readouterr()
    assert outcome.code == REFUSED and outcome.starts == 1
    assert "refused to start" in out.err and "restarting" not in out.out


def test_a_peer_that_finishes_ends_the_supervision(tmp_path, capsys):
    outcome = Supervisor(lambda n: exits_with(0, tmp_path / "starts"), tmp_path / "peer.log", FAST).run()
    assert outcome.code == 0 and outcome.starts == 1
    assert "reached its step budget" in capsys.readouterr().out


def test_the_restarted_peer_gets_its_own_command_and_a_crash_after_a_steady_run_starts_a_new_row(tmp_path):
    starts = tmp_path / "starts"
    seen = []

    def command(n: int) -> list[str]:
        seen.append(n)
        return exits_with(0 if n == 3 else 3, starts)

    steady = Restarts(limit=1, first_delay=0.01, max_delay=0.01, steady_after=0.0)  # every run counts as steady
    outcome = Supervisor(command, tmp_path / "peer.log", steady).run()
    assert outcome.code == 0 and seen == [0, 1, 2, 3]


def test_a_stop_reaches_the_peer_once_and_the_supervisor_leaves_cleanly(tmp_path, capsys):
    """The peer traps SIGTERM as a real one does (checkpoint, leave) and exits non-zero: still a clean leave."""
    marker = tmp_path / "got-term"
    peer = (
        "import signal, sys, time\n"
        f"def leave(*_): open({str(marker)!r}, 'a').write('term\\n'); sys.exit(1)\n"
        "signal.signal(signal.SIGTERM, leave)\n"
        "time.sleep(60)\n"
    )
    pid_path = tmp_path / "peer.pid"
    supervisor = Supervisor(lambda n: [sys.executable, "-c", peer], tmp_path / "peer.log", FAST, pid_path)
    result = []
    thread = threading.Thread(target=lambda: result.append(supervisor.run()))
    thread.start()
    deadline = time.monotonic() + 30
    while not pid_path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the peer's handler is installed
    supervisor.stop()
    supervisor.stop()  # a second Ctrl-C is not passed on again
    thread.join(30)
    assert not thread.is_alive()
    assert result[0].code == 0 and result[0].starts == 1
    assert marker.read_text() == "term\n"
    assert not pid_path.exists()
    assert "left the run (peer exit code 1)" in capsys.readouterr().out


def test_a_stop_during_the_backoff_ends_it_without_restarting(tmp_path):
    starts = tmp_path / "starts"
    slow = Restarts(limit=3, first_delay=30.0)
    supervisor = Supervisor(lambda n: exits_with(3, starts), tmp_path / "peer.log", slow)
    timer = threading.Timer(1.0, supervisor.stop)
    timer.start()
    begun = time.monotonic()
    outcome = supervisor.run()
    timer.cancel()
    assert outcome.code == 0 and outcome.starts == 1 and time.monotonic() - begun < 20


def test_the_machine_check_falls_back_to_the_cpu_and_reports_the_disk(tmp_path):
    machine = check_machine("auto", tmp_path)
    assert machine.device == "cpu"  # this machine has no GPU
    assert any("no NVIDIA GPU found" in w for w in machine.warnings)
    assert machine.lines[0].startswith("Python: ") and any(line.startswith("disk: ") for line in machine.lines)


def test_the_command_refuses_bad_input_before_anything_starts(tmp_path):
    bad = subprocess.run(
        [*P2P, "volunteer", "--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/QmX", "--max-restarts", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--max-restarts takes a whole number >= 0" in bad.stderr
    missing = subprocess.run([*P2P, "volunteer"], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "--initial-peers" in missing.stderr


def test_the_script_hands_over_to_the_installed_command(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    script = [str(ROOT / "launch" / "volunteer.sh"), "--no-install"]
    shown = subprocess.run(["bash", *script, "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert shown.returncode == 0 and "usage: p2p-spes volunteer" in shown.stdout
    old = subprocess.run(
        ["bash", *script], capture_output=True, text=True, timeout=120, env=dict(env, PYTHON="/nonexistent/python3")
    )
    assert old.returncode == 2 and "p2p-spes needs Python >= 3.10" in old.stderr


def test_an_unreachable_run_is_refused_with_a_message(tmp_path):
    """Nothing listens at the address: the config fetch fails in bounded time, named, without a traceback."""
    proc = subprocess.Popen(
        [
            *P2P,
            "volunteer",
            "--initial-peers",
            "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
            "--dir",
            str(tmp_path / "vol"),
            "--fetch-timeout",
            "5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 2, out
    assert "fetching the config of run 'p2p-spes'" in out and "error:" in out
    assert "Traceback" not in out


def test_the_supervised_peer_resumes_and_takes_the_forced_role_and_the_train_arguments(tmp_path):
    args = build_parser().parse_args(
        ["volunteer", "--initial-peers", "/ip4/1.2.3.4/tcp/1/p2p/QmA", "--run-id", "r", "--reachability", "private"]
        + ["--", "--announce-maddrs", "/ip4/5.6.7.8/tcp/1"]
    )
    train = volunteer_train_command(args, tmp_path, tmp_path / "run-config.yaml")
    assert train[1:4] == ["-m", "p2p_spes", "train"]
    joined = " ".join(train)
    assert (
        f"--config {tmp_path / 'run-config.yaml'}" in joined and "--initial-peers /ip4/1.2.3.4/tcp/1/p2p/QmA" in joined
    )
    assert f"--identity {tmp_path / 'peer.key'}" in joined and f"--run-dir {tmp_path / 'run'}" in joined
    assert "--reachability private" in joined and "--resume auto" in joined
    assert train[-2:] == ["--announce-maddrs", "/ip4/5.6.7.8/tcp/1"]
    parsed = build_parser().parse_args(train[3:])  # what the peer's own parser makes of it
    assert "swarm.reachability=private" in parsed.overrides and parsed.resume == "auto"
