"""The round protocol at 100 and 1,000 peers, simulated (``benchmarks/lab/simulation.py``): rounds applied, time, bytes.

    python -m benchmarks.simulate                           # 100 and 1,000 peers, flat and grid, retries 0, 1 and 2, 3 seeds
    python -m benchmarks.simulate --peers 1000 --fail-prob 0.02 --rounds 100 --variant p1000-f002

Sizes are spes-1b's (shared 261M parameters, 16 experts of 56.6M), top-k compression, links uniform in
10-100 Mbit/s, step times log-normal around 1 s (sigma 0.3), a round every 50 steps, each live peer
failing at a constant rate, ``--fail-prob`` times per failure-free round on average (so a round
stretched by a retry meets more failures; half killed and restarted 3 rounds later, half frozen for
the round). Group formation, pacing, deadlines, message sizes, placement and healing are
the project's own functions; time and the network are modelled (the module docstring says how).
Per configuration: the share of rounds whose shared average was applied (mean and range over seeds),
the share of peer-rounds applied among peers that did not fail, the share of the members' contributions
the applied averages hold (a grid, ``--group-size`` 16, may drop a lost member's row from some
columns; a flat group counts all), rounds that needed a retry, median and
90th-percentile seconds per round, MB per peer per round. Writes ``benchmarks/results/simulate/<variant>.json``
(``--variant``, default ``main``).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from benchmarks.lab import results
from benchmarks.lab.simulation import SimConfig, simulate
from p2p_spes.config import SwarmConfig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--retries", type=int, nargs="+", default=[0, 1, 2], help="swarm.group_retries values")
    parser.add_argument(
        "--group-size", type=int, nargs="+", default=[0, 16], help="swarm.group_size values (0: one flat shared group)"
    )
    parser.add_argument("--fail-prob", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    results.add_variant(parser)
    args = parser.parse_args()
    writer = results.start("simulate", args.variant, seeds=args.seeds)
    rows = []
    t0 = time.monotonic()
    for n, size, retries in itertools.product(args.peers, args.group_size, args.retries):
        sw = SwarmConfig(
            compression="topk", matchmaking_time=30.0, averaging_timeout=600.0, group_retries=retries, group_size=size
        )
        runs = [
            simulate(SimConfig(peers=n, rounds=args.rounds, fail_prob=args.fail_prob, swarm=sw, seed=s)).summary()
            for s in args.seeds
        ]
        rows.append(
            {
                "peers": n,
                "group_size": size,
                "group_retries": retries,
                "runs": runs,
                **{k: statistics.fmean(r[k] for r in runs) for k in runs[0] if k not in ("peers", "rounds")},
            }
        )
    table = Table(
        title=f"simulated rounds: spes-1b sizes, topk, {args.rounds} rounds, fail probability "
        f"{args.fail_prob:g} per peer per round, seeds {args.seeds} (mean; range)"
    )
    for col in (
        "peers",
        "group size",
        "retries",
        "rounds applied",
        "peer-rounds applied",
        "contributions counted",
        "rounds retried",
        "s per round (median / p90)",
        "MB per peer per round",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        applied = [x["rounds_applied"] for x in r["runs"]]
        table.add_row(
            str(r["peers"]),
            str(r["group_size"] or "flat"),
            str(r["group_retries"]),
            f"{100 * r['rounds_applied']:.1f}% ({100 * min(applied):.0f}-{100 * max(applied):.0f}%)",
            f"{100 * r['peer_rounds_applied']:.1f}%",
            f"{100 * r['counted_mean']:.1f}%",
            f"{100 * r['retried_rounds']:.0f}%",
            f"{r['seconds_per_round_median']:.1f} / {r['seconds_per_round_p90']:.1f}",
            f"{r['mb_per_peer_round']:.1f}",
        )
    Console(width=150).print(table)
    default = asdict(SimConfig())
    default.pop("swarm")
    out = writer.write(
        {
            "model": default,
            "fail_prob": args.fail_prob,
            "rounds": args.rounds,
            "seeds": args.seeds,
            "wall_seconds": round(time.monotonic() - t0, 1),
            "results": rows,
        }
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
