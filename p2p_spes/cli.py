"""The ``p2p-spes`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import yaml
from rich.console import Console

from dht.auth import load_auth
from dht.bootstrap import Bootstrap, BootstrapOptions
from dht.dashboard import DashboardServer, RunWatch
from dht.inspector import collect, open_dht, render, watch
from dht.run_config import config_from_published, fetch_run_config
from p2p_spes.assemble import export_from_swarm
from p2p_spes.batch_fit import fit_batch, free_memory, resolve_device
from p2p_spes.cli_parser import build_parser
from p2p_spes.config import load_config, with_overrides
from p2p_spes.corpus import embedded_tokenizer_path, prepare_embedded_data
from p2p_spes.distributed import NodeSync, node_from_env
from p2p_spes.errors import BackendError, CheckpointError, ConfigError, DataError, ResidencyError, SwarmError
from p2p_spes.evaluate import run_eval
from p2p_spes.export import export_hf
from p2p_spes.local_swarm import LocalSwarm
from p2p_spes.peer import run_follower, run_peer
from p2p_spes.plots import plot_runs
from p2p_spes.progress import ProgressView
from p2p_spes.tensorboard_log import summary_writer
from p2p_spes.tokenization import tokenize_files
from p2p_spes.train import Trainer
from p2p_spes.upcycle import upcycle

USER_ERRORS = (ConfigError, DataError, CheckpointError, BackendError, SwarmError, ResidencyError)


# flags that set a config value, and the value they set (applied as --set overrides before validation)
FLAG_SETTINGS = {
    "run_dir": "train.run_dir",
    "run_id": "swarm.run_id",
    "identity": "swarm.identity_path",
    "secret_file": "swarm.secret_file",
    "initial_peers": "swarm.initial_peers",
    "host_maddrs": "swarm.host_maddrs",
    "announce_maddrs": "swarm.announce_maddrs",
}


def _overrides(args: argparse.Namespace) -> list[str]:
    """The --set overrides, then every config flag given as one more (JSON is YAML, so any string is safe):
    a value set by a flag is checked exactly like the same value set with --set."""
    flags = [
        f"{key}={json.dumps(getattr(args, flag))}" for flag, key in FLAG_SETTINGS.items() if getattr(args, flag, None)
    ]
    if getattr(args, "tensorboard", None) and args.command == "train":  # the swarm gives each peer a subdirectory
        flags += ["train.tensorboard=true", f"train.tensorboard_dir={json.dumps(args.tensorboard)}"]
    return list(args.overrides) + flags


def _load(args: argparse.Namespace):

    return load_config(args.config, _overrides(args))


def _config_from_swarm(args: argparse.Namespace):
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
    cfg = config_from_published(record["config"], _overrides(args))
    print(
        f"run config {record['hash'][:16]} (model {record['fingerprint']}), published by "
        f"{len(record['publishers'])} peer(s)",
        file=sys.stderr,
        flush=True,
    )
    return cfg


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

    cfg = _config_from_swarm(args) if args.config_from_swarm else _load(args)
    sw = cfg.swarm
    swarm = bool(args.swarm or sw.initial_peers)
    if node is not None:
        if sw.overlap and swarm:
            raise ConfigError(
                "swarm.overlap is not supported with several processes per peer (torchrun); leave it false"
            )
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

    cfg = _load(args)  # fail fast on a bad config, before starting any process
    if args.tensorboard or cfg.train.tensorboard:
        summary_writer()  # and on a missing optional package
    swarm = LocalSwarm(
        args.config,
        args.overrides,
        args.peers,
        args.run_dir,
        run_id=args.run_id,
        threads=args.threads,
        tensorboard=args.tensorboard,
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


def cmd_plot(args: argparse.Namespace) -> int:

    out = plot_runs(args.run_dirs, args.out, title=args.title or "")
    print(f"wrote {out}")
    return 0


def cmd_bootstrap(args: argparse.Namespace) -> int:

    config = _load(args) if args.config else None
    if args.overrides and not args.config:
        raise ConfigError("--set applies to the published config: give --config FILE too")
    boot = Bootstrap(
        BootstrapOptions(
            identity_path=args.identity,
            host_maddrs=args.host_maddrs,
            announce_maddrs=args.announce_maddrs or [],
            initial_peers=args.initial_peers or [],
            use_relay=not args.no_relay,
            use_auto_relay=args.use_auto_relay,
            run_id=args.run_id,
            config=config,
        )
    )
    maddrs = boot.start()
    try:
        print(f"bootstrap peer id: {boot.identity.peer_id} (identity file {args.identity})", flush=True)
        print("peers join with: --initial-peers " + " ".join(maddrs), flush=True)
        if config is not None:
            print(
                f"publishing the config of run {args.run_id!r} (hash {boot.published['hash'][:16]}, model "
                f"{boot.published['fingerprint']}): volunteers join with --config-from-swarm",
                flush=True,
            )
        if args.write_maddrs:
            Path(args.write_maddrs).write_text(json.dumps({"peer_id": boot.identity.peer_id, "maddrs": maddrs}))
        print("serving; Ctrl-C or SIGTERM stops it", flush=True)
        boot.serve()
    finally:
        boot.shutdown()
    print("bootstrap stopped", flush=True)
    return 0


def cmd_fetch_config(args: argparse.Namespace) -> int:

    cfg = _config_from_swarm(args)
    if args.fit_batch:
        device = resolve_device(cfg.train.device if args.device is None else args.device)
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


def cmd_inspect(args: argparse.Namespace) -> int:

    auth = load_auth(args.secret_file, [])
    run_id = auth.keyspace(args.run_id)
    try:
        dht = open_dht(args.initial_peers, run_id, args.bootstrap_timeout, auth=auth)
    except SwarmError:
        raise
    except Exception as exc:
        raise SwarmError(f"could not reach the run through {' '.join(args.initial_peers)}: {exc}") from None
    console = Console(width=140)
    try:
        if args.watch:
            watch(dht, run_id, args.watch, console, args.json)
        elif args.json:
            print(json.dumps(collect(dht, run_id), indent=1))
        else:
            render(collect(dht, run_id), console)
    except KeyboardInterrupt:
        pass
    finally:
        dht.shutdown()
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:

    auth = load_auth(args.secret_file, [])
    watch = RunWatch(
        args.initial_peers,
        auth.keyspace(args.run_id),
        auth=auth,
        interval=args.interval,
        startup_timeout=args.bootstrap_timeout,
        label=args.run_id,
    )
    try:
        server = DashboardServer(watch, args.host, args.port)
    except OSError as exc:
        raise ConfigError(
            f"cannot serve on {args.host}:{args.port} ({exc}): choose another --port (0: any free one)"
        ) from None
    server.run(f"dashboard of run {args.run_id!r}")
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:

    manifest = tokenize_files(
        args.input,
        args.tokenizer,
        args.out,
        num_workers=args.workers,
        shard_tokens=args.shard_tokens,
        field=args.field,
        progress=not args.no_progress,
    )
    print(
        f"wrote {manifest['num_tokens']:,} tokens from {manifest['num_documents']:,} documents "
        f"in {len(manifest['shards'])} shards to {args.out}"
    )
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:

    dirs = prepare_embedded_data()
    print(json.dumps({**{k: str(v) for k, v in dirs.items()}, "tokenizer": str(embedded_tokenizer_path())}, indent=1))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    cfg = _load(args)
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    print(f"# model fingerprint: {cfg.model_fingerprint()}; local experts: {cfg.local_experts()}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:

    if args.from_swarm == (args.checkpoint is not None):
        raise ConfigError("give either --checkpoint DIR or --from-swarm --initial-peers MADDR ... --run-id ID")
    if args.from_swarm:
        if not args.initial_peers:
            raise ConfigError("--from-swarm needs --initial-peers MADDR of a live peer or bootstrap of the run")
        out, report = export_from_swarm(
            args.initial_peers, args.run_id, args.out, tokenizer=args.tokenizer, timeout=args.fetch_timeout
        )
        sources = Counter(v["kind"] for v in report["experts"].values())
        print(
            f"assembled round {report['round']} (step {report['step']}): shared parameters from {report['shared']}, "
            + ", ".join(f"{n} experts from a {k}" for k, n in sorted(sources.items()))
        )
    else:
        out = export_hf(args.checkpoint, args.out, tokenizer=args.tokenizer)
    print(f"exported OlmoeForCausalLM to {out}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:

    if args.batch_size != "auto" and not args.batch_size.isdigit():
        raise ConfigError(f"--batch-size {args.batch_size!r}: give a positive integer or auto")
    batch_size = args.batch_size if args.batch_size == "auto" else int(args.batch_size)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    summary = run_eval(
        args.model,
        args.tasks,
        limit=limit,
        num_fewshot=args.num_fewshot,
        data_dir=args.data_dir,
        device=args.device,
        batch_size=batch_size,
        dtype=args.dtype,
        out=args.out,
        max_length=args.max_length,
    )
    if args.out:
        print(f"wrote {args.out} ({len(summary.get('results', {}))} result rows)")
    return 0


def cmd_upcycle(args: argparse.Namespace) -> int:

    cfg = _load(args)
    path = upcycle(
        args.dense,
        cfg,
        args.out,
        noise_std=args.noise_std,
        noise_fraction=args.noise_fraction,
        router_init=args.router_init,
        seed=args.seed,
    )
    print(f"wrote upcycled checkpoint {path}; train from it with the same config and --set train.init_from={args.out}")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": cmd_train,
    "swarm": cmd_swarm,
    "inspect": cmd_inspect,
    "dashboard": cmd_dashboard,
    "plot": cmd_plot,
    "bootstrap": cmd_bootstrap,
    "fetch_config": cmd_fetch_config,
    "tokenize": cmd_tokenize,
    "prepare": cmd_prepare,
    "config": cmd_config,
    "export": cmd_export,
    "eval": cmd_eval,
    "upcycle": cmd_upcycle,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return COMMANDS[args.command](args)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
