"""Each compression mode on the shaped-link lab: seconds per round and the share of wall time computing.

    sudo .venv/bin/python benchmarks/wan_codecs.py                      # 4 peers x 20 Mbit/s, 6 codecs x 2, ~45 min
    sudo .venv/bin/python benchmarks/wan_codecs.py --codecs none topk --arms blocking

Runs ``benchmarks/wan.py`` (network namespaces, ``tbf`` caps, the tiny config, same seed and data for
every run) once per codec and arm (``blocking``: the round holds training up; ``overlap``:
``swarm.overlap``, the round runs beside training), one after another, and tabulates per run: rounds
in which every peer was a member, mean seconds per round (rounds after the last joiner started),
bytes sent + received per peer per round (the peer's groups, as client), the share of wall time each
peer spent computing (mean and range over peers), and whether all peers ended bit-identical.
Per-run JSON goes to ``benchmarks/results/wan_codecs/``, the table to ``benchmarks/results/wan_codecs/main.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.lab.wan_report import PeerReport, compare_final

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# each codec's overrides; topk-dense is topk with the groups' averaged parts at up to 16 of 256 values
CODECS = {name: [f"swarm.compression={name}"] for name in ("none", "fp16", "int8", "int4", "topk")}
CODECS["topk-dense"] = [*CODECS["topk"], "swarm.topk_result_fraction=0.0625"]


def summarize(run: dict) -> dict:
    """The row of one wan.py run: rounds with everyone, seconds and bytes per round, compute share."""
    peers = run["peers"]
    n = len(peers)
    joined = max(p["started_at"] for p in peers)
    began: dict[int, float] = {}
    for p in peers:
        for r in p["rounds"]:
            began[r["round"]] = min(began.get(r["round"], r["time"] - r["seconds"]), r["time"] - r["seconds"])
    after = [[r for r in p["rounds"] if began[r["round"]] >= joined] for p in peers]
    rounds = sorted({r["round"] for rows in after for r in rows})
    full = [
        k
        for k in rounds
        if all(
            any(r["round"] == k and r["members"] == n and r["outcome"] == "averaged" for r in rows) for rows in after
        )
    ]
    rows = [r for rows in after for r in rows]
    shares = [p["compute_share"] for p in peers]
    return {
        "rounds": len(rounds),
        "rounds_with_everyone": len(full),
        "seconds_per_round": statistics.fmean(r["seconds"] for r in rows) if rows else None,
        "seconds_min": min((r["seconds"] for r in rows), default=None),
        "seconds_max": max((r["seconds"] for r in rows), default=None),
        "mb_per_peer_round": statistics.fmean(
            (r["bytes_sent"] + r["bytes_received"] + r["downloaded_bytes"]) / 1e6 for r in rows
        )
        if rows
        else None,
        "compute_share_mean": statistics.fmean(shares),
        "compute_share_min": min(shares),
        "compute_share_max": max(shares),
        "steps_skipped": sum(p["steps_skipped"] for p in peers),
        "identical": run["identical"],
        "wall_seconds": run["seconds"],
        "final_val_loss": [p["final_val_loss"] for p in peers],
    }


def reread(run: dict, codec: str, arm: str) -> dict:
    """A stored run with its peers compared again by the current ``compare_final``."""
    peers = [
        PeerReport.from_dict(p, compression=codec.removesuffix("-dense"), overlap=arm == "overlap")
        for p in run["peers"]
    ]
    last, differences = compare_final(peers)
    return {**run, "last_common_round": last, "identical": not differences, "differences": differences}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    ap.add_argument("--arms", nargs="+", default=["blocking", "overlap"], choices=["blocking", "overlap"])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--mbit", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--only-table",
        action="store_true",
        help="run nothing: tabulate the per-run JSON already in results/wan-codecs (read again with "
        "the current benchmarks/lab/wan_report.py)",
    )
    args = ap.parse_args()
    out_dir = RESULTS / "wan-codecs"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for codec in args.codecs:
        for arm in args.arms:
            out = out_dir / f"{codec}-{arm}.json"
            if args.only_table:
                if out.exists():
                    results.append(
                        {"codec": codec, "arm": arm, **summarize(reread(json.loads(out.read_text()), codec, arm))}
                    )
                continue
            cmd = [
                sys.executable,
                str(ROOT / "benchmarks" / "wan.py"),
                "--peers",
                str(args.peers),
                "--mbit",
                str(args.mbit),
                "--steps",
                str(args.steps),
                "--seed",
                str(args.seed),
                *(a for o in CODECS[codec] for a in ("--set", o)),
                "--out",
                str(out),
            ]
            if arm == "overlap":
                cmd.append("--overlap")
            print(f"== {codec} / {arm}: {' '.join(cmd[1:])}", flush=True)
            t0 = time.monotonic()
            proc = subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if proc.returncode != 0 or not out.exists():
                print(f"   failed (exit {proc.returncode}): {proc.stderr[-1500:]}", flush=True)
                results.append({"codec": codec, "arm": arm, "error": proc.stderr[-1500:]})
                continue
            row = {"codec": codec, "arm": arm, **summarize(json.loads(out.read_text()))}
            print(
                f"   done in {time.monotonic() - t0:.0f} s: {row['seconds_per_round']:.1f} s/round, "
                f"{100 * row['compute_share_mean']:.0f}% computing",
                flush=True,
            )
            results.append(row)
    table = Table(
        title=f"{args.peers} peers at {args.mbit:g} Mbit/s up and down each, tiny config, {args.steps} steps, "
        f"seed {args.seed}"
    )
    for col in (
        "codec",
        "rounds",
        "rounds with every peer",
        "s per round (min-max)",
        "round time vs none, same arm",
        "MB per peer per round",
        "wall time computing (mean, min-max)",
        "steps skipped",
        "identical",
    ):
        table.add_column(col, justify="left" if col == "codec" else "right")
    baseline = {r["arm"]: r["seconds_per_round"] for r in results if r["codec"] == "none" and "error" not in r}
    for r in results:
        if "error" in r:
            table.add_row(f"{r['codec']} / {r['arm']}", "failed", "", "", "", "", "", "", "")
            continue
        base = baseline.get(r["arm"])
        r["seconds_per_round_times_less_than_none"] = base / r["seconds_per_round"] if base else None
        versus = f"{base / r['seconds_per_round']:.1f}x shorter" if base else "-"
        table.add_row(
            f"{r['codec']} / {r['arm']}",
            str(r["rounds"]),
            str(r["rounds_with_everyone"]),
            f"{r['seconds_per_round']:.1f} ({r['seconds_min']:.1f}-{r['seconds_max']:.1f})",
            versus,
            f"{r['mb_per_peer_round']:.1f}",
            f"{100 * r['compute_share_mean']:.0f}% ({100 * r['compute_share_min']:.0f}-"
            f"{100 * r['compute_share_max']:.0f}%)",
            str(r["steps_skipped"]),
            str(r["identical"]),
        )
    Console(width=160).print(table)
    (RESULTS / "wan-codecs.json").write_text(
        json.dumps(
            {
                "command": ["benchmarks/wan_codecs.py", *sys.argv[1:]],
                "peers": args.peers,
                "mbit": args.mbit,
                "steps": args.steps,
                "seed": args.seed,
                "results": results,
            },
            indent=1,
        )
    )
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
