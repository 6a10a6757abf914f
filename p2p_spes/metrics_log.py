"""The ``metrics.jsonl`` format, written and read in one place.

A peer appends one JSON object per line to ``<run_dir>/metrics.jsonl``: its training steps (``step``,
``loss``, ...), its sync rounds (``sync_round``, ``outcome``, bytes, ...) and events such as takeovers and
catch-ups, each stamped with the wall-clock ``time``. The file is append-only; a line cut short by a kill
is skipped on reading, never fatal.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"


def metrics_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS_FILE


def parse_line(line: str | bytes) -> dict[str, Any] | None:
    """One record, or None for a line that is not a JSON object (cut by a kill, or blank)."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of a peer's ``metrics.jsonl`` (none if it has not written one)."""
    path = metrics_path(run_dir)
    if not path.exists():
        return []
    return [r for r in map(parse_line, path.read_text().splitlines()) if r is not None]


def round_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of the sync rounds a peer ran."""
    return [r for r in read_metrics(run_dir) if "sync_round" in r]


class MetricsWriter:
    """Appends records to a run directory's ``metrics.jsonl``. A full disk costs lines, not the run:
    ``lost`` counts the lines that could not be written, and the first loss is logged."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = metrics_path(run_dir)
        self.lost = 0

    def append(self, record: dict[str, Any]) -> dict[str, Any]:
        """Write ``record`` stamped with the wall-clock time; the stamped record."""
        record = {**record, "time": round(time.time(), 3)}
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as exc:
            if not self.lost:
                log.error("could not write %s (%s); lines are dropped until it can be written", METRICS_FILE, exc)
            self.lost += 1
        return record


class MetricsTail:
    """The lines appended to a ``metrics.jsonl`` since the last read; a line still being written waits
    for its end, and a line that is not JSON (cut by a kill) is skipped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.offset = 0
        self.partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except OSError:
            return []
        if size < self.offset:  # the file was replaced (a fresh start in the same run directory)
            self.offset, self.partial = 0, b""
        if size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        return [r for r in map(parse_line, lines) if r is not None]
