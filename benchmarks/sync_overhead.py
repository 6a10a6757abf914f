"""How much of a peer's wall time goes to syncing, at two sync intervals (4:1, like 100 and 25).

    python benchmarks/sync_overhead.py                          # sync every 40 and every 10 steps, ~5 min
    python benchmarks/sync_overhead.py --intervals 100 25 --steps 200

A 2-peer loopback swarm per interval; from each peer's metrics (every step logged with its wall
clock and compute time, every round with its duration): the fraction of wall time spent inside sync
rounds, and the compute time of the step right after a round against the steps between rounds (to
see whether a round slows the next step). Averaging blocks training today: a peer computes nothing
while its round runs, so the sync fraction is time lost. Writes ``benchmarks/results/sync_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2p_spes.chaos import read_metrics  # noqa: E402
from p2p_spes.local_swarm import LocalSwarm  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "sync_overhead.json"
CONFIG = [
    "model.d_model=128", "model.num_layers=2", "model.num_heads=4", "model.max_seq_len=64",
    "moe.num_experts=8", "moe.ffn_dim=256", "train.batch_size=8", "train.warmup_steps=5",
    "train.eval_interval=100000", "train.log_interval=1", "train.checkpoint_interval=100000",
    "swarm.matchmaking_time=3", "swarm.averaging_timeout=20",
]


def measure(interval: int, steps: int, run_dir: Path) -> dict[str, float]:
    swarm = LocalSwarm(None, CONFIG + [f"swarm.sync_steps={interval}", f"train.max_steps={steps}"], peers=2,
                       run_dir=run_dir / f"every{interval}", run_id=f"overhead-{interval}")
    try:
        swarm.start(stagger=1.0)
        codes = swarm.wait(timeout=900)
    finally:
        swarm.stop()
    if codes != [0, 0]:
        raise SystemExit(f"a peer failed ({codes}); logs in {run_dir}")
    fractions, after, between, rounds = [], [], [], []
    for i in range(2):
        records = read_metrics(run_dir / f"every{interval}" / f"peer{i}")
        syncs = [r for r in records if "sync_round" in r and r["step"] > interval]  # after joining
        steps_ = [r for r in records if "step_time_s" in r and r["step"] > interval]
        if not syncs or not steps_:
            continue
        wall = steps_[-1]["time"] - steps_[0]["time"]
        fractions.append(sum(r["sync_seconds"] for r in syncs) / wall)
        rounds += [r["sync_seconds"] for r in syncs]
        for r in steps_:
            (after if r["step"] % interval == 1 else between).append(r["step_time_s"])
    return {
        "sync_fraction": statistics.fmean(fractions), "round_seconds": statistics.median(rounds),
        "step_after_sync_s": statistics.median(after), "step_between_s": statistics.median(between),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--intervals", type=int, nargs=2, default=(40, 10), help="the two sync_steps to compare")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="p2p-spes-overhead-"))
    table = Table(title="sync overhead, 2 loopback peers (averaging blocks training)")
    for col in ("sync_steps", "share of wall time in sync", "median round s", "step after a round s",
                "step between rounds s", "after / between"):
        table.add_column(col, justify="right")
    rows = {}
    for interval in args.intervals:
        got = measure(interval, args.steps, run_dir)
        rows[interval] = got
        table.add_row(str(interval), f"{got['sync_fraction']:.1%}", f"{got['round_seconds']:.2f}",
                      f"{got['step_after_sync_s']:.3f}", f"{got['step_between_s']:.3f}",
                      f"{got['step_after_sync_s'] / got['step_between_s']:.2f}x")
    console = Console(width=120)
    console.print(table)
    a, b = args.intervals
    console.print(f"syncing every {b} instead of every {a} steps costs {rows[b]['sync_fraction'] / rows[a]['sync_fraction']:.1f}x "
                  "the share of wall time")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"command": "python benchmarks/sync_overhead.py " + " ".join(sys.argv[1:]),
                                   "config": CONFIG, "steps": args.steps, "results": rows}, indent=1))
    console.print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
