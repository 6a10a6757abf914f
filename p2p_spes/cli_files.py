"""The commands that turn files into files: ``data``, ``plot``, ``export``, ``eval`` and ``upcycle``."""

from __future__ import annotations

import argparse
import json
from collections import Counter

from p2p_spes.assemble import export_from_swarm
from p2p_spes.cli_config import load_from_args
from p2p_spes.corpus import embedded_tokenizer_path, prepare_embedded_data
from p2p_spes.errors import ConfigError
from p2p_spes.evaluate import run_eval
from p2p_spes.export import export_hf
from p2p_spes.plots import plot_runs
from p2p_spes.tokenization import tokenize_files
from p2p_spes.upcycle import upcycle


def cmd_tokenize(args: argparse.Namespace) -> int:
    manifest = tokenize_files(
        args.input,
        args.tokenizer,
        args.out,
        validation_inputs=args.validation_input,
        validation_fraction=args.validation_fraction,
        num_workers=args.workers,
        shard_tokens=args.shard_tokens,
        field=args.field,
        split=args.split,
        progress=not args.no_progress,
    )
    splits = "; ".join(
        f"{name}: {manifest.num_tokens(name):,} tokens, {manifest.num_documents.get(name, 0):,} documents, "
        f"{len(shards)} shard{'s' if len(shards) != 1 else ''}"
        for name, shards in manifest.splits.items()
    )
    print(f"wrote {splits} ({manifest.dtype}) to {args.out}; data fingerprint {manifest.fingerprint}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    root = prepare_embedded_data()
    print(json.dumps({"data": str(root), "tokenizer": str(embedded_tokenizer_path())}, indent=1))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    out = plot_runs(args.run_dirs, args.out, title=args.title or "")
    print(f"wrote {out}")
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
    cfg = load_from_args(args)
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
