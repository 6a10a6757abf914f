"""Atomic checkpoints: safetensors weights and optimizer moments, JSON trainer state.

A checkpoint is a directory ``step_XXXXXXXX`` written under a temporary name and renamed into
place, so a crash mid-write leaves the previous checkpoint intact; ``latest`` names the newest.
Nothing is unpickled: tensors are safetensors, everything else is JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from p2p_spes.errors import CheckpointError
from p2p_spes.optim import state_names

FORMAT = "p2p-spes-checkpoint"
VERSION = 1
WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.safetensors"
STATE = "trainer_state.json"
LATEST = "latest"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` so a reader polling ``path`` sees either nothing or the whole file, never a part."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer state (Muon's momentum, AdamW's moments) keyed by parameter name, so it survives
    re-ordering of parameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value):
                out[f"{names[id(p)]}::{key}"] = value.detach().cpu().contiguous()
    return out


def load_optimizer_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]
) -> None:
    """The saved state into ``optimizer``; refused whole when a parameter is unknown or its state is
    another optimizer's (AdamW's moments where Muon keeps a momentum, say)."""
    params = dict(model.named_parameters())
    saved: dict[str, dict[str, torch.Tensor]] = {}
    for flat_key, value in tensors.items():
        name, key = flat_key.split("::", 1)
        if name not in params:
            raise CheckpointError(f"optimizer state for unknown parameter {name}; the checkpoint's experts differ")
        saved.setdefault(name, {})[key] = value
    for name, state in saved.items():
        expected = state_names(optimizer, params[name])
        if expected is not None and set(state) != expected:
            raise CheckpointError(
                f"the checkpoint's optimizer state for {name} is {sorted(state)} where this optimizer keeps "
                f"{sorted(expected)}: it was saved with another train.optimizer; resume with the one it was trained with"
            )
    for name, state in saved.items():
        p = params[name]
        for key, value in state.items():
            optimizer.state[p][key] = value.to(p.device) if key != "step" else value.clone()


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    trainer_state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write ``run_dir/checkpoints/step_<step>`` atomically and return its path.

    A write that fails (a full disk, a lost mount) raises :class:`CheckpointError` after removing what
    it wrote; the previous checkpoint and ``latest`` are untouched, so they stay usable."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}-{os.getpid()}"
    try:
        return _write_checkpoint(root, final, tmp, step, model, optimizer, trainer_state, keep)
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as its own error
        shutil.rmtree(tmp, ignore_errors=True)  # a partial write must not hold the space the next one needs
        reason = getattr(exc, "strerror", None) or str(exc)
        raise CheckpointError(
            f"could not write checkpoint {final} ({reason}); the previous checkpoint "
            "in that directory is untouched and usable. Free space there (or move train.run_dir) "
            "so the next one can be written"
        ) from exc


def _write_checkpoint(
    root: Path,
    final: Path,
    tmp: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    trainer_state: dict[str, Any],
    keep: int,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(tmp / WEIGHTS), metadata={"format": FORMAT})
    files = [WEIGHTS]
    if optimizer is not None:
        save_file(optimizer_tensors(model, optimizer), str(tmp / OPTIMIZER), metadata={"format": FORMAT})
        files.append(OPTIMIZER)
    state = dict(trainer_state)
    state.update(
        format=FORMAT,
        version=VERSION,
        step=step,
        saved_at=time.time(),
        checksums={name: _sha256(tmp / name) for name in files},
    )
    write_json(tmp / STATE, state)
    for name in files:
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    write_json(root / LATEST, {"checkpoint": final.name})
    _prune(root, keep)
    return final


def _prune(root: Path, keep: int) -> None:
    complete = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def read_state(checkpoint: str | Path) -> dict[str, Any]:
    """Validate a checkpoint directory and return its trainer state."""
    path = Path(checkpoint)
    state_file = path / STATE
    if not path.is_dir() or not state_file.exists():
        raise CheckpointError(
            f"{path} is not a p2p-spes checkpoint (no {STATE}); point at a run directory or a "
            "checkpoints/step_* directory written by `p2p-spes train`"
        )
    try:
        state = json.loads(state_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{state_file} is unreadable ({exc}); delete this checkpoint to use an older one"
        ) from None
    if state.get("format") != FORMAT or state.get("version") != VERSION:
        raise CheckpointError(
            f"{path} has format {state.get('format')!r} v{state.get('version')}, expected {FORMAT} v{VERSION}"
        )
    for name, digest in state.get("checksums", {}).items():
        file = path / name
        if not file.exists() or _sha256(file) != digest:
            raise CheckpointError(f"{file} is missing or does not match its checksum; the checkpoint is corrupt")
    return state


def find_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run directory (or the directory itself if it is one)."""
    path = Path(run_dir)
    if (path / STATE).exists():
        return path
    root = path / "checkpoints"
    latest = root / LATEST
    if latest.exists():
        try:
            candidate = root / json.loads(latest.read_text())["checkpoint"]
            if (candidate / STATE).exists():
                return candidate
        except (OSError, json.JSONDecodeError, KeyError):
            pass
    complete = sorted(p for p in root.glob("step_*") if (p / STATE).exists())
    return complete[-1] if complete else None


def check_fingerprint(path: Path, state: dict[str, Any], fingerprint: str) -> None:
    """Refuse a checkpoint written for another model, naming both fingerprints."""
    if state.get("model_fingerprint") != fingerprint:
        raise CheckpointError(
            f"{path} was written for a different model (fingerprint {state.get('model_fingerprint')}, "
            f"this config has {fingerprint}); use the config it was trained with or a fresh run_dir"
        )


def load_checkpoint(
    checkpoint: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    fingerprint: str | None = None,
    state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load weights (and optimizer moments) into ``model``; refuse another model's checkpoint.

    ``state`` is what :func:`read_state` returned, to skip validating the checkpoint twice.
    """
    path = Path(checkpoint)
    if state is None:
        state = read_state(path)
    if fingerprint is not None:
        check_fingerprint(path, state, fingerprint)
    device = next(model.parameters()).device
    weights = load_file(str(path / WEIGHTS), device=str(device))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not fit the model (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    if optimizer is not None and (path / OPTIMIZER).exists():
        load_optimizer_tensors(model, optimizer, load_file(str(path / OPTIMIZER)))
    return state
