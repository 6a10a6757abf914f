"""Live progress of a run: one view of every peer, refreshed about once a second, and a line per event.

The view is fed by the records peers write anyway (the lines of ``metrics.jsonl``: steps, sync rounds,
takeovers), so ``p2p-spes swarm`` watches its peers' files and ``p2p-spes train`` feeds its own records
in. On a terminal the table redraws in place (rich ``Live``) with the events printed above it; anywhere
else (CI, a log file) nothing is redrawn: events print as plain lines when they happen and every
peer's status prints as one plain line every ``plain_every`` seconds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table


@dataclass
class PeerProgress:
    """What the view knows of one peer, from its latest records."""

    name: str
    max_steps: int
    state: str = "starting"  # starting | training | finished | died | failed
    step: int = 0
    loss: float | None = None
    val_loss: float | None = None
    tokens_per_s: float | None = None
    round: int | None = None
    round_seconds: float | None = None
    round_outcome: str | None = None  # averaged | alone | adopted | failed
    members: int | None = None  # peers in its last shared group
    sent_mb: float = 0.0  # sync traffic so far
    received_mb: float = 0.0
    joined: bool = False  # has averaged with another peer at least once
    _pace: deque = field(default_factory=lambda: deque(maxlen=30), repr=False)  # (wall time, step)

    def eta_seconds(self) -> float | None:
        """Seconds to ``max_steps`` at the pace of its recent records; None until there are two."""
        if len(self._pace) < 2 or self.step >= self.max_steps:
            return 0.0 if self.step >= self.max_steps else None
        (t0, s0), (t1, s1) = self._pace[0], self._pace[-1]
        if t1 <= t0 or s1 <= s0:
            return None
        return (self.max_steps - self.step) * (t1 - t0) / (s1 - s0)

    def status_line(self) -> str:
        """The peer in one plain line (the non-terminal view)."""
        parts = [f"{self.name}: {self.state}, step {self.step}/{self.max_steps}", f"loss {_num(self.loss)}"]
        if self.val_loss is not None:
            parts.append(f"val {_num(self.val_loss)}")
        if self.round is not None:
            parts.append(f"round {self.round} {self.round_outcome} in {self.round_seconds:.1f} s")
            parts.append(f"sent {self.sent_mb:.1f} MB, received {self.received_mb:.1f} MB")
        if self.tokens_per_s:
            parts.append(f"{self.tokens_per_s:,.0f} tok/s")
        eta = self.eta_seconds()
        if eta is not None and self.state == "training":
            parts.append(f"ETA {_duration(eta)}")
        return ", ".join(parts)


class ProgressView:
    """The live view of a run's peers (see the module docstring). Use it as a context manager."""

    def __init__(
        self,
        names: Iterable[str],
        max_steps: int,
        console: Console | None = None,
        live: bool | None = None,
        plain_every: float = 10.0,
        title: str = "",
    ) -> None:
        self.console = console or Console()
        self.peers = {name: PeerProgress(name, max_steps) for name in names}
        self.max_steps, self.title = max_steps, title
        self.live = self.console.is_terminal if live is None else live
        self.plain_every = plain_every
        self.events: list[str] = []  # every event so far, in order
        self._live: Live | None = None
        self._drawn = 0.0
        self._printed = 0.0
        self._members: int | None = None  # members of the last shared group a peer averaged in

    def __enter__(self) -> ProgressView:  # noqa: PYI034 (Self needs Python 3.11)
        if self.live:
            self._live = Live(self.table(), console=self.console, refresh_per_second=1, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.update(self.table(), refresh=True)
            self._live.__exit__(*exc)
            self._live = None

    def add_peer(self, name: str) -> None:
        self.peers.setdefault(name, PeerProgress(name, self.max_steps))

    # Input -------------------------------------------------------------------------------
    def update(self, name: str, record: dict[str, Any], now: float | None = None) -> None:
        """Take one record of peer ``name`` (a ``metrics.jsonl`` line)."""
        p = self.peers.setdefault(name, PeerProgress(name, self.max_steps))
        now = time.time() if now is None else now
        if p.state == "starting":
            p.state = "training"
        if isinstance(record.get("step"), int):
            p.step = record["step"]
            p._pace.append((float(record.get("time", now)), p.step))
        if "sync_round" in record:
            self._round(p, record)
        elif "took_over" in record:
            self.event(f"{name} took over expert(s) {record['took_over']} (now trains {record.get('local_experts')})")
        elif "caught_up_round" in record:
            skipped = record.get("rounds_skipped") or []
            self.event(
                f"{name} fell behind the swarm: took its state of round {record['caught_up_round']} "
                f"(skipped {len(skipped)} round(s)) and goes on from step {record.get('step')}"
            )
        else:
            if isinstance(record.get("loss"), (int, float)):
                p.loss = float(record["loss"])
            if isinstance(record.get("val_loss"), (int, float)):
                p.val_loss = float(record["val_loss"])
            if isinstance(record.get("tokens_per_s"), (int, float)):
                p.tokens_per_s = float(record["tokens_per_s"])

    def _round(self, p: PeerProgress, r: dict[str, Any]) -> None:
        p.round, p.round_seconds = r["sync_round"], float(r.get("sync_seconds") or 0.0)
        p.round_outcome, p.members = r.get("outcome"), r.get("shared_members")
        p.sent_mb += (r.get("bytes_sent") or 0) / 1e6
        p.received_mb += (r.get("bytes_received") or 0) / 1e6  # every byte, downloads included
        if p.round_outcome == "averaged" and not p.joined:
            p.joined = True
            self.event(f"{p.name} joined the run: averaged round {p.round} with {p.members} peer(s)")
        elif p.round_outcome == "failed":
            failed = ", ".join(r.get("groups_failed") or []) or "shared"
            self.event(
                f"round {p.round} failed on {p.name} (groups: {failed}); it keeps its own weights "
                "and tries again next round"
            )
        elif p.round_outcome == "adopted":
            self.event(f"{p.name} missed round {p.round} and took the result the others agreed on")
        if p.round_outcome == "averaged" and isinstance(p.members, int):
            if self._members is not None and p.members != self._members:
                self.event(f"round {p.round}: {p.members} peers averaged the shared weights (before: {self._members})")
            self._members = p.members

    def set_state(self, name: str, state: str, detail: str = "") -> None:
        """A peer finished, died or was stopped (the caller watches its process)."""
        p = self.peers.setdefault(name, PeerProgress(name, self.max_steps))
        if p.state == state:
            return
        p.state = state
        self.event(f"{name} {state}" + (f": {detail}" if detail else ""))

    def event(self, text: str) -> None:
        """A line that matters (a peer joined, died, a round failed): printed once, above the table."""
        self.events.append(text)
        stamp = time.strftime("%H:%M:%S")
        self.console.print(f"[{stamp}] {text}", markup=False, highlight=False, soft_wrap=True)

    # Output ------------------------------------------------------------------------------
    def table(self) -> Table:
        table = Table(title=self.title or None)
        for col in (
            "peer",
            "state",
            "step",
            "loss",
            "val loss",
            "last round",
            "round s",
            "sent MB",
            "recv MB",
            "tok/s",
            "ETA",
        ):
            table.add_column(col, justify="left" if col in ("peer", "state", "last round") else "right")
        for p in self.peers.values():
            eta = p.eta_seconds() if p.state == "training" else None
            last = "-" if p.round is None else f"{p.round} {p.round_outcome} ({p.members})"
            table.add_row(
                p.name,
                p.state,
                f"{p.step}/{p.max_steps}",
                _num(p.loss),
                _num(p.val_loss),
                last,
                "-" if p.round_seconds is None else f"{p.round_seconds:.1f}",
                f"{p.sent_mb:.1f}",
                f"{p.received_mb:.1f}",
                "-" if not p.tokens_per_s else f"{p.tokens_per_s:,.0f}",
                "-" if eta is None else _duration(eta),
                style={"died": "red", "failed": "red"}.get(p.state),
            )
        return table

    def refresh(self, force: bool = False) -> None:
        """Redraw (a terminal: at most once a second) or print the status lines (every ``plain_every`` s)."""
        now = time.monotonic()
        if self._live is not None:
            if force or now - self._drawn >= 1.0:
                self._live.update(self.table(), refresh=True)
                self._drawn = now
        elif force or now - self._printed >= self.plain_every:
            for p in self.peers.values():
                self.console.print(p.status_line(), markup=False, highlight=False, soft_wrap=True)
            self._printed = now


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
