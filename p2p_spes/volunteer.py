"""``p2p-spes volunteer``: give a machine to a run with nothing but one of its multiaddrs.

A volunteer is a stranger's machine left unattended, so this command does what an operator would: it
checks the machine first (a missing GPU or a full disk is said before anything is downloaded), fetches
the run's config (signature and hash checked) with a batch size that fits the device, then keeps a peer
training. The peer runs as a child process in its own session: a crash restarts it from its newest
checkpoint with exponential back-off (bounded), a peer that refuses to start (exit code 2: wrong model,
bad config) is not restarted because restarting cannot help, and Ctrl-C or SIGTERM is passed to the peer
once, which checkpoints and tells the others it is leaving. The run's data is fetched by the peer itself
once its partition is known (``run_data.prepare_data``).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REFUSED = 2  # a peer's exit code for bad input: the reason is in its log, and a restart would repeat it
LOW_DISK_BYTES = 10 * 2**30  # below this the data cache and checkpoints of a real run may not fit


def say(text: str, *, err: bool = False) -> None:
    """One line of the volunteer's own output, timestamped like its peer's log."""
    print(f"[volunteer {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr if err else sys.stdout, flush=True)


@dataclass(frozen=True)
class Machine:
    """What the checks found: the device to train on and what was said about it."""

    device: str
    lines: tuple[str, ...]
    warnings: tuple[str, ...]


def check_machine(device: str, directory: Path) -> Machine:
    """Python, the GPUs and their free memory, the GPU extra and the disk under ``directory``."""
    import importlib.util

    import torch

    lines = [f"Python: {sys.version.split()[0]}, torch {torch.__version__}"]
    warnings = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(index)
            name = torch.cuda.get_device_name(index)
            lines.append(f"GPU {index}: {name}, {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
        if importlib.util.find_spec("megablocks") is None:
            warnings.append(
                "MegaBlocks is not installed: the experts run on the portable path, which is slower on a GPU. "
                "pip install 'p2p-spes[gpu]'"
            )
    else:
        warnings.append("no NVIDIA GPU found; training on the CPU. That works but is slow: fine to try the run out.")
        if device == "auto":
            device = "cpu"
    free_disk = shutil.disk_usage(directory).free
    lines.append(f"disk: {free_disk / 2**30:.1f} GiB free under {directory}")
    if free_disk < LOW_DISK_BYTES:
        warnings.append(
            f"only {free_disk / 2**30:.1f} GiB free under {directory}: the run's data and checkpoints may not fit "
            "(--dir elsewhere, or data.cache_gb to bound the data cache)"
        )
    return Machine(device, tuple(lines), tuple(warnings))


@dataclass(frozen=True)
class Restarts:
    """How a crashed peer is restarted: back-off from ``first_delay`` doubling up to ``max_delay``, at most
    ``limit`` times in a row; a peer that ran ``steady_after`` seconds before crashing starts a new row."""

    limit: int = 5
    first_delay: float = 5.0
    max_delay: float = 300.0
    steady_after: float = 600.0


@dataclass(frozen=True)
class Outcome:
    """How supervision ended: the exit code to return and the peer starts it took."""

    code: int
    starts: int


class Supervisor:
    """Keeps one peer process running: restarts after crashes, passes a stop on once and waits for it.

    ``command(start)`` is the peer's command line for its ``start``-th start (0 first); its output is
    appended to ``log_path``.
    """

    def __init__(
        self,
        command: Callable[[int], Sequence[str]],
        log_path: Path,
        restarts: Restarts,
        pid_path: Path | None = None,
    ) -> None:
        self.command, self.log_path, self.restarts, self.pid_path = command, log_path, restarts, pid_path
        self.stopping = threading.Event()
        self.child: subprocess.Popen | None = None

    def stop(self, *_: object) -> None:
        """Ask the peer to leave (once): it checkpoints and tells the others; a back-off wait ends."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        child = self.child
        if child is not None and child.poll() is None:
            say("stopping: the peer saves a checkpoint and tells the others it is leaving")
            child.send_signal(signal.SIGTERM)

    def run(self) -> Outcome:
        """Until the peer finishes, is stopped, refuses to start or crashes too often in a row."""
        attempt, delay, starts = 0, self.restarts.first_delay, 0
        while True:
            say(f"joining the run and training (log: {self.log_path})")
            started = time.monotonic()
            code = self._run_once(starts)
            starts += 1
            if self.stopping.is_set():
                say(f"left the run (peer exit code {code}); checkpoints and metrics are in its run directory")
                return Outcome(0, starts)
            if code == 0:
                say("the run reached its step budget: done. Thank you!")
                return Outcome(0, starts)
            if code == REFUSED:
                self._show_tail(5)
                say(
                    "error: the peer refused to start (exit code 2; the reason is above): restarting would not help",
                    err=True,
                )
                return Outcome(REFUSED, starts)
            if time.monotonic() - started > self.restarts.steady_after:
                attempt, delay = 0, self.restarts.first_delay  # it had been running fine
            attempt += 1
            if attempt > self.restarts.limit:
                self._show_tail(20)
                say(
                    f"error: the peer crashed {self.restarts.limit} times in a row (last exit code {code}); giving up. "
                    f"The log is {self.log_path}",
                    err=True,
                )
                return Outcome(REFUSED, starts)
            say(
                f"the peer stopped with exit code {code}; restarting in {delay:g}s (attempt {attempt} of {self.restarts.limit})"
            )
            if self.stopping.wait(delay):
                say("stopped before restarting")
                return Outcome(0, starts)
            delay = min(delay * 2, self.restarts.max_delay)

    def _run_once(self, start: int) -> int:
        with open(self.log_path, "ab") as log:
            # its own session: a Ctrl-C in the terminal reaches the peer once, through us
            self.child = subprocess.Popen(
                list(self.command(start)), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        if self.pid_path is not None:
            self.pid_path.write_text(f"{self.child.pid}\n")
        if self.stopping.is_set():  # a stop that came while the peer was being started
            self.child.send_signal(signal.SIGTERM)
        try:
            return self.child.wait()
        finally:
            self.child = None
            if self.pid_path is not None:
                self.pid_path.unlink(missing_ok=True)

    def _show_tail(self, lines: int) -> None:
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return
        for line in tail:
            print(line, file=sys.stderr)


def handle_stop_signals(supervisor: Supervisor) -> None:
    """SIGINT and SIGTERM stop the supervised peer cleanly (the main thread's handlers)."""
    signal.signal(signal.SIGINT, supervisor.stop)
    signal.signal(signal.SIGTERM, supervisor.stop)
