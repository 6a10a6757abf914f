"""Bytes per peer per sync round, for every compression codec: this project against the SPES reference
protocol and an fp32 all-reduce of the whole model.

    python -m benchmarks.comms                                 # 5 codecs x 4 loopback peers x 4 rounds: ~5 min
    python -m benchmarks.comms --compressions topk topk-dense --rounds 3 --variant topk-dense
    python -m benchmarks.comms --no-run --run-dir DIR          # tables again from the records of an earlier run
    python -m benchmarks.comms --compressions topk-dense sparse --expert-sync-rounds 4 --rounds 8 --variant every4

Measured: one real 4-peer loopback swarm per codec (``swarm.compression``: none fp16 int8 int4 topk, and
``topk-dense``: topk with ``swarm.topk_result_fraction`` 4/64, averaged parts denser than messages) of a
config whose payloads dominate (4.7M shared parameters, 8 experts of 0.79M, one holder each). Each
peer's ``sync_round`` records in ``metrics.jsonl`` give what it moved as a client of the shared group
(contributions out, averaged parts in), as a reducer (contributions in, its averaged part served to
the members) and outside the groups (encoded updates of its own experts that others downloaded; what
it downloaded to refresh the experts it holds frozen). Only rounds after each peer's first, in which
every peer was in the shared group, no group failed, no refresh was missed and every frozen expert
came as its group's encoded update (``refreshed_by_delta``), are averaged. With ``--expert-sync-rounds K``
(``swarm.expert_sync_rounds``: the experts averaged, and the frozen copies refreshed, every K-th round
and the last) a round that does not average the experts counts when it refreshed nothing, and a round's
bytes are the mean over a cycle of K rounds: 1/K of an expert round's plus (K - 1)/K of a round of the
shared weights alone, each measured as the mean of its kind. Byte counts are hivemind's
protobuf chunks (``ByteSize``): the codec's payload plus hivemind's framing. What a peer served is
taken from the downloaders' count (equal in those rounds): a server counts only while its own round
runs and misses downloads that come after it (its own count is kept in the JSON). Runtime: about a
minute per codec on 2 shared CPU cores, ~5 min in all.

Computed, per peer and round (mean over peers), with ``c(n) = Codec(codec).wire_bytes(n)`` (the exact
payload of one message of n values, 32-byte header included), P peers each training E/P of the E
experts (one holder each), S shared parameters and X parameters per expert:

* this project: shared group, reduce-scatter + all-gather of P parts: as a client, (P-1)/P of
  sum(c(part)) out and of sum(r(part)) in, where ``r`` is the codec of a mean of P contributions
  (``c`` but for topk-dense, which keeps min(P x k, 16) of a block's 256 values); as a reducer, the
  same in (P-1 contributions to its part) and out (its averaged part to P-1 members); own experts
  (lone holders: no group traffic), u(X) served to each of the P-1 others, where ``u`` is the codec
  of a group of one (``c``, but 16 of 256 values for topk-dense: a lone holder's update is its own
  dense pseudo-gradient, encoded once; ``--topk-lone-fraction``'s share, or ``--lone-compression``'s
  dense codec, when given); frozen experts, u(X) downloaded for each of the E - E/P;
* SPES reference (central server): upload the shared parameters and the own experts, download the
  whole model; at fp32, and at the codec's own bytes per value (``c`` on the same transfers);
* an fp32 all-reduce of the whole model (DiLoCo, full replicas): 2(P-1)/P of it each way;
* the least any round with no server can move (:func:`serverless_floor`, ``docs/method.md``, "The least
  a round can move"), at the codec's bytes per value: what no protocol in which every peer ends the
  round holding the shared average and every expert's update can go below, whatever its topology.
  Its ratio to the SPES reference at fp32 is the ceiling of a codec's "times less". It prices the
  experts' updates at the members' bytes per value, so with a dense lone codec it is far below what
  any round of that codec moves.

The framing overhead of a codec is measured / computed on the loopback run; the projections to
spes-1b and spes-7b at 4 and 16 peers multiply the computed payload by it. Writes
``benchmarks/results/comms/<variant>.json`` (``--variant``, default ``main``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.lab import results
from p2p_spes.averaging.compression import BLOCK, CODECS, DENSE, Codec
from p2p_spes.config import load_config
from p2p_spes.errors import SwarmError
from p2p_spes.local_swarm import LocalSwarm
from p2p_spes.metrics_log import round_records
from p2p_spes.model import MoETransformer

SYNC_STEPS = 3
PAYLOAD = [
    "model.d_model=256",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.max_seq_len=64",
    "moe.num_experts=8",
    "moe.ffn_dim=512",
    "train.batch_size=2",
    "train.warmup_steps=2",
    "train.eval_interval=100000",
    "train.log_interval=100000",
    "train.checkpoint_interval=100000",
    f"swarm.sync_steps={SYNC_STEPS}",
    "swarm.matchmaking_time=4",
    "swarm.averaging_timeout=30",
]
PROJECTED = ("spes-1b", "spes-7b")
PROJECTED_PEERS = (4, 16)
# each component's place in a round record's ``traffic`` (purpose, 0: sent / 1: received), as the peer's
# wire meter counts it (``p2p_spes/averaging/wire_meter.py``)
SENT = {"client_sent": ("averaging", 0), "reducer_out": ("reducing", 0), "served": ("serving", 0)}
RECEIVED = {"client_received": ("averaging", 1), "reducer_in": ("reducing", 1), "downloaded": ("downloading", 1)}
FIELDS = {**SENT, **RECEIVED}
TARGETS = {"best_vs_spes_fp32": 50.0, "best_vs_allreduce_fp32": 140.0, "int8_vs_spes_fp32": 3.5, "flat_within": 0.10}


def parameter_split(overrides: list[str] | None = None, name: str | None = None) -> tuple[int, int, int]:
    """(shared parameters, parameters of one expert over all layers, number of experts)."""
    cfg = load_config(name, overrides or [])
    model = MoETransformer(cfg.model, cfg.moe, local_experts=list(range(cfg.moe.num_experts)), device="meta")
    total = sum(p.numel() for p in model.parameters())
    per_expert = cfg.model.num_layers * 3 * cfg.model.d_model * cfg.moe.ffn_dim
    return total - cfg.moe.num_experts * per_expert, per_expert, cfg.moe.num_experts


def bits_per_value(codec: Codec, numel: int = 1 << 20) -> float:
    """Wire bits per value of ``codec`` for a message of ``numel`` values (header included)."""
    return 8 * codec.wire_bytes(numel) / numel


def part_sizes(numel: int, parts: int) -> list[int]:
    """The sizes ``torch.tensor_split`` cuts ``numel`` values into (the all-reduce's parts)."""
    q, r = divmod(numel, parts)
    return [q + 1] * r + [q] * (parts - r)


def totals(parts: dict[str, float]) -> dict[str, float]:
    """``parts`` with sent, received and total added."""
    sent = sum(parts.get(k, 0.0) for k in SENT)
    received = sum(parts.get(k, 0.0) for k in RECEIVED)
    return {**parts, "sent": sent, "received": received, "total": sent + received}


def ours(codec: Codec, shared: int, expert: int, experts: int, peers: int, refreshed: float = 1.0) -> dict[str, float]:
    """This project's payload bytes per peer per round, mean over peers, by component (docstring):
    contributions in the members' codec, averaged parts in that of a mean of P of them, the lone
    holders' updates in ``codec.lone``. ``refreshed``: the share of frozen copies brought up to date
    per round (1: every copy every round; 1/K with ``swarm.expert_sync_rounds`` K), each by one encoded
    update covering the rounds since the last."""

    def ring(c: Codec, count: int = 1) -> float:  # (P-1)/P of the shared vector's P parts, each encoded with ``c``
        return (peers - 1) / peers * sum(c.wire_bytes(n, count) for n in part_sizes(shared, peers))

    # under sparse an averaged part is a bundle of the P members' messages of it
    contributions, averaged = ring(codec), ring(codec.result_for(peers), peers if codec.forwards else 1)
    own, update = experts / peers, codec.lone.wire_bytes(expert)
    return totals(
        {
            "client_sent": contributions,
            "client_received": averaged,
            "reducer_in": contributions,
            "reducer_out": averaged,
            "served": refreshed * (peers - 1) * own * update,
            "downloaded": refreshed * (experts - own) * update,
        }
    )


def spes_reference(codec: Codec | None, shared: int, expert: int, experts: int, peers: int) -> dict[str, float]:
    """The SPES reference per peer: upload shared + own experts, download the whole model; fp32 when
    ``codec`` is None, else at the codec's bytes (one message per tensor group)."""
    size = (lambda n: 4.0 * n) if codec is None else codec.wire_bytes
    return _direct(size(shared) + experts / peers * size(expert), size(shared) + experts * size(expert))


def _direct(sent: float, received: float) -> dict[str, float]:
    return {"sent": sent, "received": received, "total": sent + received}


def allreduce_fp32(shared: int, expert: int, experts: int, peers: int) -> dict[str, float]:
    """A reduce-scatter + all-gather of the whole model in fp32: 2(P-1)/P of it each way."""
    each_way = 2 * (peers - 1) / peers * 4.0 * (shared + experts * expert)
    return _direct(each_way, each_way)


def serverless_floor(codec: Codec, shared: int, expert: int, experts: int, peers: int, refreshed: float = 1.0) -> float:
    """The least bytes a peer sends plus receives per round (mean over peers) in any protocol with no server
    where every peer ends the round with the shared parameters' average and every expert's update, each
    value at ``codec``'s body bytes per value (its members' messages; headers left out).

    Each shared value must leave P - 1 peers at least once to be combined with the others (the peer that
    combines it last holds only its own), and the combined value must then reach the P - 1 other peers:
    2(P - 1) transfers per value. Each expert's update (one holder) must reach its P - 1 frozen copies.
    Every byte one peer receives another sends, so the mean over peers of sent + received is twice the
    swarm's transfers over P: ``(P - 1) / P x bytes per value x (4 S + 2 E X)``. A server escapes it
    only because its own traffic, P times a peer's, is not a peer's.

    A codec whose groups forward the members' messages (``sparse``) never re-encodes a combination: each
    peer's message of the shared values must reach the P - 1 others, ``2 (P - 1) x bytes per value x S``
    per peer, the experts' updates as above.

    With only a share ``refreshed`` of the frozen copies brought up to date per round (a refresh policy,
    ``swarm.expert_sync_rounds`` K: 1/K), the experts' term is that share of itself."""
    per_value = codec.body_bytes(BLOCK * BLOCK) / (BLOCK * BLOCK)
    experts_term = 2 * (peers - 1) / peers * experts * expert * refreshed
    if codec.forwards:
        return per_value * (2 * (peers - 1) * shared + experts_term)
    return per_value * ((peers - 1) / peers * 4 * shared + experts_term)


# Measuring ---------------------------------------------------------------------------------------
def run_swarm(name: str, codec: Codec, args: argparse.Namespace, run_dir: Path) -> dict:
    """One loopback swarm with ``codec``; its records stay in ``run_dir / name``."""
    overrides = PAYLOAD + [
        f"swarm.compression={codec.name}",
        f"swarm.topk_fraction={codec.topk_fraction}",
        f"train.max_steps={SYNC_STEPS * (args.rounds + 1)}",
        f"swarm.expert_sync_rounds={args.expert_sync_rounds}",
    ]
    if codec.result_fraction is not None:
        overrides.append(f"swarm.topk_result_fraction={codec.result_fraction}")
    if codec.lone_fraction is not None:
        overrides.append(f"swarm.topk_lone_fraction={codec.lone_fraction}")
    if codec.lone_compression is not None:
        overrides.append(f"swarm.lone_compression={codec.lone_compression}")
    swarm = LocalSwarm(None, overrides, peers=args.peers, run_dir=run_dir / name, run_id=f"comms-{name}")
    t0 = time.monotonic()
    error = None
    try:
        swarm.run(timeout=args.timeout, stagger=1.0)
    except SwarmError as exc:
        error = str(exc).splitlines()[0]
    return {"seconds": round(time.monotonic() - t0, 1), "error": error}


def incomplete(record: dict, peers: int) -> str | None:
    """Why a round record does not count (None: it does)."""
    if not record["shared_ok"] or record["shared_members"] != peers:
        return f"shared group of {record['shared_members']} ({record['outcome']})"
    if record["groups_failed"]:
        return f"failed groups {record['groups_failed']}"
    if record["refresh_missed"]:
        return f"{record['refresh_missed']} refreshes missed"
    if not record.get("experts_synced", True):  # a round of the shared weights alone: no copy moves
        return f"{record['refreshed']} experts refreshed in a round that averaged none" if record["refreshed"] else None
    own = sum(1 for g in record["groups"] if g != "shared")
    frozen = len(record["expert_digests"]) - own
    if record["refreshed_by_delta"] != frozen or record["refreshed"] != frozen:
        return f"{record['refreshed_by_delta']} of {frozen} frozen experts by encoded update ({record['refreshed']} refreshed)"
    return None


def read_records(run_dir: Path, peers: int, every: int = 1) -> dict:
    """Mean bytes per peer per round by component over the complete rounds after each peer's first;
    with the experts averaged every ``every`` rounds, over a cycle of them (the module docstring)."""
    by_round: dict[int, dict[int, dict]] = {}
    for i in range(peers):
        records = round_records(run_dir / f"peer{i}")
        for r in records[1:]:  # the first: peers join and catch up
            by_round.setdefault(r["sync_round"], {})[i] = r
    counted, excluded = [], {}
    for round_no, records in sorted(by_round.items()):
        reasons = {f"peer{i}": why for i, r in records.items() if (why := incomplete(r, peers))}
        if len(records) < peers:
            reasons["missing"] = f"{peers - len(records)} peers have no record after their first"
        if reasons:
            excluded[round_no] = reasons
        else:
            counted.append(round_no)
    rows = [by_round[n][i] for n in counted for i in range(peers)]
    synced = [r for r in rows if r.get("experts_synced", True)]
    held = [r for r in rows if not r.get("experts_synced", True)]
    out: dict = {"rounds": counted, "records": len(rows), "excluded": excluded}
    out["records_by_kind"] = {"experts_averaged": len(synced), "shared_only": len(held)}
    if not synced or (every > 1 and not held):
        return out

    def means(kind: list[dict]) -> dict[str, float]:  # each component's mean over one kind of round
        return {
            k: statistics.fmean(r["traffic"].get(purpose, [0, 0])[side] for r in kind) if kind else 0.0
            for k, (purpose, side) in FIELDS.items()
        }

    by_kind = {"experts_averaged": means(synced), "shared_only": means(held)}
    logged = {
        k: v / every + by_kind["shared_only"][k] * (every - 1) / every for k, v in by_kind["experts_averaged"].items()
    }
    # what a peer served is counted by its server only while its own round runs, and others download
    # its experts' updates at the end of theirs, often after its round closed: those bytes fall between
    # its records. Every frozen expert of a counted round came from its holder in the swarm, so the
    # mean served per peer is the mean the others downloaded, counted by them inside their rounds.
    out["bytes"] = totals({**logged, "served": logged["downloaded"]})
    out["served_logged_by_servers"] = logged["served"]
    out["own_experts"] = statistics.fmean(sum(1 for g in r["groups"] if g != "shared") for r in synced)
    out["refreshed_by_delta"] = sum(r["refreshed_by_delta"] for r in rows)
    out["refreshed"] = sum(r["refreshed"] for r in rows)
    # every byte one peer sends another receives: the counts of both ends should agree
    out["balance"] = {
        "client_sent / reducer_in": logged["client_sent"] / max(logged["reducer_in"], 1),
        "reducer_out / client_received": logged["reducer_out"] / max(logged["client_received"], 1),
        "served (server logs) / downloaded": logged["served"] / max(logged["downloaded"], 1),
    }
    out["seconds_per_round"] = statistics.fmean(r["sync_seconds"] for r in rows)
    if every > 1:
        out["bytes_by_kind"] = {kind: totals(m) for kind, m in by_kind.items()}
    return out


# Printing ----------------------------------------------------------------------------------------
def less(ratio: float) -> str:
    """``ratio`` = theirs / ours as words: above 1 we move less."""
    if ratio >= 1:
        return f"{ratio:.1f}x less" if ratio >= 10 else f"{ratio:.2f}x less"
    return f"{1 / ratio:.2f}x MORE"


def sentence(ratio: float, what: str) -> str:
    if ratio >= 1:
        return f"sends+receives {ratio:.1f} times less than {what}"
    return f"sends+receives {1 / ratio:.2f} times MORE than {what}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4, help="sync rounds per run (each peer's first is not counted)")
    parser.add_argument(
        "--compressions",
        nargs="+",
        default=[*CODECS, "topk-dense"],
        choices=[*CODECS, "topk-dense"],
        help="topk-dense: topk with swarm.topk_result_fraction (--topk-result-fraction)",
    )
    parser.add_argument("--topk-fraction", type=float, default=1 / 64, help="swarm.topk_fraction")
    parser.add_argument(
        "--topk-result-fraction", type=float, default=4 / 64, help="swarm.topk_result_fraction of topk-dense"
    )
    parser.add_argument(
        "--topk-lone-fraction",
        type=float,
        help="swarm.topk_lone_fraction of topk-dense (a lone holder's update; default: the result's share)",
    )
    parser.add_argument(
        "--lone-compression",
        choices=DENSE,
        help="swarm.lone_compression of topk-dense (a dense codec for a lone holder's update)",
    )
    parser.add_argument(
        "--expert-sync-rounds",
        type=int,
        default=1,
        help="swarm.expert_sync_rounds: experts averaged, and frozen copies refreshed, every K rounds",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one swarm may run")
    parser.add_argument("--run-dir", type=Path, help="where the swarms run (default: a new temporary directory)")
    parser.add_argument("--no-run", action="store_true", help="only read the records already in --run-dir")
    results.add_variant(parser)
    args = parser.parse_args()
    if args.no_run and args.run_dir is None:
        parser.error("--no-run needs --run-dir")
    seed = load_config(None, PAYLOAD).train.seed  # the swarms' train.seed and data.seed: the config's
    writer = results.start("comms", args.variant, seeds=[seed])
    console = Console(width=200)
    mb, gb = 1e6, 1e9
    codecs = {
        name: Codec(
            name.removesuffix("-dense"),
            args.topk_fraction,
            args.topk_result_fraction if name.endswith("-dense") else None,
            lone_fraction=args.topk_lone_fraction if name.endswith("-dense") else None,
            lone_compression=args.lone_compression if name.endswith("-dense") else None,
        )
        for name in args.compressions
    }

    shared, expert, experts = parameter_split(PAYLOAD)
    refreshed = 1 / args.expert_sync_rounds  # the share of frozen copies a round refreshes
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="p2p-spes-comms-"))
    t_start = time.monotonic()
    measured, computed, overhead = {}, {}, {}
    for name, codec in codecs.items():
        run = {"seconds": None, "error": None} if args.no_run else run_swarm(name, codec, args, run_dir)
        got = read_records(run_dir / name, args.peers, args.expert_sync_rounds)
        measured[name] = {**run, **got, "run_dir": str(run_dir / name)}
        computed[name] = ours(codec, shared, expert, experts, args.peers, refreshed)
        if "bytes" in got:
            overhead[name] = got["bytes"]["total"] / computed[name]["total"]
        status = f"error: {run['error']}" if run["error"] else "ok"
        console.print(
            f"{name}: {len(got['rounds'])} rounds counted ({got['records']} records), "
            f"{len(got['excluded'])} excluded, run {run['seconds']} s, {status}; {run_dir / name}"
        )
    wall = time.monotonic() - t_start

    table = Table(
        title=f"measured bytes per peer per sync round (MB), {args.peers} loopback peers, {shared / 1e6:.2f}M "
        f"shared + {experts} x {expert / 1e6:.3f}M expert parameters, {experts // args.peers} experts "
        "trained per peer; mean over complete rounds after each peer's first"
        + (f"; experts averaged every {args.expert_sync_rounds} rounds (a cycle's mean)" if refreshed < 1 else "")
    )
    for col in (
        "codec",
        "bits/value",
        "rounds x peers",
        "client out / in",
        "reducer in / out",
        "served (server log)",
        "downloaded",
        "frozen by update",
        "sent",
        "received",
        "total",
        "computed payload",
        "measured / computed",
    ):
        table.add_column(col, justify="left" if col == "codec" else "right")
    for name, got in measured.items():
        c = computed[name]
        if "bytes" not in got:
            table.add_row(name, f"{bits_per_value(codecs[name]):.3f}", "0", *["-"] * 8, f"{c['total'] / mb:.3f}", "-")
            continue
        b = got["bytes"]
        table.add_row(
            name,
            f"{bits_per_value(codecs[name]):.3f}",
            str(got["records"]),
            f"{b['client_sent'] / mb:.3f} / {b['client_received'] / mb:.3f}",
            f"{b['reducer_in'] / mb:.3f} / {b['reducer_out'] / mb:.3f}",
            f"{b['served'] / mb:.3f} ({got['served_logged_by_servers'] / mb:.3f})",
            f"{b['downloaded'] / mb:.3f}",
            f"{got['refreshed_by_delta']}/{got['refreshed']}",
            f"{b['sent'] / mb:.3f}",
            f"{b['received'] / mb:.3f}",
            f"{b['total'] / mb:.3f}",
            f"{c['total'] / mb:.3f}",
            f"{overhead[name]:.4f}",
        )
    console.print(table)
    ref = spes_reference(None, shared, expert, experts, args.peers)
    ar = allreduce_fp32(shared, expert, experts, args.peers)
    for name, got in measured.items():
        if "bytes" in got:
            total = got["bytes"]["total"]
            console.print(
                f"  loopback, {name}: a peer {sentence(ref['total'] / total, 'the SPES reference at fp32')} "
                f"({ref['total'] / mb:.1f} MB), {sentence(ar['total'] / total, 'an fp32 all-reduce of the whole model')}"
                f" ({ar['total'] / mb:.1f} MB)"
            )
    console.print(
        "served: what the others downloaded from a peer's experts, counted by them (a server counts only "
        "during its own round and misses downloads that come after it; its log in brackets). measured / "
        "computed is hivemind's protobuf framing on top of the codec's payload: the framing overhead used "
        "below (a codec without complete rounds is projected without it, 1.0)."
    )

    projections: dict = {}
    for config in PROJECTED:
        s, x, e = parameter_split(name=config)
        projections[config] = {"shared_params": s, "expert_params": x, "experts": e, "peers": {}}
        for peers in PROJECTED_PEERS:
            ref32 = spes_reference(None, s, x, e, peers)
            ar32 = allreduce_fp32(s, x, e, peers)
            rows = {}
            for name, codec in codecs.items():
                payload = ours(codec, s, x, e, peers, refreshed)
                factor = overhead.get(name, 1.0)
                mine = {k: v * factor for k, v in payload.items()}
                same = spes_reference(codec, s, x, e, peers)
                floor = serverless_floor(codec, s, x, e, peers, refreshed)
                rows[name] = {
                    "ours": mine,
                    "ours_payload": payload,
                    "framing_overhead": factor,
                    "spes_reference_same_precision": same,
                    "serverless_floor": floor,
                    "times_the_serverless_floor": mine["total"] / floor,
                    "ceiling_vs_spes_reference_fp32": ref32["total"] / floor,
                    "times_less_than_spes_reference_fp32": ref32["total"] / mine["total"],
                    "times_less_than_spes_reference_same_precision": same["total"] / mine["total"],
                    "times_less_than_allreduce_fp32": ar32["total"] / mine["total"],
                }
            projections[config]["peers"][str(peers)] = {
                "spes_reference_fp32": ref32,
                "allreduce_fp32": ar32,
                "codecs": rows,
            }

    for config, proj in projections.items():
        table = Table(
            title=f"{config} ({proj['shared_params'] / 1e6:.0f}M shared + {proj['experts']} x "
            f"{proj['expert_params'] / 1e6:.1f}M expert parameters): computed GB per peer per round, "
            "this project with the measured framing overhead; 'N x less': the baseline moves N times "
            "what we move; 'ceiling': the most any round with no server can reach at the codec's "
            "bytes per value (serverless_floor); 'of the floor': our bytes over that least"
        )
        for col in (
            "peers",
            "protocol",
            "sent GB",
            "received GB",
            "total GB",
            "vs SPES reference at fp32",
            "ceiling vs SPES reference at fp32",
            "of the floor",
            "vs SPES reference at the codec's precision",
            "vs fp32 all-reduce of the whole model",
        ):
            table.add_column(col, justify="left" if col in ("peers", "protocol") else "right")
        for peers, p in proj["peers"].items():
            for name, row in p["codecs"].items():
                m = row["ours"]
                table.add_row(
                    peers,
                    f"p2p-spes, {name}",
                    f"{m['sent'] / gb:.4f}",
                    f"{m['received'] / gb:.4f}",
                    f"{m['total'] / gb:.4f}",
                    less(row["times_less_than_spes_reference_fp32"]),
                    less(row["ceiling_vs_spes_reference_fp32"]),
                    f"{row['times_the_serverless_floor']:.4f}x",
                    less(row["times_less_than_spes_reference_same_precision"]),
                    less(row["times_less_than_allreduce_fp32"]),
                )
            for label, b in (
                ("SPES reference, fp32", p["spes_reference_fp32"]),
                ("fp32 all-reduce", p["allreduce_fp32"]),
            ):
                table.add_row(
                    peers,
                    label,
                    f"{b['sent'] / gb:.3f}",
                    f"{b['received'] / gb:.3f}",
                    f"{b['total'] / gb:.3f}",
                    "",
                    "",
                    "",
                    "",
                    "",
                    end_section=label == "fp32 all-reduce",
                )
        console.print(table)

    flat = Table(
        title="per peer, 4 -> 16 peers: every term of this project grows as (P-1)/P (but sparse's bundles, "
        "which grow as P - 1), so a peer moves at most 4/3 of its 4-peer bytes at any P (up to E); the SPES "
        "reference's server moves P times a peer's traffic"
    )
    for col in ("config", "protocol", "GB at 4 peers", "GB at 16 peers", "16 / 4 peers"):
        flat.add_column(col, justify="left" if col in ("config", "protocol") else "right")
    flatness: dict = {}
    for config, proj in projections.items():
        p4, p16 = proj["peers"]["4"], proj["peers"]["16"]
        flatness[config] = {}
        for name in codecs:
            a, b = p4["codecs"][name]["ours"]["total"], p16["codecs"][name]["ours"]["total"]
            flatness[config][name] = b / a
            flat.add_row(config, f"p2p-spes, {name}", f"{a / gb:.4f}", f"{b / gb:.4f}", f"{b / a:.3f}x")
        for label, key in (("SPES reference, fp32", "spes_reference_fp32"), ("fp32 all-reduce", "allreduce_fp32")):
            a, b = p4[key]["total"], p16[key]["total"]
            flatness[config][label] = b / a
            flat.add_row(
                config, label, f"{a / gb:.3f}", f"{b / gb:.3f}", f"{b / a:.3f}x", end_section=label == "fp32 all-reduce"
            )
    console.print(flat)

    # the targets, on spes-1b at 4 and 16 peers
    targets: dict = {}
    proj = projections["spes-1b"]["peers"]
    for peers in ("4", "16"):
        rows = proj[peers]["codecs"]
        best = max(rows, key=lambda n: rows[n]["times_less_than_spes_reference_fp32"])
        t = {
            "best_codec": best,
            "best_vs_spes_reference_fp32": rows[best]["times_less_than_spes_reference_fp32"],
            "best_vs_allreduce_fp32": rows[best]["times_less_than_allreduce_fp32"],
        }
        t["best_met"] = t["best_vs_spes_reference_fp32"] >= TARGETS["best_vs_spes_fp32"]
        t["best_vs_allreduce_met"] = t["best_vs_allreduce_fp32"] >= TARGETS["best_vs_allreduce_fp32"]
        if "int8" in rows:
            t["int8_vs_spes_reference_fp32"] = rows["int8"]["times_less_than_spes_reference_fp32"]
            t["int8_met"] = t["int8_vs_spes_reference_fp32"] >= TARGETS["int8_vs_spes_fp32"]
            t["int8_ceiling_vs_spes_reference_fp32"] = rows["int8"]["ceiling_vs_spes_reference_fp32"]
            t["int8_times_the_serverless_floor"] = rows["int8"]["times_the_serverless_floor"]
        targets[peers] = t
    growth = {n: flatness["spes-1b"][n] for n in codecs}
    floor_growth = {
        n: proj["16"]["codecs"][n]["serverless_floor"] / proj["4"]["codecs"][n]["serverless_floor"] for n in codecs
    }
    targets["flat"] = {
        "growth_16_over_4": growth,
        "met": all(g <= 1 + TARGETS["flat_within"] for g in growth.values()),
        "serverless_floor_growth_16_over_4": floor_growth,
        "growth_over_the_floors_growth": {n: growth[n] / floor_growth[n] for n in codecs},
    }
    console.print("[bold]targets (spes-1b):[/bold]")
    for peers in ("4", "16"):
        t = targets[peers]
        console.print(
            f"  {peers} peers: best codec {t['best_codec']} "
            f"{sentence(t['best_vs_spes_reference_fp32'], 'the SPES reference at fp32')} "
            f"(target >= {TARGETS['best_vs_spes_fp32']:.0f}: {'met' if t['best_met'] else 'NOT met'}) and "
            f"{t['best_vs_allreduce_fp32']:.1f} times less than an fp32 all-reduce of the whole model "
            f"(target ~{TARGETS['best_vs_allreduce_fp32']:.0f}: {'met' if t['best_vs_allreduce_met'] else 'NOT met'})"
        )
        if "int8_met" in t:
            console.print(
                f"  {peers} peers: int8 {sentence(t['int8_vs_spes_reference_fp32'], 'the SPES reference at fp32')} "
                f"(target >= {TARGETS['int8_vs_spes_fp32']}: {'met' if t['int8_met'] else 'NOT met'}); no round "
                f"without a server can do better than {t['int8_ceiling_vs_spes_reference_fp32']:.2f} times less "
                f"at int8's bytes per value, and ours moves {t['int8_times_the_serverless_floor']:.4f}x that least"
            )
    console.print(
        f"  flat in peers (16 peers within {TARGETS['flat_within']:.0%} of 4): "
        f"{'met' if targets['flat']['met'] else 'NOT met'}: per peer x"
        + ", x".join(f"{g:.3f} ({n})" for n, g in growth.items())
        + " from 4 to 16 peers (the (P-1)/P "
        "of an all-reduce; at most x1.333 for any number of peers); the least any round without a server "
        "can move grows by the same factor (x"
        + ", x".join(f"{targets['flat']['growth_over_the_floors_growth'][n]:.3f} ({n})" for n in codecs)
        + " of its growth)"
    )

    written = writer.write(
        {
            "wall_seconds": round(wall, 1),
            "peers": args.peers,
            "rounds": args.rounds,
            "expert_sync_rounds": args.expert_sync_rounds,
            "codecs": list(codecs),
            "topk_fraction": args.topk_fraction,
            "topk_k_per_block": codecs["topk"].k if "topk" in codecs else None,
            "topk_result_fraction": args.topk_result_fraction if "topk-dense" in codecs else None,
            "topk_lone_fraction": args.topk_lone_fraction if "topk-dense" in codecs else None,
            "lone_compression": args.lone_compression if "topk-dense" in codecs else None,
            "bits_per_value": {n: bits_per_value(c) for n, c in codecs.items()},
            "payload_config": PAYLOAD,
            "shared_params": shared,
            "expert_params": expert,
            "experts": experts,
            "measured": measured,
            "computed": computed,
            "framing_overhead": overhead,
            "measured_over_computed": {n: overhead[n] for n in overhead},
            "loopback_baselines": {"spes_reference_fp32": ref, "allreduce_fp32": ar},
            "loopback_times_less_than": {
                n: {
                    "spes_reference_fp32": ref["total"] / m["bytes"]["total"],
                    "allreduce_fp32": ar["total"] / m["bytes"]["total"],
                }
                for n, m in measured.items()
                if "bytes" in m
            },
            "projections": projections,
            "per_peer_growth_16_over_4_peers": flatness,
            "targets": {"wanted": TARGETS, "spes-1b": targets},
        }
    )
    console.print(f"wrote {written}; records in {run_dir}; {wall / 60:.1f} min")


if __name__ == "__main__":
    main()
