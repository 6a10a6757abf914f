"""Long chaos run: a loopback swarm under random faults for several minutes, then the checks.

    python -m benchmarks.chaos                      # 4 peers, 10 minutes, a fault every 15-30 s
    python -m benchmarks.chaos --peers 8 --minutes 20 --seed 3 --variant p8-seed3
    sudo .venv/bin/python -m benchmarks.chaos --minutes 30 --interval 5 15 --disk-full    # the README's run

Faults: SIGKILL of a peer's main process (at a random moment, or inside a sync round), SIGSTOP of a
peer's whole process group for longer than the sync deadline then SIGCONT, restarts of killed peers
from their own checkpoints, the run's bootstrap killed and started again (peers join through it, as in
a real run), and with ``--disk-full`` (root: each peer's run directory is a small tmpfs of its own) a
peer's disk filled up until it has tried its next checkpoint. Prints a table (faults injected, rounds
completed and discarded, longest stall of a healthy peer against its bound, consistency checks,
checkpoints lost to a full disk, orphaned processes, loss) and writes
``benchmarks/results/chaos/<variant>.json`` (``--variant``, default ``main``).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.lab import results
from benchmarks.lab.chaos import Chaos, analyse, failed_checkpoints, orphaned
from p2p_spes.config import load_config
from p2p_spes.local_swarm import LocalSwarm
from p2p_spes.metrics_log import METRICS_FILE, metrics_path
from p2p_spes.swarm import sync_deadline

CONFIG = [
    "model.d_model=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.max_seq_len=64",
    "moe.num_experts=8",
    "moe.ffn_dim=128",
    "train.batch_size=8",
    "train.warmup_steps=10",
    "train.max_steps=1000000",
    "train.eval_interval=100000",
    "train.log_interval=1",
    "train.checkpoint_interval=20",
    "train.keep_checkpoints=2",
    "swarm.sync_steps=20",
    "swarm.matchmaking_time=4",
    "swarm.averaging_timeout=8",
    "swarm.replicas=2",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument(
        "--interval",
        type=float,
        nargs=2,
        default=(15.0, 30.0),
        metavar=("MIN", "MAX"),
        help="seconds between faults, drawn uniformly",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default=None, help="keep the peers' run directories here")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--no-bootstrap", action="store_true", help="peers join through the first peer, no bootstrap")
    parser.add_argument(
        "--disk-full",
        action="store_true",
        help="also fill a peer's disk during a checkpoint (root: mounts a tmpfs per peer)",
    )
    parser.add_argument("--disk-mb", type=int, default=96, help="size of each peer's tmpfs with --disk-full")
    results.add_variant(parser)
    args = parser.parse_args()
    writer = results.start("chaos", args.variant, seeds=[args.seed])

    overrides = CONFIG + args.overrides
    cfg = load_config(None, overrides)
    deadline = sync_deadline(cfg.swarm, args.peers)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="p2p-spes-chaos-"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    swarm = LocalSwarm(
        None,
        overrides,
        peers=args.peers,
        run_dir=run_dir,
        run_id="chaos",
        bootstrap_port=None if args.no_bootstrap else port,
    )
    chaos = Chaos(swarm, cfg.swarm.sync_steps, freeze_seconds=deadline + 5, seed=args.seed)
    extra = {} if args.no_bootstrap else {"bootstrap-kill": lambda _: chaos.kill_bootstrap(chaos.rng.uniform(5, 20))}
    mounts = []
    if args.disk_full:
        for i in range(args.peers):
            (run_dir / f"peer{i}").mkdir(parents=True, exist_ok=True)
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={args.disk_mb}m", "tmpfs", str(run_dir / f"peer{i}")], check=True
            )
            mounts.append(run_dir / f"peer{i}")
        extra["disk-full"] = lambda victim: chaos.fill_disk(victim, cfg.train.checkpoint_interval)
    console = Console(width=110)
    console.print(
        f"{args.peers} peers, {args.minutes:g} min of faults every {args.interval[0]:g}-{args.interval[1]:g} s; "
        f"sync deadline {deadline:g} s; run dir {run_dir}"
    )
    t0 = time.monotonic()
    try:
        swarm.start(stagger=1.0)
        time.sleep(30)  # let every peer join and sync once before the first fault
        while time.monotonic() - t0 < args.minutes * 60:
            fault = chaos.random_fault(extra)
            if fault:
                console.print(f"[{time.monotonic() - t0:6.0f}s] {fault.kind:12s} peer {fault.peer} {fault.note}")
            time.sleep(chaos.rng.uniform(*args.interval))
        for index in sorted(chaos.down):  # bring everyone back for the final checks
            chaos.restart(index)
        time.sleep(3 * deadline)
    finally:
        # exit codes of the processes that ended before the final stop (which ends the others with 130)
        ended = [p.returncode for p in swarm.procs + swarm.retired if p.poll() is not None]
        swarm.stop()
    report = analyse(run_dir, args.peers, chaos.faults, deadline)
    report.orphans = orphaned(swarm)
    lost = checkpoints_lost(run_dir, swarm, ended)
    for mount in mounts:  # after the analysis: it reads the peers' metrics there; a copy outlives the tmpfs
        if metrics_path(mount).exists():
            shutil.copy(metrics_path(mount), mount.with_name(f"{mount.name}.{METRICS_FILE}"))
        subprocess.run(["umount", str(mount)], check=False)

    table = Table(title=f"chaos: {args.peers} peers, {args.minutes:g} min, seed {args.seed}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target")
    faults = ", ".join(f"{k} {v}" for k, v in sorted(report.faults.items()))
    table.add_row("faults injected", faults or "none", "")
    table.add_row("peer-rounds completed / discarded", f"{report.rounds_completed} / {report.rounds_discarded}", "")
    table.add_row("expert or shared groups failed", str(report.groups_failed), "")
    table.add_row(
        "longest stall of a healthy peer",
        f"{report.longest_stall_s:.1f} s ({report.longest_stall_at})",
        f"<= {report.stall_bound_s:.1f} s (deadline + one round)",
    )
    table.add_row(
        "consistency checks passed",
        f"{report.consistency_checks - len(report.consistency_failures)} / {report.consistency_checks}",
        "all",
    )
    table.add_row("rounds with an expert no live peer held", str(report.orphan_rounds), "")
    table.add_row(
        "checkpoints not written (full disk) / peers that exited with an error",
        f"{lost['checkpoints_failed']} / {lost['peers_died']}",
        "- / 0",
    )
    table.add_row("orphaned processes after stop", str(report.orphans), "0")
    losses = ", ".join(f"{report.loss_first[i]:.2f}->{report.loss_last[i]:.2f}" for i in sorted(report.loss_last))
    table.add_row("train loss per peer (first -> last)", losses, "falling")
    console.print(table)
    for failure in report.consistency_failures:
        console.print(f"[red]{failure}")
    result = {
        "peers": args.peers,
        "minutes": args.minutes,
        "seed": args.seed,
        "overrides": overrides,
        "sync_deadline_s": deadline,
        **report.to_dict(),
        "fault_log": [vars(f) for f in chaos.faults],
        **lost,
        "targets_met": {
            "faults_50": len(chaos.faults) >= 50,
            "full_disk_survived": lost["peers_died"] == 0,
            "stall": report.longest_stall_s <= report.stall_bound_s,
            "consistency": not report.consistency_failures,
            "orphans": report.orphans == 0,
            "loss_fell": report.loss_fell,
        },
    }
    console.print(f"wrote {writer.write(result)}")


def checkpoints_lost(run_dir: Path, swarm: LocalSwarm, ended: list[int]) -> dict[str, int]:
    """Checkpoints a full disk cost (the peers' logs say so), and peer processes that ended with an error
    of their own before the final stop (``ended``: their exit codes; our SIGKILLs are negative): a full
    disk must not be one."""
    failed = sum(failed_checkpoints(run_dir / f"peer{i}.log") for i in range(swarm.num_peers))
    return {"checkpoints_failed": failed, "peers_died": sum(1 for code in ended if code > 0)}


if __name__ == "__main__":
    main()
