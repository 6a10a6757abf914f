"""The package works where it is installed: a wheel built from the checkout, installed into a fresh
virtual environment, runs from another directory with its shipped configs and embedded corpus."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers import ROOT


@pytest.mark.long  # two minutes: a wheel build, a venv and a short run
def test_a_wheel_installed_elsewhere_trains_the_tiny_config_from_any_directory(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)],
        check=True,
        timeout=300,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("p2p_spes-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, timeout=300
    )
    # the dependencies come from the test's own environment (this machine has no internet), after the wheel
    target = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = [p for p in (sysconfig.get_paths()["purelib"], *site.getsitepackages()) if Path(p).is_dir()]
    (Path(target) / "deps-from-test-env.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run(
        [str(python), "-c", "import p2p_spes, p2p_spes.config as c; print(p2p_spes.__file__); print(c.CONFIG_DIR)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=work,
        env=env,
    ).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in where), where  # the installed copy, not the checkout
    train = subprocess.run(
        [str(venv / "bin" / "p2p-spes"), "train", "--config", "tiny", "--no-progress", "--run-dir", "run"]
        + [
            a
            for item in ["train.max_steps=3", "train.warmup_steps=1", "train.eval_interval=3"]
            for a in ("--set", item)
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=work,
        env=env,
    )
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
    summary = json.loads((work / "run" / "summary.json").read_text())
    assert summary["step"] == 3 and summary["data"]["origin"] == "embedded"
    shipped = subprocess.run(
        [str(venv / "bin" / "p2p-spes"), "config", "--config", "spes-1b"],
        capture_output=True,
        text=True,
        cwd=work,
        env=env,
    )
    assert shipped.returncode == 0 and "d_model: 768" in shipped.stdout, shipped.stderr
