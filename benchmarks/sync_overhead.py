"""How much of a peer's wall time goes to syncing, at sync_steps 100 and 25.

    python -m benchmarks.sync_overhead                      # 100 and 25, ~5 min
    python -m benchmarks.sync_overhead --intervals 40 10 --steps 200 --variant every40-10

A 2-peer loopback swarm per interval; from each peer's metrics (every step logged with its wall clock
and compute time, every round with its duration): the share of wall time not spent in training steps
(rounds, and anything else outside a step), the wall time per step against the first interval's, and
the compute time of the step right after a round against the others. A round stops training for its
duration (rounds overlapped with training were withdrawn: docs/limits.md). Writes
``benchmarks/results/sync_overhead/<variant>.json`` (``--variant``, default ``main``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.lab import results
from p2p_spes.config import load_config
from p2p_spes.local_swarm import LocalSwarm
from p2p_spes.metrics_log import read_metrics

CONFIG = [
    "model.d_model=128",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.max_seq_len=64",
    "moe.num_experts=8",
    "moe.ffn_dim=256",
    "train.batch_size=8",
    "train.warmup_steps=5",
    "train.eval_interval=100000",
    "train.log_interval=1",
    "train.checkpoint_interval=100000",
    "swarm.matchmaking_time=3",
    "swarm.averaging_timeout=20",
]


def measure(interval: int, steps: int, run_dir: Path) -> dict[str, float]:
    name = f"every{interval}"
    swarm = LocalSwarm(
        None,
        CONFIG + [f"swarm.sync_steps={interval}", f"train.max_steps={steps}"],
        peers=2,
        run_dir=run_dir / name,
        run_id=f"overhead-{name}",
    )
    swarm.run(timeout=1800, stagger=1.0)
    overheads, per_step, during, between, rounds, joined = [], [], [], [], [], 0
    for i in range(2):
        records = read_metrics(run_dir / name / f"peer{i}")
        syncs = [r for r in records if "sync_round" in r and r["step"] > interval]  # after joining
        steps_ = [r for r in records if "step_time_s" in r and r["step"] > interval]
        if not syncs or not steps_:
            continue
        wall = steps_[-1]["time"] - steps_[0]["time"]
        compute = sum(r["step_time_s"] for r in steps_[1:])
        overheads.append(1 - compute / wall)
        per_step.append(wall / (len(steps_) - 1))
        rounds += [r["sync_seconds"] for r in syncs]
        joined += sum(r["shared_ok"] for r in syncs)
        busy = {r["step"] + 1 for r in syncs}  # the step right after each round, against all others
        for r in steps_:
            (during if r["step"] in busy else between).append(r["step_time_s"])
    return {
        "overhead_fraction": statistics.fmean(overheads),
        "wall_s_per_step": statistics.fmean(per_step),
        "round_seconds": statistics.median(rounds),
        "rounds_joined": joined,
        "step_during_round_s": statistics.median(during),
        "step_between_s": statistics.median(between),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--intervals", type=int, nargs="+", default=(100, 25), help="the sync_steps to compare")
    parser.add_argument("--steps", type=int, default=400)
    results.add_variant(parser)
    args = parser.parse_args()
    writer = results.start("sync_overhead", args.variant, seeds=[load_config(None, CONFIG).train.seed])  # config's
    run_dir = Path(tempfile.mkdtemp(prefix="p2p-spes-overhead-"))
    table = Table(title="sync overhead, 2 loopback peers")
    for col in (
        "sync_steps",
        "rounds",
        "wall time not computing",
        "wall s / step",
        "vs the first interval",
        "median round s",
        "step after a round s",
        "step otherwise s",
    ):
        table.add_column(col, justify="right")
    rows: dict[str, dict[str, float]] = {}
    for interval in args.intervals:
        got = rows[str(interval)] = measure(interval, args.steps, run_dir)
        base = rows[str(args.intervals[0])]
        table.add_row(
            str(interval),
            str(got["rounds_joined"]),
            f"{got['overhead_fraction']:.1%}",
            f"{got['wall_s_per_step']:.3f}",
            f"{got['wall_s_per_step'] / base['wall_s_per_step']:.2f}x",
            f"{got['round_seconds']:.2f}",
            f"{got['step_during_round_s']:.3f}",
            f"{got['step_between_s']:.3f}",
        )
    console = Console(width=140)
    console.print(table)
    out = writer.write(
        {
            "config": CONFIG,
            "steps": args.steps,
            "results": rows,
        }
    )
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
