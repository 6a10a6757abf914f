"""A swarm on a simulated wide-area network: N peers in network namespaces behind capped links, some on slow CPUs.

    sudo .venv/bin/python -m benchmarks.wan --peers 4 --mbit 20 --steps 150 --variant 4x20
    sudo .venv/bin/python -m benchmarks.wan --peers 2 --up 20 2 --down 50 4 --slow-cpu 0.33 --slow-peers 1 --variant asym
    sudo .venv/bin/python -m benchmarks.wan --peers 3 --nat-peers 2 --rtt-ms 100 --variant nat-1-2-100ms

Loopback hides the costs a real swarm pays: a joiner's catch-up download takes seconds while the
others train on, rounds move megabytes over a few Mbit/s, and peers compute at different speeds.
Each peer runs in its own network namespace behind a veth with ``tbf`` upload and download caps and,
optionally, a cgroup CPU cap (``benchmarks/lab/netlab.py``); ``--nat-peers K`` puts the last K peers
each behind its own home router, ``--rtt-ms`` gives every connection a round trip. After the run the script reads every peer's
``metrics.jsonl`` and ``summary.json`` (``benchmarks/lab/wan_report.py``) and reports, per peer and per
round: members, outcome, seconds, bytes, tokens contributed, schedule jumps; per peer: steps
computed, skipped and jumped, tokens processed and averaged, the share of wall time spent computing,
the final validation loss; and whether all peers ended bit-identical. Writes a self-describing JSON
(config, links, seeds, results) to ``benchmarks/results/wan/<variant>.json`` (``--variant``, default
``main``; the stored ones are named ``<peers>x<mbit>``). Needs root and iproute2; without them it says why
and stops. Everything it creates is removed at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.lab import results
from benchmarks.lab.netlab import Lab, LinkSpec
from benchmarks.lab.wan_report import SwarmReport, read_swarm
from p2p_spes.config import load_config
from p2p_spes.errors import SwarmError
from p2p_spes.local_swarm import LocalSwarm
from p2p_spes.metrics_log import read_metrics

# every step logged (the compute share needs each step's time); no mid-run checkpoints to time
DEFAULTS = ["train.log_interval=1", "train.checkpoint_interval=100000"]


def per_peer(values: list[float] | None, fallback: float | None, peers: int, what: str) -> list[float | None]:
    """One value for every peer from a list of one (for all) or ``peers`` values; 0 means unshaped."""
    if not values:
        return [fallback] * peers
    if len(values) not in (1, peers):
        raise SystemExit(f"--{what}: give one value for all peers or one per peer ({peers}), not {len(values)}")
    values = values * peers if len(values) == 1 else values
    return [v if v > 0 else None for v in values]


def links_from(args: argparse.Namespace) -> list[LinkSpec]:
    mbit = args.mbit if args.mbit > 0 else None
    up = per_peer(args.up, mbit, args.peers, "up")
    down = per_peer(args.down, mbit, args.peers, "down")
    slow = set(range(args.peers - args.slow_peers, args.peers)) if args.slow_cpu else set()
    natted = set(range(args.peers - args.nat_peers, args.peers))
    return [
        LinkSpec(
            up_mbit=up[i],
            down_mbit=down[i],
            cpu=args.slow_cpu if i in slow else None,
            nat=i in natted,
            rtt_ms=args.rtt_ms,
        )
        for i in range(args.peers)
    ]


def overrides_from(args: argparse.Namespace) -> list[str]:
    out = [*DEFAULTS, f"train.max_steps={args.steps}", f"train.seed={args.seed}", f"data.seed={args.seed}"]
    return out + list(args.set)


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def print_report(report: SwarmReport, links: list[LinkSpec], console: Console) -> None:
    rounds = Table(title="rounds, per peer")
    for col in (
        "peer",
        "round",
        "step",
        "members",
        "outcome",
        "seconds",
        "sent MB",
        "recv MB",
        "download MB",
        "tokens",
        "jump",
    ):
        rounds.add_column(col, justify="left" if col == "outcome" else "right")
    for p in report.peers:
        for r in p.rounds:
            rounds.add_row(
                str(p.peer),
                str(r.round),
                str(r.step),
                str(r.members),
                r.outcome,
                f"{r.seconds:.1f}",
                _mb(r.bytes_sent),
                _mb(r.bytes_received),
                _mb(r.downloaded_bytes),
                "-" if r.tokens_contributed is None else str(r.tokens_contributed),
                "-" if r.schedule_jump is None else str(r.schedule_jump),
            )
    console.print(rounds)
    peers = Table(
        title=f"peers (identical weights at the end: {report.identical}"
        f"{'' if report.identical else ': ' + '; '.join(report.differences)})"
    )
    for col in (
        "peer",
        "role",
        "up/down Mbit",
        "cpu",
        "steps",
        "computed",
        "from",
        "jumped",
        "skipped",
        "rounds avg/all",
        "tokens",
        "averaged",
        "compute share",
        "val loss",
        "sent MB",
        "recv MB",
    ):
        peers.add_column(col, justify="right")
    for p, link in zip(report.peers, links):
        averaged = sum(r.outcome == "averaged" for r in p.rounds)
        peers.add_row(
            str(p.peer),
            p.role + (" (NAT)" if link.nat else ""),
            f"{link.up_mbit or '-'}/{link.down_mbit or '-'}",
            str(link.cpu or "-"),
            str(p.final_step),
            str(p.steps_computed),
            str(p.start_step),
            str(p.steps_jumped),
            str(p.steps_skipped),
            f"{averaged}/{len(p.rounds)}",
            str(p.tokens),
            "-" if p.averaged_share is None else f"{p.averaged_share:.0%}",
            f"{p.compute_share:.0%}",
            "-" if p.final_val_loss is None else f"{p.final_val_loss:.4f}",
            _mb(p.bytes_sent),
            _mb(p.bytes_received),
        )
    console.print(peers)


def cap_after_first_step(lab: Lab, run_dir: Path, peers: list[int], cpu: float, timeout: float = 600.0) -> None:
    """Cap each of ``peers`` to ``cpu`` cores once it has logged its first training step (bounded wait)."""
    deadline = time.monotonic() + timeout
    pending = set(peers)
    while pending and time.monotonic() < deadline:
        for i in sorted(pending):
            if any("loss" in r for r in read_metrics(run_dir / f"peer{i}")):
                lab.set_cpu(i, cpu)
                pending.discard(i)
        time.sleep(0.2)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--mbit", type=float, default=20.0, help="upload and download cap of every peer, Mbit/s (0: none)")
    ap.add_argument("--up", type=float, nargs="+", help="upload caps, one for all or one per peer (0: none)")
    ap.add_argument("--down", type=float, nargs="+", help="download caps, one for all or one per peer (0: none)")
    ap.add_argument("--slow-cpu", type=float, help="CPU cap of the slow peers, in cores (e.g. 0.33)")
    ap.add_argument("--slow-peers", type=int, default=1, help="how many peers (the last ones) get --slow-cpu")
    ap.add_argument(
        "--slow-from-start",
        action="store_true",
        help="cap the slow peers from their start (default: from their first training step, so "
        "they are slow at training, not at importing libraries)",
    )
    ap.add_argument("--nat-peers", type=int, default=0, help="how many peers (the last ones) sit behind a home NAT")
    ap.add_argument("--rtt-ms", type=float, default=0.0, help="round trip of every connection, ms (delay_proxy.py)")
    ap.add_argument("--config", help="config file or name (default: the built-in tiny config)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--steps", type=int, default=200, help="train.max_steps")
    ap.add_argument("--seed", type=int, default=0, help="train.seed and data.seed")
    ap.add_argument("--stagger", type=float, default=5.0, help="seconds between the first peer and the others")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds the whole run may take")
    ap.add_argument("--run-dir", type=Path, help="where peers write (default: a temporary directory)")
    results.add_variant(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if not 1 <= args.slow_peers <= args.peers:
        ap.error("--slow-peers must be between 1 and --peers")
    if not 0 <= args.nat_peers < args.peers:
        ap.error("--nat-peers must be between 0 and --peers - 1 (the first peer is the public one the others join)")
    writer = results.start("wan", args.variant, seeds=[args.seed], argv=argv)
    ok, reason = Lab.available(nat=args.nat_peers > 0, rtt=args.rtt_ms > 0)
    if not ok:
        print(f"benchmarks.wan: cannot build the network lab: {reason}", file=sys.stderr)
        return 2
    out, error = run(args)
    Console(width=160).print(f"wrote {writer.write(out)}")
    return 1 if error else 0


def run(args: argparse.Namespace) -> tuple[dict, str | None]:
    """One swarm on the lab's links as ``args`` (from :func:`parser`) say: the result to write, and the
    swarm's error if it failed (the result then holds what the peers logged anyway)."""
    links, overrides = links_from(args), overrides_from(args)
    config = load_config(args.config, overrides)  # fail fast on a bad override; recorded in the JSON
    console = Console(width=160)
    with tempfile.TemporaryDirectory(prefix="p2p-wan-") as tmp:
        run_dir = args.run_dir or Path(tmp)
        started = time.time()
        error = None
        with Lab(links) as lab:
            network = lab.describe()
            swarm = LocalSwarm(args.config, overrides, peers=args.peers, run_dir=run_dir, run_id="wan", place=lab.place)
            if args.slow_cpu and not args.slow_from_start:
                slow = [i for i, link in enumerate(links) if link.cpu is not None]
                for i in slow:
                    lab.set_cpu(i, None)  # full speed while starting up; capped from its first step on
                threading.Thread(
                    target=cap_after_first_step, args=(lab, run_dir, slow, args.slow_cpu), daemon=True
                ).start()
            try:
                swarm.run(timeout=args.timeout, stagger=args.stagger)
            except SwarmError as exc:  # report what the peers logged anyway
                error = str(exc)
                console.print(str(exc), style="red", markup=False)
        report = read_swarm(run_dir, args.peers)
        print_report(report, links, console)
        out = {
            "what": "a swarm on capped links in network namespaces (benchmarks/wan.py)",
            "started": started,
            "seconds": round(time.time() - started, 1),
            "num_peers": args.peers,
            "seed": args.seed,
            "stagger": args.stagger,
            "overrides": overrides,
            "config": dataclasses.asdict(config),
            "network": network,
            "error": error,
            **report.to_dict(),
        }
    return out, error


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the lab and the peers are gone by now (Lab and LocalSwarm.run clean up)
        print("benchmarks.wan: interrupted; peers stopped and the lab removed", file=sys.stderr)
        sys.exit(130)
