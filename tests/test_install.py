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
from helpers import ROOT, SMALL


def _venv_with(tmp_path: Path, name: str, wheel: Path, installer: str) -> Path:
    """A fresh virtual environment holding ``wheel`` installed by ``installer`` (pip or uv); its dependencies
    come from the test's own environment (this machine has no internet), after the wheel."""
    venv = tmp_path / name
    python = venv / "bin" / "python"
    if installer == "uv":
        uv = [sys.executable, "-m", "uv"]
        subprocess.run([*uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, timeout=120)
        install = [*uv, "pip", "install", "-q", "--python", str(python), "--no-deps", "--offline", str(wheel)]
    else:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        install = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(install, check=True, timeout=300)
    target = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = [p for p in (sysconfig.get_paths()["purelib"], *site.getsitepackages()) if Path(p).is_dir()]
    (Path(target) / "deps-from-test-env.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")
    return venv


@pytest.mark.long  # three minutes: a wheel build, two venvs and a short run
def test_a_wheel_installed_elsewhere_trains_the_tiny_config_from_any_directory(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(  # the wheel as a release is built (no isolation: the build backend is already here)
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(wheels), str(ROOT)],
        check=True,
        timeout=300,
        cwd=tmp_path,
        capture_output=True,
    )
    (wheel,) = wheels.glob("p2p_spes-*.whl")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for installer in ("pip", "uv"):
        venv = _venv_with(tmp_path, f"venv-{installer}", wheel, installer)
        work = tmp_path / f"elsewhere-{installer}"
        work.mkdir()
        where = subprocess.run(
            [
                str(venv / "bin" / "python"),
                "-c",
                "import p2p_spes, p2p_spes.config as c; print(p2p_spes.__file__); print(c.CONFIG_DIR)",
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=work,
            env=env,
        ).stdout.split()
        assert all(Path(p).is_relative_to(venv) for p in where), where  # the installed copy, not the checkout
        cli = str(venv / "bin" / "p2p-spes")
        volunteer = subprocess.run([cli, "volunteer", "--help"], capture_output=True, text=True, cwd=work, env=env)
        assert volunteer.returncode == 0 and "--initial-peers" in volunteer.stdout, volunteer.stderr
        shipped = subprocess.run(
            [cli, "config", "--config", "spes-1b"], capture_output=True, text=True, cwd=work, env=env
        )
        assert shipped.returncode == 0 and "d_model: 768" in shipped.stdout, shipped.stderr
    # one short run, from the last environment: the shipped config and the embedded corpus travel inside
    train = subprocess.run(
        [cli, "train", "--config", "tiny", "--no-progress", "--run-dir", "run"]
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
    # the README's main job from the installed package: two peers of a small model, 10 steps
    small = [*SMALL, "train.max_steps=10", "train.eval_interval=10", "swarm.sync_steps=5"]
    swarm = subprocess.run(
        [cli, "swarm", "--no-progress", "--no-plot", "--run-dir", "swarm", *[a for i in small for a in ("--set", i)]],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=work,
        env=env,
    )
    assert swarm.returncode == 0, swarm.stdout[-2000:] + swarm.stderr[-2000:]
    peers = [json.loads((work / "swarm" / f"peer{i}" / "summary.json").read_text()) for i in (0, 1)]
    assert [p["step"] for p in peers] == [10, 10]  # (whether they met in a round depends on their start-up)
