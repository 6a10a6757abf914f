"""Our group round beside hivemind's DecentralizedAverager, on the same links and tensors, in one run.

    sudo .venv/bin/python -m benchmarks.round_anchor                   # 4 peers at 20 Mbit/s, 3 rounds
    sudo .venv/bin/python -m benchmarks.round_anchor --codecs none int8 sparse --mbit 20 --rounds 3   # 21 min
    .venv/bin/python -m benchmarks.round_anchor --loopback --peers 2   # no lab: 127.0.0.1, no byte counts

Every peer runs in its own network namespace behind a link capped at ``--mbit`` each way
(``benchmarks/lab/netlab.py``) and holds one tensor of ``--numel`` values (default: the tiny config's
shared weights), seeded by its index. The peers take turns at a fixed schedule of slots: in each
slot every peer starts the same averaging at the same time, from its own tensor again:

* ``hivemind``: hivemind's ``DecentralizedAverager.step()`` (its butterfly all-reduce in fp32, groups of
  all the peers), the anchor our round is built against;
* ``ours-<codec>``: our ``GroupAllReduce.run`` (``p2p_spes/averaging``) with ``swarm.compression`` = codec.

The order of the arms rotates from round to round; a first round warms every arm up and is left out.
A slot counts as averaged only if every peer averaged with all the others and, for a lossless arm
(hivemind, ``ours-none``), ended within 1e-5 of the exact mean: hivemind's ``step()`` reports success
when a peer received only part of the results and kept its own values for the rest. Per slot this script records each peer's seconds
(from the slot's start to its result) and, from the kernel's counters of each peer's interface, every
byte it sent and received in the slot (IP and TCP headers included; the DHT's few records too). A
round's limit is the least time its bytes need at the link's rate: the largest over the peers of bytes
sent over the upload rate and bytes received over the download rate. The table gives, per arm, the
median seconds, the bytes per peer, the seconds over that limit, and each arm's seconds and bytes
against hivemind's, with every peer's result checked: under ``none`` our mean must equal hivemind's to
float rounding, and under every codec all peers must hold the same bits.

Writes ``benchmarks/results/round_anchor/<variant>.json`` (default ``main``). ``--loopback`` runs the
peers on 127.0.0.1 with no lab and no root (a check that both arms run; its seconds and bytes say
nothing about links) and writes nothing unless ``--variant`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.lab import rundir
from p2p_spes.averaging.transport import tensor_digest
from p2p_spes.checkpoint import write_json

REPO = Path(__file__).resolve().parents[1]
ARMS_HIVEMIND = "hivemind"
READY_TIMEOUT = 120.0
WARMUP = 1  # rounds run first and left out of the figures (a process's first transfers are slower)
EXACT = 1e-5  # a lossless arm whose result is further than this from the exact mean did not average everything
SLOT_MIN = 20.0


def arm_names(codecs: list[str]) -> list[str]:
    return [ARMS_HIVEMIND, *(f"ours-{c}" for c in codecs)]


# -- a peer -----------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    """One peer: two DHTs (ours signs its records; hivemind's averager keeps its own), then the slots."""
    import hivemind
    import torch

    from dht.node import start_dht
    from p2p_spes.averaging.allreduce import GroupAllReduce
    from p2p_spes.averaging.compression import Codec

    run_dir, i = Path(args.run_dir), args.index
    torch.manual_seed(1000 + i)
    original = torch.randn(args.numel)
    listen = [f"/ip4/{args.host}/tcp/0"]
    initial = json.loads((run_dir / "maddrs.json").read_text()) if i else None
    dht, identity = start_dht(host_maddrs=listen, initial_peers=(initial or {}).get("ours"))
    plain = hivemind.DHT(start=True, host_maddrs=listen, initial_peers=(initial or {}).get("hivemind"))
    if i == 0:
        maddrs = {
            "ours": [str(m) for m in dht.get_visible_maddrs()],
            "hivemind": [str(m) for m in plain.get_visible_maddrs()],
        }
        write_json(run_dir / "maddrs.json", maddrs)
    averager = hivemind.averaging.DecentralizedAverager(
        [original.clone()],
        plain,
        start=True,
        prefix="anchor",
        target_group_size=args.peers,
        min_group_size=args.peers,
        min_matchmaking_time=args.window,
        request_timeout=min(3.0, args.window / 2),  # below the matchmaking time, as hivemind asks
    )
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def call(coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    p2p = call(dht.replicate_p2p(), 60)
    reducers = {}  # one per codec and round: no reducer's residual carries from one slot into the next
    for codec, round_no in ((c, r) for c in args.codecs for r in range(args.rounds + WARMUP)):
        reducer = GroupAllReduce(
            dht,
            p2p,
            identity.peer_id,
            f"anchor-{codec}-{round_no}",
            owner=identity.owner,
            compression=Codec(codec),
            matchmaking_time=args.window,
            timeout=args.slot,
        )
        call(reducer.start(), 60)
        reducers[codec, round_no] = reducer
    rundir.mark(run_dir / f"ready{i}", identity.peer_id)
    schedule_file = run_dir / "schedule.json"
    deadline = time.monotonic() + READY_TIMEOUT
    while not schedule_file.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"peer {i}: no schedule within {READY_TIMEOUT:.0f} s")
        time.sleep(0.2)
    schedule = json.loads(schedule_file.read_text())
    expected = set(schedule["peer_ids"])
    out = run_dir / f"worker{i}.jsonl"
    for slot_no, (round_no, arm) in enumerate(schedule["slots"]):
        start = schedule["t0"] + slot_no * schedule["slot"]
        time.sleep(max(0.0, start - time.time()))
        row: dict[str, Any] = {"round": round_no, "arm": arm, "peer": i}
        try:
            if arm == ARMS_HIVEMIND:
                with averager.get_tensors() as tensors:
                    tensors[0].copy_(original)
                group = averager.step(timeout=schedule["slot"] - 2.0)
                with averager.get_tensors() as tensors:
                    result = tensors[0].clone()
                row["members"] = len(group) if group else 0
                ok = bool(group)
            else:
                res = call(
                    reducers[arm.removeprefix("ours-"), round_no].run(round_no, "g", original.clone(), 1.0, expected),
                    schedule["slot"],
                )
                ok, result, row["members"] = res.ok, res.tensor, len(res.members)
                row["error"] = res.error
            row["seconds"] = time.time() - start
            row["ok"] = ok
            if ok:
                row["digest"] = tensor_digest([result])
                row["mean_abs_error"] = float((result - exact_mean(args.peers, args.numel)).abs().mean())
        except Exception as exc:  # a failed slot is a result too
            row |= {"ok": False, "error": repr(exc), "seconds": time.time() - start}
        rundir.append_row(out, row)
    averager.shutdown()
    plain.shutdown()
    dht.shutdown()


def exact_mean(peers: int, numel: int) -> Any:
    """The exact mean of every peer's tensor (each peer rebuilds all of them from their seeds)."""
    import torch

    if (peers, numel) not in _MEANS:
        tensors = []
        for j in range(peers):
            torch.manual_seed(1000 + j)
            tensors.append(torch.randn(numel))
        _MEANS[peers, numel] = torch.stack(tensors).mean(0)
    return _MEANS[peers, numel]


_MEANS: dict[tuple[int, int], Any] = {}


# -- the run ----------------------------------------------------------------------------------------
def worker_argv(args: argparse.Namespace, index: int, host: str, run_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "benchmarks.round_anchor", "--worker", "--index", str(index), "--host", host,
        "--run-dir", str(run_dir), "--peers", str(args.peers), "--numel", str(args.numel),
        "--slot", str(args.slot), "--window", str(args.window), "--codecs", *args.codecs,
    ]  # fmt: skip


def run(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """Start the peers (in a lab unless ``--loopback``), give them the schedule, count every slot's bytes."""
    from benchmarks.lab.netlab import Lab, LinkSpec

    arms = arm_names(args.codecs)
    rounds = args.rounds + WARMUP  # round 0 warms every arm up and is left out of the figures
    slots = [(r, arms[(r + k) % len(arms)]) for r in range(rounds) for k in range(len(arms))]
    lab = None if args.loopback else Lab([LinkSpec(up_mbit=args.mbit, down_mbit=args.mbit)] * args.peers)
    procs: list[subprocess.Popen] = []
    counts: list[list[Any]] = []
    try:
        if lab is not None:
            lab.__enter__()
        for i in range(args.peers):
            prefix = [] if lab is None else lab.argv_prefix(i)
            host = "127.0.0.1" if lab is None else lab.address(i)
            argv = [*prefix, *worker_argv(args, i, host, run_dir)]
            procs.append(rundir.spawn_logged(argv, run_dir / f"worker{i}.log", REPO))
            if i == 0:
                wait_files(run_dir, ["maddrs.json"], procs)
        wait_files(run_dir, [f"ready{i}" for i in range(args.peers)], procs)
        ids = [(run_dir / f"ready{i}").read_text() for i in range(args.peers)]
        t0 = time.time() + 5.0
        schedule = {"t0": t0, "slot": args.slot, "slots": slots, "peer_ids": ids}
        write_json(run_dir / "schedule.json", schedule)
        for k in range(len(slots) + 1):  # the counters at each slot's start, and after the last
            time.sleep(max(0.0, t0 + k * args.slot - time.time()))
            counts.append([None if lab is None else lab.interface_counts(i) for i in range(args.peers)])
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        if lab is not None:
            lab.__exit__(None, None, None)
    rows = [
        json.loads(line) for i in range(args.peers) for line in (run_dir / f"worker{i}.jsonl").read_text().splitlines()
    ]
    return summarise(args, slots, rows, counts, None if lab is None else lab.describe())


def wait_files(run_dir: Path, names: list[str], procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while not all((run_dir / n).exists() for n in names):
        for i, p in enumerate(procs):
            if p.poll() is not None:
                log = (run_dir / f"worker{i}.log").read_text()[-3000:]
                raise SystemExit(f"peer {i} exited before it was ready:\n{log}")
        if time.monotonic() > deadline:
            raise SystemExit(f"the peers were not ready within {READY_TIMEOUT:.0f} s: {names}")
        time.sleep(0.2)


def summarise(
    args: argparse.Namespace, slots: list, rows: list[dict], counts: list[list[Any]], network: dict | None
) -> dict[str, Any]:
    """Per slot: each peer's row and bytes; per arm: medians, the limit, and ratios to hivemind."""
    rate = args.mbit * 1e6 / 8  # bytes per second each way
    per_slot = []
    for k, (round_no, arm) in enumerate(slots):
        peers = sorted((r for r in rows if (r["round"], r["arm"]) == (round_no, arm)), key=lambda r: r["peer"])
        entry: dict[str, Any] = {"round": round_no, "arm": arm, "peers": peers}
        if counts[k][0] is not None:
            moved = [after - before for before, after in zip(counts[k], counts[k + 1])]
            entry["sent"] = [m.tx_bytes for m in moved]
            entry["received"] = [m.rx_bytes for m in moved]
            entry["limit_seconds"] = max(max(entry["sent"]), max(entry["received"])) / rate
        lossless = arm in (ARMS_HIVEMIND, "ours-none")
        entry["ok"] = len(peers) == args.peers and all(
            p["ok"] and p.get("members") == args.peers and (not lossless or p["mean_abs_error"] <= EXACT) for p in peers
        )  # every peer averaged with all the others; a lossless arm, to the exact mean
        entry["identical"] = entry["ok"] and len({p["digest"] for p in peers}) == 1
        entry["seconds"] = max((p["seconds"] for p in peers), default=None)
        per_slot.append(entry)
    arms: dict[str, Any] = {}
    for arm in arm_names(args.codecs):
        done = [e for e in per_slot if e["arm"] == arm and e["round"] >= WARMUP]
        good = [e for e in done if e["ok"]]
        row: dict[str, Any] = {
            "rounds": len(done),
            "ok": len(good),
            "identical": sum(e["identical"] for e in done),
            "seconds": statistics.median(e["seconds"] for e in good) if good else None,
            "mean_abs_error": max((p["mean_abs_error"] for e in good for p in e["peers"]), default=None),
        }
        if good and "sent" in good[0]:
            row["bytes_per_peer"] = statistics.median(
                statistics.fmean(s + r for s, r in zip(e["sent"], e["received"])) for e in good
            )
            row["over_limit"] = statistics.median(e["seconds"] / e["limit_seconds"] for e in good)
        arms[arm] = row
    base = arms[ARMS_HIVEMIND]
    for row in arms.values():
        if row["seconds"] and base["seconds"]:
            row["seconds_vs_hivemind"] = row["seconds"] / base["seconds"]
        if row.get("bytes_per_peer") and base.get("bytes_per_peer"):
            row["hivemind_bytes_over_ours"] = base["bytes_per_peer"] / row["bytes_per_peer"]
    return {
        "peers": args.peers,
        "mbit": None if args.loopback else args.mbit,
        "numel": args.numel,
        "rounds": args.rounds,
        "slot_seconds": args.slot,
        "window": args.window,
        "codecs": args.codecs,
        "network": network,
        "slots": per_slot,
        "arms": arms,
    }


def print_table(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    where = "loopback" if out["mbit"] is None else f"{out['mbit']:g} Mbit/s each way"
    table = Table(title=f"{out['peers']} peers, {out['numel']:,} values, {where}, {out['rounds']} rounds")
    for col in (
        "arm",
        "rounds ok",
        "identical",
        "median s",
        "s vs hivemind",
        "MB / peer",
        "hivemind MB / ours",
        "s / link limit",
    ):
        table.add_column(col, justify="left" if col == "arm" else "right")

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for arm, row in out["arms"].items():
        mb = row.get("bytes_per_peer")
        table.add_row(
            arm,
            f"{row['ok']} of {row['rounds']}",
            f"{row['identical']} of {row['rounds']}",
            fmt(row["seconds"], ".1f"),
            fmt(row.get("seconds_vs_hivemind"), ".2f") + ("x" if row.get("seconds_vs_hivemind") else ""),
            fmt(None if mb is None else mb / 1e6, ".1f"),
            fmt(row.get("hivemind_bytes_over_ours"), ".2f") + ("x" if row.get("hivemind_bytes_over_ours") else ""),
            fmt(row.get("over_limit"), ".2f") + ("x" if row.get("over_limit") else ""),
        )
    Console(width=160).print(table)


def tiny_shared() -> int:
    from benchmarks.comms import parameter_split

    return parameter_split(name="tiny")[0]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.lab import results

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--mbit", type=float, default=20.0, help="each peer's link, each way (default 20)")
    ap.add_argument(
        "--numel", type=int, default=0, help="values per tensor (default: the tiny config's shared weights)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--codecs", nargs="+", default=["none", "int8"], help="our arms' swarm.compression")
    ap.add_argument("--slot", type=float, default=0.0, help="seconds per slot (default: from the bytes and the link)")
    ap.add_argument("--window", type=float, default=5.0, help="matchmaking time of both arms (default 5 s)")
    ap.add_argument("--loopback", action="store_true", help="127.0.0.1, no lab, no root: only checks both arms run")
    ap.add_argument("--run-dir", type=Path)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    results.add_variant(ap, default=None)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    args.numel = args.numel or tiny_shared()
    if not args.slot:  # an fp32 all-reduce moves about 2 x the tensor each way; 4x that at the link's rate
        args.slot = max(SLOT_MIN, 4 * 2 * 4 * args.numel / (args.mbit * 1e6 / 8) + 2 * args.window)
    if not args.loopback:
        from benchmarks.lab.netlab import Lab

        ok, reason = Lab.available()
        if not ok:
            print(f"benchmarks.round_anchor: cannot build the network lab: {reason}", file=sys.stderr)
            return 2
    variant = args.variant or (None if args.loopback else results.MAIN)
    writer = results.start("round_anchor", variant, seeds=[], argv=argv) if variant else None
    with tempfile.TemporaryDirectory(prefix="p2p-anchor-") as tmp:
        run_dir = args.run_dir or Path(tmp)
        run_dir.mkdir(parents=True, exist_ok=True)
        if any(run_dir.iterdir()):  # an earlier run's addresses, schedule or rows would mix into this one
            print(f"benchmarks.round_anchor: {run_dir} is not empty; give an empty or new --run-dir", file=sys.stderr)
            return 2
        out = run(args, run_dir)
    print_table(out)
    if writer is not None:
        print(f"wrote {writer.write(out)}")
    return 0 if all(row["ok"] == row["rounds"] for row in out["arms"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
