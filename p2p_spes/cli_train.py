"""The commands that train: ``train`` (one peer, alone, in a swarm or under torchrun), ``swarm`` (N local peers)
and ``volunteer`` (one supervised peer of someone else's run)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from p2p_spes.cli_config import cmd_fetch_config, config_from_swarm, load_from_args
from p2p_spes.cli_parser import build_parser
from p2p_spes.config import load_config
from p2p_spes.distributed import NodeSync, node_from_env
from p2p_spes.errors import CheckpointError, ConfigError, DataError
from p2p_spes.local_swarm import LocalSwarm
from p2p_spes.peer import run_follower, run_peer
from p2p_spes.plots import plot_runs
from p2p_spes.progress import ProgressView
from p2p_spes.tensorboard_log import summary_writer
from p2p_spes.train import Trainer
from p2p_spes.volunteer import Restarts, Supervisor, check_machine, handle_stop_signals, say
from p2p_spes.wandb_log import wandb_module


def cmd_train(args: argparse.Namespace) -> int:
    node = node_from_env()  # under torchrun: one peer of several processes
    try:
        if node is not None and not node.main:
            return _follow(node, node.send_json())
        return _train(args, node)
    finally:
        if node is not None:
            node.close()


def _follow(node, order: dict) -> int:
    """A rank > 0 under torchrun: rank 0 sent the config and what it does with it."""

    cfg = load_config(None, data=order["config"])
    if order["swarm"]:
        run_follower(cfg, cfg.train.run_dir, node, resume=order["resume"])
        return 0

    trainer = Trainer(cfg, node=node)
    if order["resume"] is not None:
        trainer.resume(None if order["resume"] == "auto" else order["resume"])
    NodeSync.attach(node, trainer)
    trainer.run(progress=False)
    return 0


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _train(args: argparse.Namespace, node) -> int:
    cfg = config_from_swarm(args) if args.config_from_swarm else load_from_args(args)
    if cfg.train.wandb_project:
        wandb_module()  # a missing optional package stops the peer before it joins the swarm
    sw = cfg.swarm
    swarm = bool(args.swarm or sw.initial_peers)
    if node is not None:
        node.send_json({"config": cfg.to_dict(), "swarm": swarm, "resume": args.resume})
    if swarm:
        summary = run_peer(cfg, cfg.train.run_dir, progress=not args.no_progress, resume=args.resume, node=node)
        print(
            f"done: step {summary['step']}, final train loss {_loss(summary['final_train_loss'])}, val loss "
            f"{_loss(summary['final_val_loss'])}, rounds joined {summary.get('rounds_joined')}, "
            f"bytes sent {summary.get('bytes_sent'):,} received {summary.get('bytes_received'):,}"
        )
        return 0
    trainer = Trainer(cfg, node=node)
    if args.resume:
        resumed = trainer.resume(None if args.resume == "auto" else args.resume)
        if not resumed and args.resume != "auto":
            raise CheckpointError(f"--resume {args.resume}: no checkpoint found")
        if resumed:
            print(f"resumed at step {trainer.step}", file=sys.stderr)
    if node is not None:
        NodeSync.attach(node, trainer)
    (trainer.run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    summary = trainer.run(progress=not args.no_progress)
    mem = summary["memory"]
    print(
        f"done: step {summary['step']}, tokens {summary['tokens']}, train loss "
        f"{_loss(summary['first_train_loss'])} -> {_loss(summary['final_train_loss'])}, "
        f"val loss {_loss(summary['final_val_loss'])}; trained experts {summary['local_experts']} of "
        f"{summary['num_experts']}; grad+optimizer bytes {sum(mem['gradients'].values()) + sum(mem['optimizer'].values()):,}; "
        f"run dir {trainer.run_dir}"
    )
    return 0


def cmd_swarm(args: argparse.Namespace) -> int:
    cfg = load_from_args(args)  # fail fast on a bad config, before starting any process
    if args.tensorboard or cfg.train.tensorboard:
        summary_writer()  # and on a missing optional package
    if cfg.train.wandb_project:
        wandb_module()
    swarm = LocalSwarm(
        args.config,
        args.overrides,
        args.peers,
        args.run_dir,
        run_id=args.run_id,
        threads=args.threads,
        tensorboard=args.tensorboard,
        wandb_project=args.wandb_project,
    )
    print(f"starting {args.peers} peers on 127.0.0.1; logs in {args.run_dir}/peer*.log", flush=True)
    view = ProgressView(
        [f"peer{i}" for i in range(args.peers)],
        cfg.train.max_steps,
        live=False if args.no_progress else None,
        title=f"local swarm, run dir {args.run_dir}",
    )
    try:
        swarm.start()
        with view:
            codes = swarm.watch(view, args.timeout)
        if any(c is None for c in codes):
            print(f"time limit of {args.timeout}s reached: stopping the peers", file=sys.stderr)
    except KeyboardInterrupt:
        print("stopping the peers (they checkpoint and leave)", file=sys.stderr)
    finally:
        swarm.stop()
    swarm.print_summary()
    if not args.no_plot:
        _plot_swarm(swarm.run_dir)
    return 0 if all(p.returncode == 0 for p in swarm.procs) else 1


def _plot_swarm(run_dir: Path) -> None:
    """The local swarm's curves, next to its peers' directories (a note instead when it cannot be drawn)."""
    try:
        out = plot_runs([run_dir], run_dir / "curves.png", title=f"local swarm {run_dir}")
    except (ConfigError, DataError) as exc:
        print(f"no curves.png: {exc}", file=sys.stderr)
        return
    print(f"curves: {out}")


def volunteer_train_command(args: argparse.Namespace, directory: Path, config: Path) -> list[str]:
    """The ``p2p-spes train`` command line a volunteer's supervised peer runs (the same at every restart)."""
    secret = ["--secret-file", args.secret_file] if args.secret_file else []
    train = [sys.executable, "-m", "p2p_spes", "train", "--no-progress", "--config", str(config)]
    train += ["--run-id", args.run_id, "--initial-peers", *args.initial_peers, *secret]
    train += ["--identity", str(directory / "peer.key"), "--run-dir", str(directory / "run")]
    train += ["--reachability", args.reachability] if args.reachability else []
    train += ["--resume", "auto", *args.train_args]  # a restarted peer goes on from its newest checkpoint
    return train


def cmd_volunteer(args: argparse.Namespace) -> int:
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts takes a whole number >= 0, got {args.max_restarts}")
    directory = Path(args.dir).resolve()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--dir {args.dir}: cannot create it ({exc}); give a directory you can write") from None
    machine = check_machine(args.device, directory)
    for line in machine.lines:
        say(line)
    for warning in machine.warnings:
        say(f"warning: {warning}")

    say(f"fetching the config of run {args.run_id!r} through {args.initial_peers[0]}")
    config = directory / "run-config.yaml"
    secret = ["--secret-file", args.secret_file] if args.secret_file else []
    fetch = ["fetch-config", "--initial-peers", *args.initial_peers, "--run-id", args.run_id, "--fit-batch"]
    fetch += ["--device", machine.device, "--memory-fraction", str(args.memory_fraction), "--out", str(config)]
    fetch += ["--fetch-timeout", str(args.fetch_timeout), *secret]
    fetch += ["--config-hash", args.config_hash] if args.config_hash else []
    cmd_fetch_config(build_parser().parse_args(fetch))

    train = volunteer_train_command(args, directory, config)
    supervisor = Supervisor(
        lambda start: train, directory / "peer.log", Restarts(limit=args.max_restarts), directory / "peer.pid"
    )
    handle_stop_signals(supervisor)
    return supervisor.run().code
