"""Rounds at size: 8, 16 and 24 loopback peers of a micro config, with peers killed, frozen and restarted.

    python -m benchmarks.scale                                  # 8, 16 and 24 peers, one kill each
    python -m benchmarks.scale --peers 24 --faults churn --variant churn        # faults all through the run
    python -m benchmarks.scale --peers 24 --faults churn --set swarm.group_size=16 --variant churn-grid
                                                                # the shared group as a grid
    python -m benchmarks.scale --peers 16 --faults kill --steps 200 --seed 1 --variant kill-seed1

Every peer is a ``p2p-spes train`` process on 127.0.0.1 (``p2p_spes/local_swarm.py``), one thread
each, all sharing this machine's cores, so they reach each boundary spread out as unequal peers on
the internet do. The model is a micro config (d_model 64, 2 layers, sync every 10 steps) with the same
number of experts at every N (``--experts``, default the largest N: one expert per peer there), so
bytes per peer compare across N. Faults (``benchmarks/lab/chaos.py``):

* ``kill``: one peer (never the first, whose address the others joined through) SIGKILLed a third of
  the way into the run; it does not come back;
* ``churn``: from the first round on, faults aimed at one per measured round time: a kill (at a
  random moment or inside a round) or a freeze of a whole process group for longer than the sync
  deadline (thawed in the background, so the next fault does not wait for it; no freeze once the
  swarm would finish before the peer thaws); between them, killed peers restart from their own
  checkpoints (a restart does not take a fault's turn). Peers log every step, so a kill inside a
  round finds one;
* ``none``.

Reported per N: peer-rounds applied / attempted (a peer-round is applied when the peer averaged the
shared weights with others or took the result its group agreed on), rounds in which every peer that
ran the round applied an average (a peer that came back to find the swarm two rounds past its own
takes the swarm's state and skips those rounds: they are counted apart, as ``peer_rounds_skipped``),
the same among the peers not stopped (SIGSTOP) during the round (a stopped peer cannot take part; it
takes the swarm's state once thawed; ``peer_rounds_frozen`` counts its rounds) and not run after every
other peer had ended (a peer thawed after the others finished the run has nobody to average with:
``peer_rounds_after_others`` counts those rounds, ``ended_after_others`` such survivors, whose
weights are left out of the count of sets at the end),
the median seconds per round, bytes sent + received + downloaded per
peer per round, how many different shared weights the surviving peers hold at the end (at the last round any of them
ran or took; ``ended_behind`` counts survivors whose last round is an earlier one), groups that needed a retry and members lost from them, the peak proportional memory (PSS) of a
peer (its process group: trainer, DHT, p2pd) and of the whole swarm, and processes left behind.
Writes ``benchmarks/results/scale/<variant>.json`` (``--variant``, default ``main``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.lab import results
from benchmarks.lab.chaos import Chaos, Fault, orphaned
from p2p_spes.config import load_config
from p2p_spes.local_swarm import LocalSwarm
from p2p_spes.metrics_log import read_metrics
from p2p_spes.swarm import sync_deadline

SYNC_STEPS = 10


def micro(experts: int, steps: int) -> list[str]:
    """The micro config, small enough for 24 peers on 2 cores."""
    return [
        "model.d_model=64",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.max_seq_len=32",
        f"moe.num_experts={experts}",
        "moe.ffn_dim=64",
        "moe.top_k=2",
        "train.batch_size=4",
        "train.warmup_steps=5",
        f"train.max_steps={steps}",
        "train.eval_interval=1000000",
        "train.log_interval=1",
        "train.checkpoint_interval=20",
        "train.keep_checkpoints=2",
        f"swarm.sync_steps={SYNC_STEPS}",
        "swarm.matchmaking_time=10",
        "swarm.averaging_timeout=30",
        "swarm.merge_interval=0",
    ]


def group_pss(pgid: int) -> int:
    """Proportional resident bytes (shared pages split among their users) of every process in process
    group ``pgid`` (a peer: trainer, p2pd): summed over peers, what the swarm really occupies."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for line in Path(f"/proc/{entry}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


class MemoryWatch(threading.Thread):
    """Samples every peer's resident memory every ``period`` seconds until stopped."""

    def __init__(self, swarm: LocalSwarm, period: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.swarm, self.period = swarm, period
        self.peak_peer = self.peak_total = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.period):
            sizes = [group_pss(p.pid) for p in list(self.swarm.procs) if p.poll() is None]
            if sizes:
                self.peak_peer = max(self.peak_peer, max(sizes))
                self.peak_total = max(self.peak_total, sum(sizes))

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def rounds_of(run_dir: Path, peers: int) -> dict[int, list[dict[str, Any]]]:
    """Every peer's sync-round lines, by peer."""
    return {i: [r for r in read_metrics(run_dir / f"peer{i}") if "sync_round" in r] for i in range(peers)}


def frozen_during(row: dict[str, Any], freezes: list[Fault]) -> bool:
    """Whether one of the peer's freezes overlaps this round (which ends at ``time``)."""
    return any(f.start < row["time"] and f.end > row["time"] - row["sync_seconds"] for f in freezes)


def summarize(run_dir: Path, peers: int, survivors: list[int], faults: list[Fault] = ()) -> dict[str, Any]:
    """The row of one run (see the module docstring)."""
    lines = {i: read_metrics(run_dir / f"peer{i}") for i in range(peers)}  # read once: rounds and catch-ups
    rows = [r for i in range(peers) for r in lines[i] if "sync_round" in r]
    skipped = sum(
        len(r["rounds_skipped"]) for i in range(peers) for r in lines[i] if isinstance(r.get("rounds_skipped"), list)
    )
    applied = [r for r in rows if r["outcome"] in ("averaged", "adopted")]
    by_round: dict[int, list[dict]] = {}
    for r in rows:
        by_round.setdefault(r["sync_round"], []).append(r)
    everyone = [n for n, rs in by_round.items() if all(r["outcome"] in ("averaged", "adopted") for r in rs)]
    # a peer stopped (SIGSTOP) during its round cannot take part in it: rounds where every peer that was
    # not stopped applied an average are counted apart (the stopped one takes the swarm's state when thawed)
    freezes = {i: [f for f in faults if f.kind == "freeze" and f.peer == i] for i in range(peers)}
    frozen = {id(r) for i in range(peers) for r in lines[i] if "sync_round" in r and frozen_during(r, freezes[i])}
    # a round a peer began when every other peer had ended or was stopped (thawed once the others
    # finished the run): nobody was left to average with
    ended = {i: max((r["time"] for r in lines[i]), default=0.0) for i in range(peers)}

    def nobody_else(i: int, t: float) -> bool:
        return not any(
            ended[j] > t and not any(f.start <= t < f.end for f in freezes[j]) for j in range(peers) if j != i
        )

    after = {
        id(r)
        for i in range(peers)
        for r in lines[i]
        if "sync_round" in r and nobody_else(i, r["time"] - r["sync_seconds"])
    }
    everyone_running = [
        n
        for n, rs in by_round.items()
        if all(r["outcome"] in ("averaged", "adopted") or id(r) in frozen | after for r in rs)
    ]
    # each survivor's last shared weights: its last round's, or the state it took when it skipped rounds
    last: dict[int, tuple[int, str]] = {}
    late = [i for i in survivors if any(id(r) in after for r in lines[i])]
    for i in (i for i in survivors if i not in late):
        for r in lines[i]:
            if "sync_round" in r:
                last[i] = (r["sync_round"], r.get("shared_digest", ""))
            elif "caught_up_round" in r:
                last[i] = (r["caught_up_round"], r.get("shared_digest") or "")
    final = max((v[0] for v in last.values()), default=None)
    groups = [g for r in rows for g in r.get("groups", {}).values()]
    return {
        "peer_rounds": len(rows),
        "peer_rounds_applied": len(applied),
        "applied_share": len(applied) / len(rows) if rows else None,
        "peer_rounds_averaged": sum(r["outcome"] == "averaged" for r in rows),
        # rounds a peer back from a freeze (or restarted) found finished and the next one too: it took
        # the swarm's state instead of running them, and has no line for them
        "peer_rounds_skipped": skipped,
        "rounds": len(by_round),
        "rounds_everyone_applied": len(everyone),
        "everyone_share": len(everyone) / len(by_round) if by_round else None,
        "peer_rounds_frozen": len(frozen),
        "peer_rounds_after_others": len(after),
        "ended_after_others": len(late),
        "rounds_everyone_running_applied": len(everyone_running),
        "seconds_per_round": statistics.median(r["sync_seconds"] for r in rows) if rows else None,
        "mb_per_peer_round": statistics.fmean(
            (r["bytes_sent"] + r["bytes_received"]) / 1e6
            for r in rows  # every byte, downloads included
        )
        if rows
        else None,
        "groups_retried": sum((g.get("attempts") or 1) > 1 for g in groups),
        "members_lost": sum(len(g.get("lost") or []) for g in groups),
        # shared groups run as a grid (rows and columns), and those whose result missed our own contribution
        "grid_groups": sum(bool(r.get("groups", {}).get("shared", {}).get("rows")) for r in rows),
        "partial_groups": sum(bool(r.get("groups", {}).get("shared", {}).get("partial")) for r in rows),
        "final_round": final,
        "final_weights": len({d for r, d in last.values() if r == final}) if final is not None else None,
        "ended_behind": sum(r != final for r, _ in last.values()),  # survivors whose last round is an earlier one
        "survivors": len(survivors),
    }


def run_size(
    peers: int, experts: int, faults: str, steps: int, seed: int, work: Path, console: Console, extra: list[str]
) -> dict[str, Any]:
    overrides = micro(experts, steps) + extra
    cfg = load_config(None, overrides)
    deadline = sync_deadline(cfg.swarm, peers)
    run_dir = work / f"n{peers}-{faults}"
    swarm = LocalSwarm(None, overrides, peers=peers, run_dir=run_dir, run_id=f"scale-{peers}")
    chaos = Chaos(
        swarm, SYNC_STEPS, freeze_seconds=deadline + 5, seed=seed, min_live=max(2, peers // 2), background_freezes=True
    )
    memory = MemoryWatch(swarm)
    t0 = time.monotonic()
    timeout = 900 + 40 * peers
    try:
        swarm.start(stagger=0.5)
        memory.start()
        if faults == "kill":
            victim = chaos.rng.randrange(1, peers)
            while time.monotonic() - t0 < timeout and chaos.last_step(victim) < steps // 3:
                time.sleep(1.0)
            fault = chaos.kill(victim)
            console.print(f"  [{time.monotonic() - t0:5.0f}s] killed peer {fault.peer}")
        elif faults == "churn":
            while time.monotonic() - t0 < timeout and not any(rounds_of(run_dir, peers).values()):
                time.sleep(2.0)
            due = time.monotonic()  # when the next fault is due: a fault that takes long (a freeze, a kill
            # waiting for its round) does not delay the ones after it, so the rate stays one per round time
            while time.monotonic() - t0 < timeout and any(p.poll() is None for p in swarm.procs):
                times = [r["sync_seconds"] for rs in rounds_of(run_dir, peers).values() for r in rs]
                round_time = 0.25 * SYNC_STEPS + (statistics.median(times) if times else 10.0)
                # a fault that waited long (a kill inside a round waits for one) leaves the schedule at most
                # one round time behind: catching up on every missed turn fired 7 faults within 20 s
                due = max(due, time.monotonic() - round_time) + chaos.rng.uniform(0.5, 1.5) * round_time
                time.sleep(max(due - time.monotonic(), 0.0))
                if sum(chaos.last_step(i) >= steps - 2 * SYNC_STEPS for i in chaos.live()) >= len(chaos.live()) // 2:
                    break  # near the end: let the survivors finish
                # a peer stopped for the freeze's length must come back before the others finish the run,
                # or it has nobody left to average with (on a seed-1 run, 3 peers thawed after the end
                # and ended with weights of their own): near the end, the faults are kills
                left = (steps - statistics.median(chaos.last_step(i) for i in chaos.live())) / SYNC_STEPS * round_time
                for _ in range(peers):  # restarts come between faults, then one kill or freeze
                    fault = chaos.random_fault(freeze=left > chaos.freeze_seconds + 2 * round_time)
                    if fault:
                        console.print(f"  [{time.monotonic() - t0:5.0f}s] {fault.kind} peer {fault.peer} {fault.note}")
                    if fault is None or fault.kind != "restart":
                        break
        chaos.thaw_all(max(timeout - (time.monotonic() - t0), 1.0))
        codes = swarm.wait(max(timeout - (time.monotonic() - t0), 1.0))
    finally:
        swarm.stop()
        memory.stop()
    left = orphaned(swarm)
    survivors = [i for i, c in enumerate(codes) if c == 0]
    row = {
        "peers": peers,
        "experts": experts,
        "faults": faults,
        "steps": steps,
        "seed": seed,
        "wall_seconds": round(time.monotonic() - t0, 1),
        "exit_codes": codes,
        "fault_log": [vars(f) for f in chaos.faults],
        **summarize(run_dir, peers, survivors, chaos.faults),
        "processes_left": left,
        "peak_pss_peer_mb": round(memory.peak_peer / 2**20),
        "peak_pss_swarm_mb": round(memory.peak_total / 2**20),
    }
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[8, 16, 24])
    parser.add_argument("--faults", choices=["kill", "churn", "none"], default="kill")
    parser.add_argument("--steps", type=int, default=200, help="steps per peer (a round every 10)")
    parser.add_argument(
        "--experts", type=int, default=None, help="experts of the model at every N (default: the largest N)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default=None, help="keep the peers' run directories here")
    results.add_variant(parser)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every peer (e.g. swarm.group_size=0 for one flat shared group)",
    )
    args = parser.parse_args()
    writer = results.start("scale", args.variant, seeds=[args.seed])
    work = Path(args.run_dir or tempfile.mkdtemp(prefix="p2p-spes-scale-"))
    console = Console(width=170)
    rows = []
    for n in args.peers:
        console.print(f"== {n} peers, faults: {args.faults}, run dir {work}")
        rows.append(
            run_size(
                n, args.experts or max(args.peers), args.faults, args.steps, args.seed, work, console, args.overrides
            )
        )
        r = rows[-1]
        console.print(
            f"  applied {r['peer_rounds_applied']}/{r['peer_rounds']} peer-rounds "
            f"({r['peer_rounds_skipped']} skipped by peers that came back rounds behind), "
            f"{r['final_weights']} set(s) of weights at the end, {r['wall_seconds']:.0f} s"
        )
    table = Table(
        title=f"scale: micro config, {args.steps} steps, a round every {SYNC_STEPS}, faults: {args.faults}, "
        f"seed {args.seed}, group_size {load_config(None, args.overrides).swarm.group_size}"
    )
    for col in (
        "peers",
        "peer-rounds applied (averaged + adopted)",
        "rounds every peer applied",
        "... every peer not stopped",
        "s per round (median)",
        "MB per peer per round",
        "vs first N",
        "groups retried (members lost)",
        "weights at end",
        "peak MB (PSS) per peer (swarm)",
        "left behind",
    ):
        table.add_column(col, justify="right")
    base = rows[0]["mb_per_peer_round"] if rows and rows[0]["mb_per_peer_round"] else None
    for r in rows:
        mb = r["mb_per_peer_round"]
        table.add_row(
            str(r["peers"]),
            f"{r['peer_rounds_applied']}/{r['peer_rounds']} ({100 * (r['applied_share'] or 0):.0f}%: "
            f"{r['peer_rounds_averaged']} + {r['peer_rounds_applied'] - r['peer_rounds_averaged']})",
            f"{r['rounds_everyone_applied']}/{r['rounds']} ({100 * (r['everyone_share'] or 0):.0f}%)",
            f"{r['rounds_everyone_running_applied']}/{r['rounds']} ({r['peer_rounds_frozen']} peer-rounds stopped, "
            f"{r.get('peer_rounds_after_others', 0)} after the others ended)",
            f"{r['seconds_per_round']:.1f}" if r["seconds_per_round"] is not None else "-",
            f"{mb:.2f}" if mb is not None else "-",
            f"{mb / base:.2f}x" if mb and base else "-",
            f"{r['groups_retried']} ({r['members_lost']})",
            f"{r['final_weights']} of {r['survivors'] - r.get('ended_after_others', 0)} peers"
            + (f" (+{r['ended_after_others']} after the others)" if r.get("ended_after_others") else ""),
            f"{r['peak_pss_peer_mb']} ({r['peak_pss_swarm_mb']})",
            str(r["processes_left"]),
        )
    console.print(table)
    console.print(f"wrote {writer.write({'results': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
