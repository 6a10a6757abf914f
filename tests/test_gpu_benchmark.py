"""The GPU throughput benchmark's code path, on CPU with tiny shapes (the numbers need a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.lab import results

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_benchmark_runs_every_arm_and_reports_a_missing_backend(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_throughput", "--cpu-smoke", "--variant", "smoke"],
        cwd=ROOT,
        env=dict(os.environ, **{results.ROOT_ENV: str(tmp_path)}),  # not into benchmarks/results
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = results.read(tmp_path / "gpu_throughput" / "smoke.json")
    assert written.provenance["argv"] == [
        "python",
        "-m",
        "benchmarks.gpu_throughput",
        "--cpu-smoke",
        "--variant",
        "smoke",
    ]
    assert not written.missing
    rows = {(r["backend"], r["experts"]): r for r in written.payload["rows"]}
    assert len(rows) == 6
    for experts in ("all experts", "E/4 (SPES)"):
        loop = rows[("torch loop", experts)]
        assert loop["tokens_per_s"] > 0 and loop["model_flops_per_s"] > 0 and loop["peak_memory_bytes"] > 0
    # a SPES peer keeps gradients and AdamW state for a quarter of the experts only
    assert rows[("torch loop", "E/4 (SPES)")]["state_bytes"] < rows[("torch loop", "all experts")]["state_bytes"]
    megablocks = rows[("megablocks", "all experts")]
    assert "error" in megablocks and ("MegaBlocks" in megablocks["error"] or "CUDA" in megablocks["error"])
