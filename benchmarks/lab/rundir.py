"""What a benchmark's processes leave for each other in a run folder: readiness marks, rows of raw
measurements and their logs (whole JSON files: ``checkpoint.write_json``). Never results: those go
through ``results.py``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any


def mark(path: Path, text: str) -> None:
    path.write_text(text)


def append_row(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def spawn_logged(argv: list[str], log: Path, cwd: Path) -> subprocess.Popen:
    """``argv`` in its own session, its output to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=out, cwd=cwd, start_new_session=True)
