"""Each compression mode on the shaped-link lab: seconds per round and the share of wall time computing.

    sudo .venv/bin/python -m benchmarks.wan_codecs                      # 4 peers x 20 Mbit/s, 7 codecs, ~30 min
    sudo .venv/bin/python -m benchmarks.wan_codecs --codecs none topk --arms blocking --variant none-topk
    sudo .venv/bin/python -m benchmarks.wan_codecs --only-table         # the table again from the per-run files

Runs ``benchmarks/wan.py``'s swarm (network namespaces, ``tbf`` caps, the tiny config, same seed and data
for every run) once per codec (arm ``blocking``: the round holds training up; the ``overlap`` arm of the
stored legacy files measured rounds run beside training, withdrawn since), one after another, and
tabulates per run: rounds
in which every peer was a member, mean seconds per round (rounds after the last joiner started),
bytes sent + received per peer per round (the peer's groups, as client), the share of wall time each
peer spent computing (mean and range over peers), and whether all peers ended bit-identical.
This script writes every file itself (``benchmarks/lab/results.py``, with its provenance): each run to
``benchmarks/results/wan_codecs/<codec>-<arm>.json``, the table to ``benchmarks/results/wan_codecs/main.json``
(with ``--variant NAME``: ``NAME-<codec>-<arm>.json`` and ``NAME.json``). ``--only-table`` reads only
per-run files this script wrote and recorded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from rich.console import Console
from rich.table import Table

from benchmarks import wan
from benchmarks.lab import results
from benchmarks.lab.netlab import Lab
from benchmarks.lab.wan_report import PeerReport, compare_final

# each codec's overrides; topk-dense is topk with the groups' averaged parts at up to 16 of 256 values,
# topk-dense8-lone8 topk with those parts and each lone holder's update to its copies at 8 of 256
CODECS = {name: [f"swarm.compression={name}"] for name in ("none", "fp16", "int8", "int4", "topk", "sparse")}
CODECS["topk-dense"] = [*CODECS["topk"], "swarm.topk_result_fraction=0.0625"]
CODECS["topk-dense8-lone8"] = [
    *CODECS["topk"],
    "swarm.topk_result_fraction=0.03125",
    "swarm.topk_lone_fraction=0.03125",
]


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


def compression(codec: str) -> str:
    """The ``swarm.compression`` that ``codec``'s overrides set."""
    return next(o.split("=", 1)[1] for o in CODECS[codec] if o.startswith("swarm.compression="))


def reread(run: dict, codec: str, arm: str) -> dict:
    """A stored run with its peers compared again by the current ``compare_final``."""
    peers = [PeerReport.from_dict(p, compression=compression(codec)) for p in run["peers"]]
    last, differences = compare_final(peers)
    return {**run, "last_common_round": last, "identical": not differences, "differences": differences}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    ap.add_argument("--arms", nargs="+", default=["blocking"], choices=["blocking"])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--mbit", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--only-table",
        action="store_true",
        help="run nothing: tabulate the per-run JSON this script wrote (read again with the current "
        "benchmarks/lab/wan_report.py)",
    )
    results.add_variant(
        ap,
        help="the table's variant (default main); each run's is <codec>-<arm> under main, "
        "<variant>-<codec>-<arm> otherwise",
    )
    args = ap.parse_args()
    writer = results.start("wan_codecs", args.variant, seeds=[args.seed])
    if not args.only_table and not (lab := Lab.available())[0]:
        print(f"benchmarks.wan_codecs: cannot build the network lab: {lab[1]}", file=sys.stderr)
        return 2
    rows, merged = [], []
    for codec in args.codecs:
        for arm in args.arms:
            variant = run_variant(args.variant, codec, arm)
            if args.only_table:
                if writer.sibling(variant=variant).exists():
                    merged.append(stored(variant))
                    rows.append({"codec": codec, "arm": arm, **summarize(reread(merged[-1].payload, codec, arm))})
                continue
            rows.append(measure(args, codec, arm, writer, variant))
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
    baseline = {r["arm"]: r["seconds_per_round"] for r in rows if r["codec"] == "none" and "error" not in r}
    for r in rows:
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
    out = writer.write(
        {"peers": args.peers, "mbit": args.mbit, "steps": args.steps, "seed": args.seed, "results": rows},
        merged=merged,
    )
    print(f"wrote {out}")
    return 0 if all("error" not in r for r in rows) else 1


def run_variant(variant: str, codec: str, arm: str) -> str:
    """The variant of one run's file: ``<codec>-<arm>`` beside the main table, else prefixed by its variant."""
    return f"{codec}-{arm}" if variant == results.MAIN else f"{variant}-{codec}-{arm}"


def stored(variant: str) -> results.Result:
    """A per-run file this script wrote (``results.own``: never one without provenance or another script's)."""
    try:
        return results.own("wan_codecs", variant)
    except results.ResultError as exc:
        raise SystemExit(f"--only-table: {exc}") from None


def measure(args: argparse.Namespace, codec: str, arm: str, writer: results.Run, variant: str) -> dict:
    """One run through ``benchmarks.wan``'s swarm in this process, written as ``variant``; its table row."""
    argv = ["--peers", str(args.peers), "--mbit", str(args.mbit), "--steps", str(args.steps), "--seed", str(args.seed)]
    argv += [a for o in CODECS[codec] for a in ("--set", o)]
    print(f"== {codec} / {arm}: benchmarks.wan {' '.join(argv)}", flush=True)
    t0 = time.monotonic()
    try:
        run, error = wan.run(wan.parser().parse_args(argv))
    except Exception as exc:  # one failed run is a row that says so, not the end of the others
        run, error = None, f"{type(exc).__name__}: {exc}"
    if run is not None:
        print(f"   wrote {writer.write({'codec': codec, 'arm': arm, 'wan_args': argv, **run}, variant=variant)}")
    if error:
        print(f"   failed: {error[-1500:]}", flush=True)
        return {"codec": codec, "arm": arm, "error": error[-1500:]}
    row = {"codec": codec, "arm": arm, **summarize(run)}
    print(
        f"   done in {time.monotonic() - t0:.0f} s: {row['seconds_per_round']:.1f} s/round, "
        f"{100 * row['compute_share_mean']:.0f}% computing",
        flush=True,
    )
    return row


if __name__ == "__main__":
    sys.exit(main())
