"""Weights & Biases runs (``train.wandb_project``): one per peer, and one of a dashboard's view of the run.

A peer's run is named after the peer and grouped by the run id, so the peers of one run show side by side;
its config is the peer's resolved config. Every ``metrics.jsonl`` record's numbers go to its history at the
record's training step, under the names the TensorBoard scalars have (:func:`tensorboard_log.scalars`):
``train/loss``, ``val/loss``, ``sync/seconds``, ``sync/bytes_sent``, ``sync/traffic/...``. The dashboard
(``p2p-spes dashboard --wandb-project``) logs what it reads of the whole run (peers, steps, throughput,
expert coverage, the newest round) to one more run of the group, once per read.

The ``wandb`` package is the optional ``wandb`` extra: without it a peer or dashboard asked to log to W&B
refuses to start and says how to install it, as ``train.tensorboard`` does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from p2p_spes.config import Config
from p2p_spes.errors import ConfigError
from p2p_spes.tensorboard_log import scalars


def wandb_module() -> ModuleType:
    """The ``wandb`` package, or a :class:`ConfigError` saying how to install it (checked at start-up)."""
    try:
        import wandb
    except ImportError as exc:
        raise ConfigError(
            f"logging to Weights & Biases needs the wandb package ({exc}): pip install 'p2p-spes[wandb]', "
            "or leave train.wandb_project (--wandb-project) empty"
        ) from None
    return wandb


@dataclass
class WandbTarget:
    """Where one W&B run goes and what it is called; empty strings leave the choice to W&B's own defaults."""

    project: str
    name: str
    group: str = ""
    entity: str = ""
    mode: str = "auto"  # auto: $WANDB_MODE, else online
    dir: str = ""  # "": $WANDB_DIR, else W&B's default (the working directory)
    job_type: str = "train"


def peer_target(cfg: Config, run_dir: str | Path, peer_id: str | None = None) -> WandbTarget | None:
    """The W&B run of a peer training into ``run_dir``, from ``train.wandb_*`` (None when the project is empty).

    The default name is the run directory's name, with the end of the swarm peer id so that peers whose run
    directories share a name (``runs/default`` on every machine) still get runs of their own."""
    tr = cfg.train
    if not tr.wandb_project:
        return None
    run_dir = Path(run_dir)
    name = tr.wandb_name or (f"{run_dir.name}-{peer_id[-8:]}" if peer_id else run_dir.name)
    return WandbTarget(
        project=tr.wandb_project,
        name=name,
        group=tr.wandb_group or cfg.swarm.run_id,
        entity=tr.wandb_entity,
        mode=tr.wandb_mode,
        dir=tr.wandb_dir or ("" if os.environ.get("WANDB_DIR") else str(run_dir)),
    )


def start_run(target: WandbTarget, config: dict[str, Any]) -> Any:
    """A new W&B run for ``target`` with ``config``; it leaves stdout alone (the live progress view owns it)."""
    wandb = wandb_module()
    if target.dir:
        Path(target.dir).mkdir(parents=True, exist_ok=True)
    return wandb.init(
        project=target.project,
        entity=target.entity or None,
        group=target.group or None,
        name=target.name,
        job_type=target.job_type,
        mode=None if target.mode == "auto" else target.mode,
        dir=target.dir or None,
        config=config,
        reinit="create_new",  # a process may hold several runs (tests, a dashboard beside a peer)
        settings=wandb.Settings(console="off"),
    )


class WandbLog:
    """A peer's ``metrics.jsonl`` records into its W&B run, each record's numbers at its step."""

    def __init__(self, target: WandbTarget, config: dict[str, Any]) -> None:
        self.target = target
        self.run = start_run(target, config)
        self.step = 0

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        # W&B's steps only go forward: a record behind the last one logged stays in metrics.jsonl only
        if not isinstance(step, int) or step < self.step:
            return
        values = scalars(record)
        if values:
            self.run.log(values, step=step)
            self.step = step

    def close(self, failed: bool = False) -> None:
        """Finish the run (marked failed when the training loop raised)."""
        self.run.finish(exit_code=1 if failed else 0)


def run_view(snapshot: dict[str, Any]) -> dict[str, float]:
    """The numbers of one read of the whole run (:func:`dht.inspector.collect`): what the dashboard logs."""
    run, peers, coverage = snapshot["run"], snapshot["peers"], snapshot["coverage"]
    steps = [p["step"] for p in peers if isinstance(p.get("step"), int)]
    out: dict[str, float] = {
        "run/peers": float(run["peers"]),
        "run/tokens_per_s": float(run["tokens_per_s"]),
        "run/total_tokens": float(run["total_tokens"]),
        "run/bytes_sent": float(run["bytes_sent"]),
        "run/bytes_received": float(run["bytes_received"]),
    }
    if steps:
        out["run/max_step"], out["run/min_step"] = float(max(steps)), float(min(steps))
    if coverage:
        out["coverage/min_holders"] = float(min(c["holders"] for c in coverage))
        out["coverage/experts_missing"] = float(sum(c["status"] == "missing" for c in coverage))
        out["coverage/experts_low"] = float(sum(c["status"] == "low" for c in coverage))
    if snapshot["rounds"]:
        newest = max(snapshot["rounds"], key=lambda r: r["round"])
        for key in ("round", "participants", "ok", "alone", "seconds", "bytes_sent", "bytes_received"):
            if isinstance(newest.get(key), (int, float)):
                out["round/" + ("number" if key == "round" else key)] = float(newest[key])
    for p in peers:
        short = p["peer_id"][-8:]
        for key in ("step", "loss", "tokens_per_s"):
            if isinstance(p.get(key), (int, float)):
                out[f"peer/{short}/{key}"] = float(p[key])
    return out


class RunViewLog:
    """A dashboard's reads of the whole run into one W&B run, one history row per read."""

    def __init__(self, target: WandbTarget) -> None:
        self.target = target
        self.run = start_run(target, {"run_id": target.group})
        self.reads = 0

    def write(self, snapshot: dict[str, Any]) -> None:
        self.reads += 1
        self.run.log(run_view(snapshot), step=self.reads)

    def close(self) -> None:
        self.run.finish()


def dashboard_target(project: str, run_id: str) -> WandbTarget:
    """The dashboard's W&B run: in the run id's group, beside the peers' runs (entity and mode from $WANDB_*)."""
    return WandbTarget(project=project, name=f"dashboard-{run_id}", group=run_id, job_type="dashboard")
