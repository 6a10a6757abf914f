"""The GPU throughput benchmark's code path, on CPU with tiny shapes (the numbers need a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_benchmark_runs_every_arm_and_reports_a_missing_backend(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_throughput.py", "--cpu-smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["backend"], r["experts"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 6
    for experts in ("all experts", "E/4 (SPES)"):
        loop = rows[("torch loop", experts)]
        assert loop["tokens_per_s"] > 0 and loop["model_flops_per_s"] > 0 and loop["peak_memory_bytes"] > 0
    # a SPES peer keeps gradients and AdamW state for a quarter of the experts only
    assert rows[("torch loop", "E/4 (SPES)")]["state_bytes"] < rows[("torch loop", "all experts")]["state_bytes"]
    megablocks = rows[("megablocks", "all experts")]
    assert "error" in megablocks and ("MegaBlocks" in megablocks["error"] or "CUDA" in megablocks["error"])
