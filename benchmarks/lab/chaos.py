"""Fault injection on a loopback swarm, and the checks that the run survived it.

A :class:`Chaos` drives a :class:`~p2p_spes.local_swarm.LocalSwarm`: it SIGKILLs peers (at random
moments or inside a sync round), freezes a peer's whole process group with SIGSTOP for longer than
the averaging deadline and then lets it go on, and restarts killed peers from their own checkpoints.
:func:`analyse` then reads every peer's ``metrics.jsonl`` and answers what a user needs to trust the
run: how many rounds completed or were discarded, how long a healthy peer ever stood still, whether
every group's members hold bit-identical results (so nobody applied a partial average), and whether
the loss kept falling. Used by ``tests/test_chaos.py`` (short) and ``benchmarks/chaos.py`` (long).
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from p2p_spes.local_swarm import LocalSwarm, signal_group
from p2p_spes.metrics_log import read_metrics


@dataclass
class Fault:
    """One injected fault: wall-clock start and end (``time.time()``), so metrics lines line up."""

    kind: str  # kill | kill-in-sync | freeze | restart
    peer: int
    start: float
    end: float
    note: str = ""


def group_alive(pid: int) -> bool:
    """Whether any process of the process group ``pid`` (a peer started with its own session) is alive."""
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def failed_checkpoints(log: Path) -> int:
    """Checkpoints a peer's log says it could not write."""
    return log.read_text(errors="replace").count("could not write checkpoint") if log.exists() else 0


class Chaos:
    """Inject faults into ``swarm``'s peers; every action is recorded in :attr:`faults`."""

    def __init__(
        self,
        swarm: LocalSwarm,
        sync_steps: int,
        freeze_seconds: float,
        seed: int = 0,
        min_live: int = 2,
        background_freezes: bool = False,
    ) -> None:
        """With ``background_freezes`` a random freeze returns at once and the peer thaws on its own
        (the next fault need not wait the freeze out, so faults keep their rate)."""
        self.swarm, self.sync_steps = swarm, sync_steps
        self.freeze_seconds, self.min_live = freeze_seconds, min_live
        self.background_freezes = background_freezes
        self.rng = random.Random(seed)
        self.faults: list[Fault] = []
        self.down: set[int] = set()
        self.frozen: set[int] = set()
        self._thaws: list[threading.Thread] = []

    def live(self) -> list[int]:
        return [i for i, p in enumerate(self.swarm.procs) if p.poll() is None and i not in self.down]

    def last_step(self, index: int) -> int:
        """The last training step peer ``index`` logged (-1 before its first)."""
        records = [r for r in read_metrics(self.swarm.run_dir / f"peer{index}") if "loss" in r]
        return records[-1]["step"] if records else -1

    def kill(self, index: int, in_sync: bool = False, timeout: float = 120.0) -> Fault:
        """SIGKILL the peer's main process only: its DHT and p2pd must die with it (no orphans).

        ``in_sync`` waits until the peer finished the last step before a round and then kills it a
        random moment into that round's averaging. It needs the peer to log every step
        (``train.log_interval=1``); when no such step shows within ``timeout`` the note says so.
        """
        proc = self.swarm.procs[index]
        note = ""
        if in_sync:
            deadline = time.monotonic() + timeout
            seen = False
            while time.monotonic() < deadline and proc.poll() is None:
                step = self.last_step(index)
                if step > 0 and step % self.sync_steps == self.sync_steps - 1:
                    seen = True
                    break
                time.sleep(0.02)
            time.sleep(self.rng.uniform(0.3, 2.0))
            note = f"after step {self.last_step(index)}" + (
                "" if seen else f" (no step before a round within {timeout:.0f} s)"
            )
        start = time.time()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
        self.down.add(index)
        fault = Fault("kill-in-sync" if in_sync else "kill", index, start, time.time(), note)
        self.faults.append(fault)
        return fault

    def freeze(self, index: int, seconds: float | None = None, wait: bool = True) -> Fault:
        """SIGSTOP the peer's whole process group (a machine that hangs), then SIGCONT it. Without
        ``wait`` it returns at once (the fault's end is then the planned one) and a thread thaws the
        peer; :meth:`thaw_all` waits for those threads."""
        seconds = self.freeze_seconds if seconds is None else seconds
        proc = self.swarm.procs[index]
        start = time.time()
        self.frozen.add(index)
        os.killpg(proc.pid, signal.SIGSTOP)

        def thaw() -> None:
            try:
                time.sleep(seconds)
            finally:
                signal_group(proc, signal.SIGCONT)
                self.frozen.discard(index)

        fault = Fault("freeze", index, start, start + seconds, f"{seconds:.0f}s")
        if wait:
            thaw()
            fault.end = time.time()
        else:
            thread = threading.Thread(target=thaw, daemon=True)
            thread.start()
            self._thaws.append(thread)
        self.faults.append(fault)
        return fault

    def thaw_all(self, timeout: float | None = None) -> None:
        """Wait for every background freeze to end (each lets its peer go on)."""
        for thread in self._thaws:
            thread.join(timeout)

    def restart(self, index: int, timeout: float = 120.0) -> Fault:
        """Start a killed peer again from its own checkpoint, joining through up to three live peers that
        are not frozen (one address alone may die or freeze while the peer starts: its daemon then
        fails to start, as a user's would with one dead bootstrap address)."""
        start = time.time()
        sources = [
            i for i in self.live() if i not in self.frozen and (self.swarm.run_dir / f"peer{i}" / "peer.json").exists()
        ]
        if not sources:
            raise RuntimeError("no live peer to rejoin through")
        maddrs = [
            m for i in self.rng.sample(sources, min(3, len(sources))) for m in self.swarm.wait_for_maddrs(i, timeout)
        ]
        self.swarm.start_peer(index, maddrs, resume=True)
        self.down.discard(index)
        fault = Fault("restart", index, start, time.time())
        self.faults.append(fault)
        return fault

    def kill_bootstrap(self, down_seconds: float) -> Fault:
        """SIGKILL the run's bootstrap, leave it down ``down_seconds``, start it again (same identity and
        port, so the address peers were given works again)."""
        if self.swarm.bootstrap is None:
            raise RuntimeError("this swarm has no bootstrap (LocalSwarm(bootstrap_port=...))")
        start = time.time()
        signal_group(self.swarm.bootstrap, signal.SIGKILL)
        self.swarm.bootstrap.wait(30)
        time.sleep(down_seconds)
        self.swarm.start_bootstrap()
        fault = Fault("bootstrap-kill", -1, start, time.time(), f"down {down_seconds:.0f}s")
        self.faults.append(fault)
        return fault

    def fill_disk(self, index: int, checkpoint_interval: int, timeout: float = 300.0) -> Fault:
        """Fill the filesystem under peer ``index``'s run directory (it must be one of its own, e.g. a
        small tmpfs) until the peer has tried its next checkpoint, then free it again."""
        run_dir = self.swarm.run_dir / f"peer{index}"
        free = os.statvfs(run_dir).f_bavail * os.statvfs(run_dir).f_frsize
        if free > 1 << 30:
            raise RuntimeError(f"{run_dir} has {free >> 20} MB free: give it a filesystem of its own (a small tmpfs)")
        start, target = time.time(), (self.last_step(index) // checkpoint_interval + 1) * checkpoint_interval
        ballast = run_dir / "disk-full.ballast"
        log = self.swarm.run_dir / f"peer{index}.log"
        before = failed_checkpoints(log)
        with open(ballast, "wb", buffering=0) as f:  # unbuffered: nothing left to flush into a full disk
            try:
                while f.write(b"\0" * (1 << 20)):
                    pass
            except OSError:
                pass  # the disk is full
        # its metrics lines are dropped while the disk is full: its log (elsewhere) says when it tried
        deadline = time.monotonic() + timeout
        while (
            failed_checkpoints(log) <= before and time.monotonic() < deadline and self.swarm.procs[index].poll() is None
        ):
            time.sleep(0.5)
        time.sleep(1.0)
        ballast.unlink(missing_ok=True)
        tried = failed_checkpoints(log) > before
        fault = Fault(
            "disk-full", index, start, time.time(), f"{'through' if tried else 'no'} checkpoint attempt (step {target})"
        )
        self.faults.append(fault)
        return fault

    def random_fault(self, extra: dict[str, Callable[[int], Fault]] | None = None, freeze: bool = True) -> Fault | None:
        """One random fault: restart a downed peer, or kill / kill-in-sync / freeze (unless not ``freeze``)
        a live one, or one of ``extra`` (kind -> a function of a live peer's index)."""
        live = self.live()
        if self.down and (len(live) <= self.min_live or self.rng.random() < 0.5):
            return self.restart(self.rng.choice(sorted(self.down)))
        if len(live) <= self.min_live:
            return None
        extra = extra or {}
        kind = self.rng.choice(["kill", "kill-in-sync", *(["freeze"] if freeze else []), *extra])
        awake = [i for i in live if i not in self.frozen]
        if not awake:
            return None
        victim = self.rng.choice(awake)
        if kind in extra:
            return extra[kind](victim)
        if kind == "freeze":
            return self.freeze(victim, wait=not self.background_freezes)
        return self.kill(victim, in_sync=kind == "kill-in-sync")

    def run(self, duration: float, interval: tuple[float, float]) -> list[Fault]:
        """Inject random faults every ``interval`` seconds (uniform) for ``duration`` seconds."""
        end = time.monotonic() + duration
        while time.monotonic() < end:
            time.sleep(min(self.rng.uniform(*interval), max(end - time.monotonic(), 0)))
            if time.monotonic() >= end or not self.live():
                break
            self.random_fault()
        return self.faults


@dataclass
class ChaosReport:
    faults: dict[str, int]
    rounds_completed: int
    rounds_discarded: int
    groups_failed: int
    longest_stall_s: float
    longest_stall_at: str
    stall_bound_s: float
    consistency_checks: int
    orphan_rounds: int
    consistency_failures: list[str] = field(default_factory=list)
    loss_first: dict[int, float] = field(default_factory=dict)
    loss_last: dict[int, float] = field(default_factory=dict)
    orphans: int | None = None  # set by the caller from :func:`orphaned` once the swarm is stopped

    @property
    def loss_fell(self) -> bool:
        return bool(self.loss_last) and all(self.loss_last[i] < self.loss_first[i] for i in self.loss_last)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "loss_fell": self.loss_fell}


def _covers(fault: Fault, t0: float, t1: float) -> bool:
    return fault.start <= t1 and fault.end >= t0


def analyse(run_dir: Path, num_peers: int, faults: list[Fault], deadline: float, window: int = 5) -> ChaosReport:
    """Read every peer's metrics and check the run against the faults it went through.

    * A stall is the gap between two consecutive metrics lines of a peer that no fault of that peer
      overlaps; its bound is the sync ``deadline`` (:func:`p2p_spes.swarm.sync_deadline`) plus one
      round (the median time between two rounds of a peer).
    * Peers whose shared group succeeded with the same members must hold the same shared digest,
      and peers whose whole round was clean (every group and every refresh succeeded, every member's
      digests arrived) with the same shared group must also hold the same expert digests, orphaned
      experts (no live holder) included: anything else means a partial average was applied or a copy diverged. Rounds in
      which some expert had no live holder are counted in ``orphan_rounds``.
    """
    per_peer = {i: read_metrics(run_dir / f"peer{i}") for i in range(num_peers)}
    completed = discarded = failed_groups = 0
    gaps, round_times = [], []
    by_group: dict[tuple[int, str], list[tuple[int, dict]]] = defaultdict(list)
    first, last = {}, {}
    orphan_rounds: set[int] = set()
    for i, records in per_peer.items():
        own = [f for f in faults if f.peer == i]
        for a, b in pairwise(records):
            if "time" in a and "time" in b and not any(_covers(f, a["time"], b["time"]) for f in own):
                gaps.append((round(b["time"] - a["time"], 2), f"peer {i} after step {a.get('step')}"))
        syncs = [r for r in records if "sync_round" in r]
        for a, b in pairwise(syncs):
            if b["sync_round"] == a["sync_round"] + 1 and not any(_covers(f, a["time"], b["time"]) for f in own):
                round_times.append(b["time"] - a["time"])
        for r in syncs:
            completed += bool(r["shared_ok"])
            discarded += not r["shared_ok"]
            failed_groups += len(r["groups_failed"])
            if r.get("orphaned"):
                orphan_rounds.add(r["sync_round"])
            if r["shared_ok"]:
                by_group[(r["sync_round"], r["shared_group"])].append((i, r))
        losses = [r["loss"] for r in records if "loss" in r]
        if len(losses) >= 4 * window:
            first[i] = statistics.fmean(losses[:window])
            last[i] = statistics.fmean(losses[-window:])

    checks, failures = 0, []
    for (round_no, gid), members in sorted(by_group.items()):
        if len(members) < 2:
            continue
        checks += 1
        if len({r["shared_digest"] for _, r in members}) != 1:
            failures.append(f"round {round_no}: members of shared group {gid} hold different shared parameters")
        clean = [
            (i, r) for i, r in members if not (r["groups_failed"] or r["refresh_missed"] or r.get("versions_missing"))
        ]
        if len(clean) >= 2:
            checks += 1
            if len({json.dumps(r["expert_digests"], sort_keys=True) for _, r in clean}) != 1:
                experts = sorted({e for _, r in clean for e in r["expert_digests"]}, key=int)
                differ = [e for e in experts if len({r["expert_digests"].get(e) for _, r in clean}) > 1]
                failures.append(
                    f"round {round_no}: clean members of group {gid} (peers {sorted(i for i, _ in clean)}) "
                    f"hold different versions of experts {differ}"
                )
    round_time = statistics.median(round_times) if round_times else 0.0
    kinds: dict[str, int] = defaultdict(int)
    for f in faults:
        kinds[f.kind] += 1
    return ChaosReport(
        faults=dict(kinds),
        rounds_completed=completed,
        rounds_discarded=discarded,
        groups_failed=failed_groups,
        longest_stall_s=max(gaps, default=(0.0, ""))[0],
        longest_stall_at=max(gaps, default=(0.0, ""))[1],
        stall_bound_s=round(deadline + round_time, 2),
        consistency_checks=checks,
        orphan_rounds=len(orphan_rounds),
        consistency_failures=failures,
        loss_first=first,
        loss_last=last,
    )


def orphaned(swarm: LocalSwarm, grace: float = 20.0) -> int:
    """Process groups of this swarm still alive after it was stopped (each peer had its own group)."""
    deadline = time.monotonic() + grace
    procs = swarm.all_processes
    while time.monotonic() < deadline and any(group_alive(p.pid) for p in procs):
        time.sleep(0.5)
    return sum(group_alive(p.pid) for p in procs)
