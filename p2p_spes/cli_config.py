"""The config a command runs with, and the commands that print it (``config``, ``fetch-config``).

A command's config is a YAML file (or the defaults) with ``--set`` overrides, and the flags that set a
config value applied as more overrides; or, with ``--config-from-swarm``, the run's published config
with this machine's local overrides.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from dht.auth import load_auth
from dht.run_config import config_from_published, fetch_run_config
from p2p_spes.batch_fit import fit_batch, free_memory
from p2p_spes.config import Config, load_config, with_overrides
from p2p_spes.config_docs import explain
from p2p_spes.device import resolve_device
from p2p_spes.errors import ConfigError

# flags that set a config value, and the value they set (applied as --set overrides before validation)
FLAG_SETTINGS = {
    "run_dir": "train.run_dir",
    "run_id": "swarm.run_id",
    "identity": "swarm.identity_path",
    "secret_file": "swarm.secret_file",
    "initial_peers": "swarm.initial_peers",
    "host_maddrs": "swarm.host_maddrs",
    "announce_maddrs": "swarm.announce_maddrs",
    "wandb_project": "train.wandb_project",
}


def config_overrides(args: argparse.Namespace) -> list[str]:
    """The --set overrides, then every config flag given as one more (JSON is YAML, so any string is safe):
    a value set by a flag is checked exactly like the same value set with --set."""
    flags = [
        f"{key}={json.dumps(getattr(args, flag))}" for flag, key in FLAG_SETTINGS.items() if getattr(args, flag, None)
    ]
    if getattr(args, "tensorboard", None) and args.command == "train":  # the swarm gives each peer a subdirectory
        flags += ["train.tensorboard=true", f"train.tensorboard_dir={json.dumps(args.tensorboard)}"]
    return list(args.overrides) + flags


def load_from_args(args: argparse.Namespace) -> Config:
    """The config of ``--config`` with the ``--set`` overrides and the config flags applied."""
    return load_config(args.config, config_overrides(args))


def config_from_swarm(args: argparse.Namespace) -> Config:
    """The run's published config (signature and hash checked) with this machine's local --set overrides."""
    if args.config:
        raise ConfigError("--config-from-swarm and --config exclude each other: the run's config comes from the DHT")
    if not args.initial_peers:
        raise ConfigError("--config-from-swarm needs --initial-peers MADDR of a live peer or bootstrap of the run")
    run_id = args.run_id or "p2p-spes"
    print(f"fetching the config of run {run_id!r} from the swarm", file=sys.stderr, flush=True)
    record = fetch_run_config(
        args.initial_peers,
        run_id,
        expected_hash=args.config_hash,
        timeout=args.fetch_timeout,
        auth=load_auth(args.secret_file, []),
    )
    cfg = config_from_published(record["config"], config_overrides(args))
    print(
        f"run config {record['hash'][:16]} (model {record['fingerprint']}), published by "
        f"{len(record['publishers'])} peer(s)",
        file=sys.stderr,
        flush=True,
    )
    fingerprint = record.get("data_fingerprint")
    where = f"data.manifest {cfg.data.manifest}" if cfg.data.manifest else "the embedded corpus (no data.manifest)"
    print(
        f"the run trains on {where}" + (f", data {fingerprint[:16]}" if isinstance(fingerprint, str) else ""),
        file=sys.stderr,
        flush=True,
    )
    return cfg


def cmd_config(args: argparse.Namespace) -> int:
    cfg = load_from_args(args)
    if args.explain:
        print(explain(cfg), end="")
    else:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    print(f"# model fingerprint: {cfg.model_fingerprint()}; local experts: {cfg.local_experts()}")
    return 0


def cmd_fetch_config(args: argparse.Namespace) -> int:
    cfg = config_from_swarm(args)
    if args.fit_batch:
        device = str(resolve_device(cfg.train.device if args.device is None else args.device))
        plan = fit_batch(cfg, free_memory(device), device, args.memory_fraction)
        cfg = with_overrides(cfg, [f"train.batch_size={plan.batch_size}", f"train.grad_accum={plan.grad_accum}"])
        print(plan.describe(), file=sys.stderr, flush=True)
    if args.device is not None:
        cfg = with_overrides(cfg, [f"train.device={json.dumps(args.device)}"])
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote the run's config to {args.out}", file=sys.stderr)
    else:
        print(text, end="")
    return 0
