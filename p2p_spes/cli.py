"""The ``p2p-spes`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Callable

import yaml

from p2p_spes import __version__
from p2p_spes.errors import BackendError, CheckpointError, ConfigError, DataError

USER_ERRORS = (ConfigError, DataError, CheckpointError, BackendError)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", default=None,
        help="YAML config file or shipped config name (tiny, spes-1b, spes-7b); default: the embedded tiny defaults",
    )
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value, e.g. --set model.num_layers=4 (repeatable)",
    )


def _load(args: argparse.Namespace):
    from p2p_spes.config import load_config

    return load_config(args.config, args.overrides)


def cmd_train(args: argparse.Namespace) -> int:
    from p2p_spes.train import Trainer

    cfg = _load(args)
    if args.run_dir:
        cfg.train.run_dir = args.run_dir
    trainer = Trainer(cfg)
    if args.resume:
        resumed = trainer.resume(None if args.resume == "auto" else args.resume)
        if not resumed and args.resume != "auto":
            raise CheckpointError(f"--resume {args.resume}: no checkpoint found")
        if resumed:
            print(f"resumed at step {trainer.step}", file=sys.stderr)
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


def cmd_tokenize(args: argparse.Namespace) -> int:
    from p2p_spes.tokenization import tokenize_files

    manifest = tokenize_files(
        args.input, args.tokenizer, args.out, num_workers=args.workers, shard_tokens=args.shard_tokens,
        field=args.field, progress=not args.no_progress,
    )
    print(f"wrote {manifest['num_tokens']:,} tokens from {manifest['num_documents']:,} documents "
          f"in {len(manifest['shards'])} shards to {args.out}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from p2p_spes.corpus import embedded_tokenizer_path, prepare_embedded_data

    dirs = prepare_embedded_data()
    print(json.dumps({**{k: str(v) for k, v in dirs.items()}, "tokenizer": str(embedded_tokenizer_path())}, indent=1))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    cfg = _load(args)
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    print(f"# model fingerprint: {cfg.model_fingerprint()}; local experts: {cfg.local_experts()}")
    return 0


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
        help="continue from CHECKPOINT, or from the run directory's newest checkpoint if none is given",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(func=cmd_train)

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
