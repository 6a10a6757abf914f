"""Chaos's fault scheduling on plain processes (no swarm): a background freeze returns at once, stops the
process until it thaws, and a frozen peer is never picked for another fault."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.lab.chaos import Chaos


@dataclass
class Sleepers:
    """The part of a LocalSwarm that Chaos touches: processes that lead their own process groups."""

    run_dir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)


def state(proc: subprocess.Popen) -> str:
    """The process's scheduler state letter (T: stopped)."""
    return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_background_freeze_returns_at_once_and_thaws_on_its_own(tmp_path):
    swarm = Sleepers(tmp_path, [subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(3)])
    try:
        chaos = Chaos(swarm, sync_steps=10, freeze_seconds=1.5, seed=0, background_freezes=True)
        start = time.monotonic()
        fault = chaos.freeze(1, wait=False)
        assert time.monotonic() - start < 1.0, "the scheduler must not wait the freeze out"
        assert fault.kind == "freeze" and fault.end - fault.start == 1.5
        seen = state(swarm.procs[1])
        for _ in range(50):  # the signal lands within a few ms, later on a loaded machine
            if seen == "T":
                break
            time.sleep(0.01)
            seen = state(swarm.procs[1])
        assert seen == "T" and chaos.frozen == {1}
        picked: list[int] = []  # the other faults only record their victim from here on
        chaos.kill = lambda i, in_sync=False: picked.append(i)
        chaos.freeze = lambda i, seconds=None, wait=True: picked.append(i)
        for _ in range(30):
            chaos.random_fault()
        assert picked and 1 not in picked, "a frozen peer was picked for another fault"
        chaos.thaw_all(timeout=10)
        assert chaos.frozen == set() and state(swarm.procs[1]) in "SR"
    finally:
        for p in swarm.procs:
            p.kill()
            p.wait()
