"""What the dashboard has seen, kept on disk (SQLite in its ``--state-dir``), so that a restarted
dashboard shows a run's curves and rounds from the start, not from its own restart.

Three tables mirror the dashboard's state: each peer's points (step, tokens, loss, throughput over
time), each sync round's merged row (the newest view wins), and the run's total throughput. Writes are
small and batched per read of the run; the file is one per run id, so one directory can hold several.
SQLite ships with Python: no server and no dependency.
"""

from __future__ import annotations

import csv
import io
import json
import re
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

POINT_FIELDS = ("t", "step", "tokens", "loss", "tokens_per_s")
SCHEMA = """
CREATE TABLE IF NOT EXISTS points (peer TEXT NOT NULL, t REAL NOT NULL, step INTEGER, tokens INTEGER,
                                   loss REAL, tokens_per_s REAL);
CREATE INDEX IF NOT EXISTS points_by_peer ON points (peer, t);
CREATE TABLE IF NOT EXISTS rounds (round INTEGER PRIMARY KEY, row TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS throughput (t REAL NOT NULL, peers INTEGER, tokens_per_s REAL);
"""


def store_path(state_dir: str | Path, run_label: str) -> Path:
    """The run's database in ``state_dir``: ``<run id>.sqlite`` (characters a file name cannot hold replaced)."""
    return Path(state_dir).expanduser() / (re.sub(r"[^A-Za-z0-9_.-]", "_", run_label) + ".sqlite")


class HistoryStore:
    """The dashboard's history of one run in a SQLite file; use from one thread at a time."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, check_same_thread=False)
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def add(
        self, points: Iterable[tuple[str, dict[str, Any]]], rounds: Iterable[dict[str, Any]], throughput: dict
    ) -> None:
        """One read of the run: new points by peer, the rounds seen (replacing older views), the run's throughput."""
        with self.db:
            self.db.executemany(
                "INSERT INTO points VALUES (?, ?, ?, ?, ?, ?)",
                [(peer, *(point.get(k) for k in POINT_FIELDS)) for peer, point in points],
            )
            self.db.executemany(
                "INSERT OR REPLACE INTO rounds VALUES (?, ?)", [(int(r["round"]), json.dumps(r)) for r in rounds]
            )
            self.db.execute(
                "INSERT INTO throughput VALUES (?, ?, ?)",
                (throughput["t"], throughput["peers"], throughput["tokens_per_s"]),
            )

    def points(self, last: int) -> dict[str, list[dict[str, Any]]]:
        """Each peer's last ``last`` points, oldest first."""
        out: dict[str, list[dict[str, Any]]] = {}
        rows = self.db.execute(
            "SELECT peer, t, step, tokens, loss, tokens_per_s FROM ("
            " SELECT *, ROW_NUMBER() OVER (PARTITION BY peer ORDER BY t DESC) AS n FROM points)"
            " WHERE n <= ? ORDER BY peer, t",
            (last,),
        )
        for peer, *values in rows:
            out.setdefault(peer, []).append(dict(zip(POINT_FIELDS, values, strict=True)))
        return out

    def rounds(self, last: int) -> list[dict[str, Any]]:
        """The last ``last`` rounds' rows, oldest first."""
        rows = self.db.execute(
            "SELECT row FROM (SELECT * FROM rounds ORDER BY round DESC LIMIT ?) ORDER BY round", (last,)
        )
        return [json.loads(row) for (row,) in rows]

    def throughput(self, last: int) -> list[dict[str, Any]]:
        rows = self.db.execute(
            "SELECT t, peers, tokens_per_s FROM (SELECT * FROM throughput ORDER BY t DESC LIMIT ?) ORDER BY t", (last,)
        )
        return [{"t": t, "peers": peers, "tokens_per_s": rate} for t, peers, rate in rows]

    def all_points(self) -> list[tuple[str, dict[str, Any]]]:
        """Every point of every peer, in time order."""
        rows = self.db.execute("SELECT peer, t, step, tokens, loss, tokens_per_s FROM points ORDER BY t, peer")
        return [(peer, dict(zip(POINT_FIELDS, values, strict=True))) for peer, *values in rows]


def curves_csv(points: Iterable[tuple[str, dict[str, Any]]]) -> str:
    """Points as CSV: peer, t, step, tokens, loss, tokens_per_s."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(("peer", *POINT_FIELDS))
    writer.writerows((peer, *(point.get(k) for k in POINT_FIELDS)) for peer, point in points)
    return out.getvalue()
