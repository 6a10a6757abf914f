"""Convergence at equal tokens: centralized training against 4-peer swarms, side by side in one run.

    python benchmarks/convergence.py                 # ~30 min on 2 cores
    python benchmarks/convergence.py --steps 100 --arms centralized spes   # a quick look

Every arm trains the same model config on the same embedded corpus with the same token budget:

* ``centralized``: one process, the full model, batch P x b for N steps;
* ``spes``: P peers, each training E/P experts (SPES subsets), per-expert averaging groups, warm-up
  merging on, batch b for N steps each;
* ``diloco``: P full-replica peers (every peer trains every expert), plain averaging (FedAvg);
* ``spes-no-merge``: ``spes`` without the warm-up merging;
* ``spes-partial``: ``spes`` with partial residency (peers hold only their own experts; merging
  needs every expert, so it is off as in ``spes-no-merge``).

Swarm peers evaluate right after each round (``eval_interval = sync_steps``), on the weights the
round agreed on, so all points are at equal tokens: P x b x seq_len x step. Prints the validation
loss at each round and the gap to centralized, writes ``benchmarks/results/convergence.json`` and
plots the curves to ``benchmarks/results/convergence.png`` (needs matplotlib: ``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2p_spes.chaos import read_metrics
from p2p_spes.local_swarm import LocalSwarm

RESULTS = Path(__file__).parent / "results"
# the embedded tiny model, narrowed so that five arms (four of them 4-peer swarms) fit ~30 min on 2 cores
CONFIG = [
    "model.d_model=128", "model.num_layers=2", "model.num_heads=4", "model.max_seq_len=64",
    "moe.num_experts=8", "moe.ffn_dim=256", "train.warmup_steps=10", "train.log_interval=10",
    "train.eval_batches=16", "swarm.matchmaking_time=3", "swarm.averaging_timeout=20",
]
ARMS = {
    "centralized": [],
    "spes": ["swarm.merge_interval={merge}"],
    "diloco": ["swarm.experts_per_peer={experts}", "swarm.merge_interval=0"],
    "spes-no-merge": ["swarm.merge_interval=0"],
    "spes-partial": ["swarm.merge_interval=0", "swarm.residency=partial"],
}


def run_centralized(overrides: list[str], run_dir: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "p2p_spes", "train", "--no-progress", "--run-dir", str(run_dir)]
    for item in overrides + ["train.threads=2"]:
        cmd += ["--set", item]
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        proc = subprocess.run(cmd, check=False, stdout=log, stderr=subprocess.STDOUT, timeout=3600, start_new_session=True)
    if proc.returncode:
        raise SystemExit(f"centralized training failed; see {run_dir.parent / run_dir.name}.log")
    return [r for r in read_metrics(run_dir) if "val_loss" in r]


def run_swarm(overrides: list[str], peers: int, run_dir: Path, run_id: str) -> list[list[dict]]:
    swarm = LocalSwarm(None, overrides, peers=peers, run_dir=run_dir, run_id=run_id)
    swarm.run(timeout=3600, stagger=1.0)
    return [[r for r in read_metrics(run_dir / f"peer{i}") if "val_loss" in r] for i in range(peers)]


def curve(per_peer: list[list[dict]]) -> dict[int, float]:
    """Mean validation loss of the peers at each step all of them evaluated."""
    steps = set.intersection(*({r["step"] for r in records} for records in per_peer))
    return {s: statistics.fmean(next(r["val_loss"] for r in records if r["step"] == s) for records in per_peer)
            for s in sorted(steps)}


def plot(curves: dict[str, dict[int, float]], tokens_per_step: int, out: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[bench]): no plot")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in curves.items():
        ax.plot([s * tokens_per_step / 1e6 for s in points], list(points.values()), marker="o", markersize=3, label=name)
    ax.set_xlabel("tokens seen by the whole run (millions)")
    ax.set_ylabel("validation loss")
    ax.set_title("convergence at equal tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=240, help="steps per peer (centralized: the same, P x batch)")
    parser.add_argument("--batch", type=int, default=8, help="per-peer batch size b")
    parser.add_argument("--sync-steps", type=int, default=20)
    parser.add_argument("--merge-interval", type=int, default=40)
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="K=V")
    args = parser.parse_args()

    seq = int(next(o for o in CONFIG if o.startswith("model.max_seq_len=")).split("=")[1])
    experts = int(next(o for o in CONFIG if o.startswith("moe.num_experts=")).split("=")[1])
    common = CONFIG + [f"train.max_steps={args.steps}", f"swarm.sync_steps={args.sync_steps}",
                       f"train.eval_interval={args.sync_steps}", f"train.checkpoint_interval={args.steps}",
                       f"swarm.merge_decay_steps={args.steps}", *args.extra]
    work = Path(tempfile.mkdtemp(prefix="p2p-spes-convergence-"))
    curves: dict[str, dict[int, float]] = {}
    seconds: dict[str, float] = {}
    for arm in args.arms:
        t0 = time.monotonic()
        if arm == "centralized":
            overrides = common + [f"train.batch_size={args.peers * args.batch}"]
            curves[arm] = {r["step"]: r["val_loss"] for r in run_centralized(overrides, work / arm)}
        else:
            extra = [o.format(merge=args.merge_interval, experts=experts) for o in ARMS[arm]]
            curves[arm] = curve(run_swarm(common + [f"train.batch_size={args.batch}", *extra], args.peers, work / arm, arm))
        seconds[arm] = time.monotonic() - t0
        print(f"{arm}: {seconds[arm]:.0f} s, final validation loss {list(curves[arm].values())[-1]:.4f}", flush=True)

    tokens_per_step = args.peers * args.batch * seq
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    table = Table(title=f"validation loss at equal tokens ({args.peers} peers x batch {args.batch} x {seq} tokens per step; "
                        f"centralized: batch {args.peers * args.batch})")
    table.add_column("tokens", justify="right")
    for arm in curves:
        table.add_column(arm, justify="right")
    base = curves.get("centralized")
    for s in steps:
        cells = []
        for arm, points in curves.items():
            gap = f" ({(points[s] / base[s] - 1):+.1%})" if base and arm != "centralized" else ""
            cells.append(f"{points[s]:.3f}{gap}")
        table.add_row(f"{s * tokens_per_step / 1e6:.2f}M", *cells)
    console = Console(width=160)
    console.print(table)
    final = {arm: points[steps[-1]] for arm, points in curves.items()}
    gaps = {arm: final[arm] / final["centralized"] - 1 for arm in final} if "centralized" in final else {}
    RESULTS.mkdir(parents=True, exist_ok=True)
    plotted = plot(curves, tokens_per_step, RESULTS / "convergence.png")
    (RESULTS / "convergence.json").write_text(json.dumps({
        "command": "python benchmarks/convergence.py " + " ".join(sys.argv[1:]), "config": common,
        "peers": args.peers, "batch": args.batch, "tokens_per_step": tokens_per_step,
        "curves": {arm: {str(s): v for s, v in points.items()} for arm, points in curves.items()},
        "final_val_loss": final, "gap_to_centralized": gaps, "seconds": seconds,
        "plot": "convergence.png" if plotted else None,
    }, indent=1))
    console.print(f"wrote {RESULTS / 'convergence.json'}" + (f" and {RESULTS / 'convergence.png'}" if plotted else ""))


if __name__ == "__main__":
    main()
