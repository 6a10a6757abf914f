"""Quality at equal tokens: each knob that decides a swarm's validation loss, against centralized training.

    python -m benchmarks.quality                   # every arm x 3 seeds (~3 min per arm and seed)
    python -m benchmarks.quality --arms centralized default sync-10 --seeds 0 1 2 --add
                                                   # run these and merge them into the results
    python -m benchmarks.quality --arms centralized default --seeds 0 --steps 100 --variant quick
    python -m benchmarks.quality --report          # the table and plot of the stored runs

Every arm trains the convergence benchmark's narrow tiny model (d_model 64, 2 layers, 8 experts top-2,
seq_len 64) with AdamW (``train.optimizer=adamw``, pinned by ``convergence.CONFIG``: the default when the
stored arms ran; the muon arms set Muon) on the embedded corpus for ``--steps`` steps of P x 8 sequences (P = 4 peers unless the arm
says otherwise), with ``train.seed`` and ``data.seed`` set to the seed, and is scored by
``benchmarks/convergence.py``'s scorer: mean next-token cross-entropy of the swarm's model (the shared
weights, each expert from a peer that trains it) on the same 1024 validation windows for every arm,
seed and step. Swarm peers are held at each sync boundary until all have reached it (the convergence
benchmark's lockstep launcher), so every arm trains exactly its token budget. A swarm arm changes
one knob of the embedded defaults (``configs/tiny.yaml``'s ``swarm:`` and ``experts:`` sections) and
nothing else:

* ``centralized`` / ``centralized-2``: one process, the full model, batch 32 / 16 (the baselines of
  the 4- and 2-peer arms);
* ``default`` / ``default-2``: the embedded swarm defaults with 4 / 2 peers;
* ``sync-10``, ``sync-25``, ``sync-100``: ``swarm.sync_steps`` (default 50);
* ``replicas-2``: two holders per expert (each peer trains 4 of the 8); ``full-replicas``: every peer
  trains every expert (local SGD of the whole model; the ceiling of the replicas knob, at full
  optimizer memory);
* ``nesterov``: DiLoCo's outer step (``swarm.outer_optimizer=nesterov``, outer lr 0.7, momentum 0.9);
* ``no-merge``: warm-up merging off; ``decayed-lb``: ``experts.decayed_lb=true``;
* ``shared-data``: ``data.partition=shared`` (every peer samples the whole training split with its
  own order, instead of disjoint slices);
* ``fp16``, ``int8``, ``int4``, ``topk``: ``swarm.compression``; ``topk-dense``: topk with
  ``swarm.topk_result_fraction`` 4/64; ``int8-keep``, ``topk-keep``: int8
  and topk with ``swarm.keep_local_progress`` (each member keeps in its weights what its messages
  have not carried, instead of resetting to the group's result and sending it later);
* ``centralized-muon`` / ``centralized-2-muon``, ``muon`` / ``muon-2``: ``train.optimizer=muon`` (Muon on
  the hidden matrices, AdamW on the rest) for centralized and swarm alike; each swarm arm's gap is to
  the centralized run with the same optimizer; ``muon-int8``: with ``swarm.compression=int8`` too;
* ``centralized-muon-4x`` / ``centralized-2-muon-4x``, ``muon-4x`` / ``muon-4x-2``: today's defaults (Muon
  with ``train.muon_adamw_lr_scale=4``); ``muon-4x-nesterov``: those with DiLoCo's Nesterov outer step;
  ``-noclip`` (``centralized-muon-4x-noclip``, ``muon-4x-noclip``, and the 2-peer pair): those with
  ``train.grad_clip=0`` for centralized and swarm alike (a peer's batch of 8 is clipped at 1.0 where
  centralized training's batch of 32 is not: ``benchmarks/grad_norms.py``);
* ``-ns3`` (``centralized-muon-4x-ns3``, ``muon-4x-ns3``, and the 2-peer pair): those with
  ``train.muon_ns_steps=3`` (3 Newton-Schulz iterations instead of 5) for centralized and swarm alike;
* probes of where the gap comes from: ``outer-sgd-2`` (the new value is the anchor minus twice the
  averaged pseudo-gradient: the step a batch P times larger would take if the gradient noise were all
  that differs), ``lr-2x`` (inner lr doubled), ``alone`` (one process with one peer's batch of 8 for
  the same steps: a quarter of the tokens, what a peer would reach without the swarm).

The seed fixes initialisation and data order, not which experts a peer trains: with the default
``experts.placement: auto`` peers take the least-covered experts as they join, ties broken by their
(fresh) peer ids, so a swarm arm is not exactly repeatable at one seed (two runs of ``default`` at 100
steps, seed 0: 6.727 and 6.700). The spread over seeds includes that.

Partial residency is measured by ``benchmarks/residency.py`` (its peers' checkpoints hold only their
own experts, so this scorer cannot load them one at a time).

Per arm: the final validation loss (mean and min-max over seeds), the gap to its centralized baseline
(per seed, then mean and min-max), MB sent + received per peer per sync round and over the whole run, and per-peer training
memory (weights, gradients and AdamW state, from the peers' own ``measure_memory``; the host-side sync
state is listed apart). Prints a table, writes ``benchmarks/results/quality/<variant>.json`` (default
``main``) and plots the gap against bytes and against memory to ``<variant>.png`` beside it. With ``--add``
the arms run are merged into the stored result of the same variant and setup (same config, steps and
validation), so the table can be filled over several sessions: only a file this script wrote is merged
(``benchmarks/lab/results.py``), and its provenance lists every command that contributed (``merged``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from benchmarks import convergence  # the scorer and the lockstep launcher
from benchmarks.lab import results
from benchmarks.lab.spread import spread
from dht.node import sigterm_as_interrupt
from p2p_spes.config import load_config

MB = 1e6


@dataclass(frozen=True)
class Arm:
    """One arm: the overrides it adds to the defaults (``None``: centralized), its number of peers, and
    ``train`` overrides that apply to centralized and swarm alike (the optimizer, say)."""

    name: str
    overrides: tuple[str, ...] | None
    peers: int = 4
    baseline: str = "centralized"
    knob: str = ""
    train: tuple[str, ...] = ()


MUON = ("train.optimizer=muon", "train.muon_adamw_lr_scale=4")
MUON_4X = (*MUON, "train.muon_ns_steps=5")  # the default when these arms first ran
MUON_4X_NOCLIP = (*MUON_4X, "train.grad_clip=0")
MUON_4X_NS3 = (*MUON, "train.muon_ns_steps=3")
ARMS = {
    a.name: a
    for a in (
        Arm("centralized", None, knob="one process, batch 32"),
        Arm("default", (), knob="embedded swarm defaults, AdamW"),
        Arm("sync-10", ("swarm.sync_steps=10",), knob="sync interval"),
        Arm("sync-25", ("swarm.sync_steps=25",), knob="sync interval"),
        Arm("sync-100", ("swarm.sync_steps=100",), knob="sync interval"),
        Arm("replicas-2", ("swarm.replicas=2",), knob="replicas per expert"),
        Arm("full-replicas", ("swarm.experts_per_peer=8", "swarm.merge_interval=0"), knob="replicas per expert"),
        Arm(
            "nesterov",
            ("swarm.outer_optimizer=nesterov", "swarm.outer_lr=0.7", "swarm.outer_momentum=0.9"),
            knob="outer optimizer",
        ),
        Arm("no-merge", ("swarm.merge_interval=0",), knob="warm-up merging"),
        Arm("decayed-lb", ("experts.decayed_lb=true",), knob="decayed load balancing"),
        Arm("shared-data", ("data.partition=shared",), knob="data partitions"),
        Arm("fp16", ("swarm.compression=fp16",), knob="compression"),
        Arm("int8", ("swarm.compression=int8",), knob="compression"),
        Arm("int4", ("swarm.compression=int4",), knob="compression"),
        Arm("topk", ("swarm.compression=topk",), knob="compression"),
        Arm(
            "topk-dense",
            ("swarm.compression=topk", "swarm.topk_result_fraction=0.0625"),
            knob="compression: topk, groups' averaged parts at up to 16 of 256 values a block",
        ),
        Arm(
            "int8-keep",
            ("swarm.compression=int8", "swarm.keep_local_progress=true"),
            knob="compression: int8, members keep what their messages have not carried",
        ),
        Arm(
            "topk-keep",
            ("swarm.compression=topk", "swarm.keep_local_progress=true"),
            knob="compression: topk, members keep what their messages have not carried",
        ),
        Arm(
            "outer-sgd-2",
            ("swarm.outer_optimizer=nesterov", "swarm.outer_lr=2.0", "swarm.outer_momentum=0.0"),
            knob="probe: twice the averaged step",
        ),
        Arm("lr-2x", ("train.lr=6e-3",), knob="probe: inner lr 6e-3 (default 3e-3)"),
        Arm("alone", None, peers=1, knob="probe: one peer alone, a quarter of the tokens"),
        Arm("centralized-2", None, peers=2, baseline="centralized-2", knob="one process, batch 16"),
        Arm("default-2", (), peers=2, baseline="centralized-2", knob="embedded swarm defaults, AdamW, 2 peers"),
        Arm(
            "centralized-muon",
            None,
            baseline="centralized-muon",
            knob="one process, batch 32, Muon",
            train=("train.optimizer=muon",),
        ),
        Arm(
            "muon",
            (),
            baseline="centralized-muon",
            knob="inner optimizer: Muon (vs centralized-muon)",
            train=("train.optimizer=muon",),
        ),
        Arm(
            "muon-int8",
            ("swarm.compression=int8",),
            baseline="centralized-muon",
            knob="Muon with int8 pseudo-gradients (spes-1b's and spes-7b's compression)",
            train=("train.optimizer=muon",),
        ),
        Arm(
            "centralized-2-muon",
            None,
            peers=2,
            baseline="centralized-2-muon",
            knob="one process, batch 16, Muon",
            train=("train.optimizer=muon",),
        ),
        Arm(
            "muon-2",
            (),
            peers=2,
            baseline="centralized-2-muon",
            knob="inner optimizer: Muon, 2 peers",
            train=("train.optimizer=muon",),
        ),
        # today's defaults: Muon, and the parameters AdamW steps (embeddings, head, router, norms) at 4x lr
        Arm(
            "centralized-muon-4x",
            None,
            baseline="centralized-muon-4x",
            train=MUON_4X,
            knob="one process, batch 32, Muon, train.muon_adamw_lr_scale 4",
        ),
        Arm(
            "muon-4x",
            (),
            baseline="centralized-muon-4x",
            train=MUON_4X,
            knob="Muon, train.muon_adamw_lr_scale 4 (vs centralized-muon-4x)",
        ),
        Arm(
            "muon-4x-nesterov",
            ("swarm.outer_optimizer=nesterov", "swarm.outer_lr=0.7", "swarm.outer_momentum=0.9"),
            baseline="centralized-muon-4x",
            train=MUON_4X,
            knob="outer optimizer: Nesterov, with today's Muon defaults",
        ),
        Arm(
            "centralized-2-muon-4x",
            None,
            peers=2,
            baseline="centralized-2-muon-4x",
            train=MUON_4X,
            knob="one process, batch 16, Muon, train.muon_adamw_lr_scale 4",
        ),
        Arm(
            "muon-4x-2",
            (),
            peers=2,
            baseline="centralized-2-muon-4x",
            train=MUON_4X,
            knob="Muon, train.muon_adamw_lr_scale 4, 2 peers",
        ),
        # today's defaults with 3 Newton-Schulz iterations instead of 5, centralized and swarm alike
        Arm(
            "centralized-muon-4x-ns3",
            None,
            baseline="centralized-muon-4x-ns3",
            train=MUON_4X_NS3,
            knob="one process, batch 32, today's Muon defaults, train.muon_ns_steps 3",
        ),
        Arm(
            "muon-4x-ns3",
            (),
            baseline="centralized-muon-4x-ns3",
            train=MUON_4X_NS3,
            knob="today's Muon defaults, train.muon_ns_steps 3 (vs centralized-muon-4x-ns3)",
        ),
        Arm(
            "centralized-2-muon-4x-ns3",
            None,
            peers=2,
            baseline="centralized-2-muon-4x-ns3",
            train=MUON_4X_NS3,
            knob="one process, batch 16, today's Muon defaults, train.muon_ns_steps 3",
        ),
        Arm(
            "muon-4x-2-ns3",
            (),
            peers=2,
            baseline="centralized-2-muon-4x-ns3",
            train=MUON_4X_NS3,
            knob="today's Muon defaults, train.muon_ns_steps 3, 2 peers",
        ),
        # today's defaults without gradient clipping, centralized and swarm alike
        Arm(
            "centralized-muon-4x-noclip",
            None,
            baseline="centralized-muon-4x-noclip",
            train=MUON_4X_NOCLIP,
            knob="one process, batch 32, today's Muon defaults, train.grad_clip 0",
        ),
        Arm(
            "muon-4x-noclip",
            (),
            baseline="centralized-muon-4x-noclip",
            train=MUON_4X_NOCLIP,
            knob="today's Muon defaults, train.grad_clip 0 (vs centralized-muon-4x-noclip)",
        ),
        Arm(
            "centralized-2-muon-4x-noclip",
            None,
            peers=2,
            baseline="centralized-2-muon-4x-noclip",
            train=MUON_4X_NOCLIP,
            knob="one process, batch 16, today's Muon defaults, train.grad_clip 0",
        ),
        Arm(
            "muon-4x-2-noclip",
            (),
            peers=2,
            baseline="centralized-2-muon-4x-noclip",
            train=MUON_4X_NOCLIP,
            knob="today's Muon defaults, train.grad_clip 0, 2 peers",
        ),
    )
}


def run_metrics(result: dict[str, Any]) -> dict[str, float | None]:
    """MB per peer per sync round and over the whole run, and per-peer training memory (MB) of one run."""
    swarm = result["swarm"]
    if swarm is None:
        return {
            "mb_per_round": 0.0,
            "mb_per_run": 0.0,
            "memory_mb": result["memory"]["total"] / MB,
            "sync_memory_mb": 0.0,
        }
    per_round = [
        (p["bytes_sent"] + p["bytes_received"]) / p["rounds_joined"] for p in swarm["peers"] if p.get("rounds_joined")
    ]
    per_run = [p["bytes_sent"] + p["bytes_received"] for p in swarm["peers"]]
    memory = [p["memory"]["total"] for p in swarm["peers"] if p.get("memory")]
    sync = [p["sync_memory"]["total"] for p in swarm["peers"] if p.get("sync_memory")]
    return {
        "mb_per_round": statistics.fmean(per_round) / MB if per_round else None,
        "mb_per_run": statistics.fmean(per_run) / MB,
        "memory_mb": max(memory) / MB if memory else None,
        "sync_memory_mb": max(sync) / MB if sync else None,
    }


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per arm: final loss over seeds, the paired gap to its baseline, bytes and memory."""
    out: dict[str, Any] = {}
    for name, seeds in runs.items():
        finals = {r["seed"]: r["final"] for r in seeds}
        metrics = [run_metrics(r) for r in seeds]
        out[name] = {
            "final": spread(list(finals.values())),
            "finals": finals,
            "seeds": sorted(finals),
            **{
                k: statistics.fmean(m[k] for m in metrics if m[k] is not None)
                if any(m[k] is not None for m in metrics)
                else None
                for k in metrics[0]
            },
            "rounds": convergence.add_counts([r["swarm"]["round_outcomes"] for r in seeds if r["swarm"]]),
            "tokens_trained": [r["tokens_trained"] for r in seeds],
            "not_identical_steps": sorted({s for r in seeds for s, n in r["distinct_weights"].items() if n > 1}),
        }
    for name, o in out.items():
        base = out.get(ARMS[name].baseline) if name in ARMS else None
        paired = [o["finals"][s] / base["finals"][s] - 1 for s in o["finals"] if base and s in base["finals"]]
        o["gap"] = spread(paired) if paired else None
    return out


def print_table(console: Console, summary: dict[str, Any], steps: int, batch: int, seq: int) -> None:
    table = Table(
        title=f"validation loss at equal tokens ({steps} steps of P x {batch} x {seq} tokens; "
        "gap: to the centralized run of the same tokens, per seed, mean and min-max)"
    )
    for col in (
        "arm",
        "knob",
        "peers",
        "seeds",
        "final loss (min-max)",
        "gap to centralized",
        "MB / peer / round",
        "MB / peer / run",
        "memory / peer MB",
        "rounds",
    ):
        table.add_column(col, justify="left" if col in ("arm", "knob", "rounds") else "right")
    for name, o in summary.items():
        arm = ARMS.get(name, Arm(name, ()))
        f, gap = o["final"], o["gap"]
        table.add_row(
            name,
            arm.knob,
            str(arm.peers),
            ",".join(map(str, o["seeds"])),
            f"{f['mean']:.4f} ({f['min']:.4f}-{f['max']:.4f})",
            "-"
            if gap is None or name == arm.baseline
            else f"{gap['mean']:+.2%} ({gap['min']:+.2%} .. {gap['max']:+.2%})",
            "-" if o["mb_per_round"] is None or arm.overrides is None else f"{o['mb_per_round']:.2f}",
            "-" if arm.overrides is None else f"{o['mb_per_run']:.0f}",
            "-" if o["memory_mb"] is None else f"{o['memory_mb']:.2f}",
            ", ".join(f"{k} {v}" for k, v in sorted(o["rounds"].items())) or "-",
        )
    console.print(table)


def plot(summary: dict[str, Any], out: Path) -> bool:
    """The gap to centralized against bytes per peer over the run and against per-peer memory, one
    point per swarm arm."""
    plt = convergence.pyplot()
    if plt is None:
        return False
    points = {
        n: o for n, o in summary.items() if o["gap"] is not None and ARMS.get(n, Arm(n, ())).overrides is not None
    }
    if not points:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, key, label in (
        (axes[0], "mb_per_run", "MB sent + received per peer over the run (log)"),
        (axes[1], "memory_mb", "training memory per peer (MB: weights, gradients, AdamW)"),
    ):
        for name, o in points.items():
            if o[key] is None:
                continue
            g = o["gap"]
            y = 100 * g["mean"]
            ax.errorbar(o[key], y, yerr=[[y - 100 * g["min"]], [100 * g["max"] - y]], fmt="o", capsize=3)
            ax.annotate(name, (o[key], y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylabel("val loss above centralized, % (bars: seeds)")
        ax.grid(alpha=0.3)
    axes[0].set_xscale("log")
    axes[0].set_title("gap against traffic")
    axes[1].set_title("gap against memory")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return True


def load_previous(variant: str, setup_key: dict[str, Any], base: Path | None = None) -> results.Result | None:
    """The stored result ``--add`` merges into (None: none yet); refused when this script did not write it
    (``results.own``: a file without provenance, or another script's) or measured it with another setup."""
    if not results.path("quality", variant, base=base).exists():
        return None
    try:
        previous = results.own("quality", variant, base=base)
    except results.ResultError as exc:
        raise SystemExit(f"--add: {exc}") from None
    differs = [k for k in setup_key if previous.payload.get(k) != json.loads(json.dumps(setup_key[k]))]
    if differs:
        raise SystemExit(
            f"{previous.path} was measured with another {', '.join(differs)}; run without --add, or with another "
            "--variant"
        )
    return previous


def setup(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """The overrides every arm shares (the convergence benchmark's model; schedule and checkpoints at
    ``--eval-every``) and the scored steps. Sync intervals, merging and the rest stay at their defaults."""
    boundaries = list(range(args.eval_every, args.steps + 1, args.eval_every))
    common = [
        *convergence.CONFIG,
        *convergence.schedule(args.steps),
        f"train.checkpoint_interval={args.eval_every}",
        f"train.keep_checkpoints={len(boundaries) + 1}",
        f"train.eval_interval={args.steps}",
        "train.eval_batches=1",
        *args.extra,
    ]
    return common, boundaries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument(
        "--eval-every",
        type=int,
        default=100,
        help="scored steps (a multiple of every arm's sync interval: 10, 25, 50, 100)",
    )
    parser.add_argument("--batch", type=int, default=8, help="per-peer batch size")
    parser.add_argument("--val-windows", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    results.add_variant(parser, help="writes benchmarks/results/quality/<variant>.json and .png (default main)")
    parser.add_argument("--add", action="store_true", help="merge into an existing result of the same setup")
    parser.add_argument("--keep-runs", action="store_true")
    parser.add_argument(
        "--report", action="store_true", help="run nothing: the table, plot and summary of the stored runs"
    )
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="K=V")
    args = parser.parse_args()
    sigterm_as_interrupt()  # SIGTERM stops the runs this benchmark started, as Ctrl-C does
    if args.report:
        args.arms, args.add = [], True
    if args.steps % args.eval_every:
        parser.error("--steps must be a multiple of --eval-every")
    for name in args.arms:
        sync = [o for o in ARMS[name].overrides or () if o.startswith("swarm.sync_steps=")]
        if sync and args.eval_every % int(sync[0].split("=")[1]):
            parser.error(f"--eval-every {args.eval_every} is not a multiple of {name}'s sync interval")
    writer = results.start("quality", args.variant, seeds=[] if args.report else args.seeds)
    # convergence.run_arm's knobs: lockstep pacing, one thread per centralized run
    args.free_pacing, args.threads, args.peers = False, 1, 4
    common, boundaries = setup(args)
    cfg = load_config(None, common)
    seq = cfg.model.max_seq_len
    png = writer.sibling(".png")
    torch.set_num_threads(1)
    validation = convergence.Validation(seq, args.val_windows)
    setup_key = {"config": common, "steps": args.steps, "batch": args.batch, "validation": validation.describe}
    previous = load_previous(args.variant, setup_key) if args.add else None
    merged = [previous] if previous else []
    console = Console(width=220)
    console.print(
        f"{len(args.arms)} arms x {len(args.seeds)} seeds, {args.steps} steps; scoring on "
        f"{validation.count} validation windows"
    )
    work = Path(tempfile.mkdtemp(prefix="p2p-spes-quality-"))
    runs: dict[str, list[dict[str, Any]]] = {
        n: list(r) for n, r in (previous.payload if previous else {}).get("runs", {}).items()
    }
    t_start = time.monotonic()
    save = partial(write_results, writer, setup_key, runs, merged)
    try:
        run_all(args, common, work, validation, boundaries, runs, save, console, t_start)
    finally:
        if not args.keep_runs:
            shutil.rmtree(work, ignore_errors=True)
    summary = save()
    png.parent.mkdir(parents=True, exist_ok=True)
    print_table(console, summary, args.steps, args.batch, seq)
    plotted = plot(summary, png)
    console.print(
        f"wrote {writer.file}" + (f" and {png}" if plotted else "") + f" ({(time.monotonic() - t_start) / 60:.1f} min)"
    )


def run_all(
    args: argparse.Namespace,
    common: list[str],
    work: Path,
    validation: convergence.Validation,
    boundaries: list[int],
    runs: dict[str, list[dict[str, Any]]],
    save: Callable[[], Any],
    console: Console,
    t_start: float,
) -> None:
    """Every arm at every seed (seed-major: an interrupted run has every arm at the first seeds),
    the results file rewritten (``save``) after each run."""
    for seed in args.seeds:
        for name in args.arms:
            arm = ARMS[name]
            extra = None if arm.overrides is None else list(arm.overrides)
            result = convergence.run_arm(
                name, seed, args, [*common, *arm.train], work, validation, boundaries, extra=extra, peers=arm.peers
            )
            runs[name] = [r for r in runs.get(name, []) if r["seed"] != seed] + [convergence.jsonable(result)]
            console.print(
                f"{name} seed {seed}: final validation loss {result['final']:.4f} "
                f"({(time.monotonic() - t_start) / 60:.1f} min so far)"
            )
            save()  # after every run: nothing lost


def write_results(
    writer: results.Run,
    setup_key: dict[str, Any],
    runs: dict[str, list[dict[str, Any]]],
    merged: list[results.Result],
) -> dict[str, Any]:
    """The setup, every run and their summary, through ``writer`` (``merged``: the stored result the runs
    were added to); returns the summary."""
    summary = summarise(runs)
    writer.write(
        {
            **setup_key,
            "arms": {
                n: {
                    "overrides": ARMS[n].overrides,
                    "train": ARMS[n].train,
                    "peers": ARMS[n].peers,
                    "knob": ARMS[n].knob,
                }
                for n in runs
            },
            "summary": convergence.jsonable(summary),
            "runs": runs,
        },
        merged=merged,
    )
    return summary


if __name__ == "__main__":
    main()
