"""The DHT status inspector: joins a run as a client-only DHT peer, reads its records, changes nothing.

What it shows comes from the signed records peers publish as part of their normal work
(``dht/records.py``): per peer its experts, step, round, loss, throughput and traffic; per expert its
live holders; per sync round its participants, duration, bytes and failures (from each peer's last
rounds); the run's published config hash. The inspector's DHT checks every signature and schema
(``dht/validators.py``), and a record naming a peer other than its signer is dropped, so only
validated records are shown.
"""

from __future__ import annotations

import json
import time
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time
from rich.console import Console
from rich.table import Table

from dht.auth import RunAuth
from dht.keys import peers_key
from dht.node import start_dht
from dht.reachability import RECORD_FIELD
from dht.records import PeerRecord, signed_values
from dht.run_config import read_records


def open_dht(initial_peers: list[str], run_id: str, startup_timeout: float = 15.0, auth: RunAuth | None = None) -> DHT:
    """A client-only DHT with the run's validators: it stores nothing and serves nothing."""
    dht, _ = start_dht(
        None, [run_id], auth=auth, initial_peers=initial_peers, client_mode=True, startup_timeout=startup_timeout
    )
    return dht


def _rounds(raw: dict[str, dict[str, Any]], peer_ids: set[str]) -> list[dict[str, Any]]:
    """Per sync round, merged from the last rounds each live peer reports (newest first)."""
    merged: dict[int, dict[str, Any]] = {}
    for peer_id in sorted(peer_ids):
        recent = raw[peer_id].get("recent_rounds")
        for r in recent if isinstance(recent, list) else []:
            if not isinstance(r, dict) or not isinstance(r.get("round"), int):
                continue
            row = merged.setdefault(
                r["round"],
                {
                    "round": r["round"],
                    "step": r.get("step"),
                    "participants": 0,
                    "reported_by": [],
                    "ok": 0,
                    "alone": 0,
                    "seconds": 0.0,
                    "bytes_sent": 0,
                    "bytes_received": 0,
                    "failed_groups": 0,
                },
            )
            row["reported_by"].append(peer_id)
            row["participants"] = max(row["participants"], int(r.get("members") or 0))
            row["ok"] += bool(r.get("ok"))  # averaged with other peers
            row["alone"] += r.get("outcome") == "alone"  # nobody else came: nothing was averaged
            row["seconds"] = max(row["seconds"], float(r.get("seconds") or 0.0))
            for k in ("bytes_sent", "bytes_received", "failed_groups"):
                row[k] += int(r.get(k) or 0)
    return [merged[n] for n in sorted(merged, reverse=True)]


def collect(dht: DHT, run_id: str) -> dict[str, Any]:
    """One JSON-able snapshot of the run: peers, expert coverage, rounds and totals."""
    now = get_dht_time()
    raw = signed_values(dht.get(peers_key(run_id), latest=True))
    peers = []
    for peer_id, value in sorted(raw.items()):
        record = PeerRecord.from_value(peer_id, value)
        if record is None or value.get("left"):
            continue
        extra = record.extra
        peers.append(
            {
                "peer_id": peer_id,
                "maddrs": record.maddrs,
                "experts": record.experts,
                "step": record.step,
                "round": record.round,
                "loss": extra.get("loss"),
                "tokens": extra.get("tokens", 0),
                "tokens_per_s": extra.get("tokens_per_s", 0.0),
                "bytes_sent": extra.get("bytes_sent", 0),
                "bytes_received": extra.get("bytes_received", 0),
                "rounds_joined": extra.get("rounds_joined", 0),  # averaged
                "rounds_adopted": extra.get("rounds_adopted", 0),
                "rounds_alone": extra.get("rounds_alone", 0),
                "rounds_failed": extra.get("rounds_failed", 0),
                "sync_seconds": extra.get("sync_seconds"),
                "last_seen_s": round(now - extra["time"], 1) if isinstance(extra.get("time"), float) else None,
                "version": extra.get("version"),
                "device": extra.get("device"),
                "fingerprint": record.fingerprint,
                "residency": extra.get("residency", "full"),
                "experts_taken_over": extra.get("experts_taken_over", 0),
                "data": _data_fingerprint(extra),
                "data_partition": extra.get("data_partition"),
                # public: others dial it and it reduces; private: a client of its groups; None: an older peer
                "reachability": extra.get(RECORD_FIELD) if extra.get(RECORD_FIELD) in ("public", "private") else None,
            }
        )
    num_experts = max((r.get("num_experts", 0) for r in raw.values() if isinstance(r, dict)), default=0)
    replicas = max((r.get("replicas", 1) for r in raw.values() if isinstance(r, dict)), default=1)
    holders: dict[int, list[str]] = {e: [] for e in range(num_experts)}
    for p in peers:
        for e in p["experts"]:
            holders.setdefault(e, []).append(p["peer_id"])
    coverage = [
        {
            "expert": e,
            "holders": len(h),
            "peers": h,
            "status": "missing" if not h else ("low" if len(h) < replicas else "ok"),
        }
        for e, h in sorted(holders.items())
    ]
    fingerprints = sorted({p["fingerprint"] for p in peers})
    configs: dict[str, list[str]] = {}
    for publisher, value in read_records(dht, run_id).items():
        if isinstance(value.get("hash"), str):
            configs.setdefault(value["hash"], []).append(publisher)
    return {
        "run_id": run_id,
        "time": now,
        "peers": peers,
        "coverage": coverage,
        "replicas": replicas,
        "rounds": _rounds(raw, {p["peer_id"] for p in peers}),
        "run": {
            "config_hashes": [{"hash": h, "publishers": sorted(ps)} for h, ps in sorted(configs.items())],
            "fingerprints": fingerprints,
            "data": sorted({p["data"] for p in peers if p["data"]}),
            "peers": len(peers),
            "private_peers": sum(p["reachability"] == "private" for p in peers),
            "total_tokens": sum(p["tokens"] or 0 for p in peers),
            "tokens_per_s": round(sum(p["tokens_per_s"] or 0 for p in peers), 1),
            "bytes_sent": sum(p["bytes_sent"] or 0 for p in peers),
            "bytes_received": sum(p["bytes_received"] or 0 for p in peers),
        },
    }


def _data_fingerprint(extra: dict[str, Any]) -> str | None:
    """The data a peer trains on, from the holding it publishes once its data is on disk."""
    value = extra.get("data")
    return value["fingerprint"] if isinstance(value, dict) and isinstance(value.get("fingerprint"), str) else None


def _experts(peer: dict[str, Any]) -> str:
    """The experts a peer trains, its residency when partial and how many it took over from others."""
    text = str(peer["experts"])
    if peer.get("residency") == "partial":
        text += " partial"
    if peer.get("experts_taken_over"):
        text += f" (+{peer['experts_taken_over']} taken over)"
    return text


def render(snapshot: dict[str, Any], console: Console) -> None:
    """Human-readable tables (rich) of what :func:`collect` returned."""
    run = snapshot["run"]
    hashes = ", ".join(f"{c['hash'][:16]} ({len(c['publishers'])} publisher(s))" for c in run["config_hashes"]) or "-"
    console.print(
        f"run {snapshot['run_id']!r}: {run['peers']} live peers ({run.get('private_peers', 0)} private), model {', '.join(run['fingerprints']) or '-'}, "
        f"data {', '.join(d[:16] for d in run.get('data', [])) or '-'}, config {hashes}, {run['total_tokens']:,} tokens, {run['tokens_per_s']:,} tokens/s"
    )
    peers = Table(title="peers")
    columns = (
        "peer",
        "address",
        "reach",
        "experts",
        "step",
        "round",
        "loss",
        "tokens/s",
        "sent MB",
        "recv MB",
        "rounds avg/adopt/alone/fail",
        "last seen s",
        "version",
        "device",
    )
    for col in columns:
        left = col in ("peer", "address", "reach", "experts", "version", "device")
        peers.add_column(col, justify="left" if left else "right")
    for p in snapshot["peers"]:
        peers.add_row(
            p["peer_id"][-10:],
            _address(p["maddrs"]),
            p.get("reachability") or "-",
            _experts(p),
            str(p["step"]),
            str(p["round"]),
            "-" if p["loss"] is None else f"{p['loss']:.3f}",
            f"{p['tokens_per_s'] or 0:.0f}",
            f"{(p['bytes_sent'] or 0) / 1e6:.1f}",
            f"{(p['bytes_received'] or 0) / 1e6:.1f}",
            f"{p['rounds_joined']}/{p['rounds_adopted']}/{p['rounds_alone']}/{p['rounds_failed']}",
            str(p["last_seen_s"]),
            str(p["version"]),
            str(p["device"]),
        )
    console.print(peers)
    coverage = Table(title=f"expert coverage (target {snapshot['replicas']} holder(s) each)")
    for col in ("expert", "holders", "status", "peers"):
        coverage.add_column(col)
    for c in snapshot["coverage"]:
        style = {"missing": "red", "low": "yellow"}.get(c["status"])
        status = {"missing": "MISSING", "low": "LOW"}.get(c["status"], c["status"])
        coverage.add_row(
            str(c["expert"]), str(c["holders"]), status, ", ".join(p[-10:] for p in c["peers"]), style=style
        )
    console.print(coverage)
    if snapshot["rounds"]:
        rounds = Table(title="sync rounds (latest first)")
        for col in (
            "round",
            "step",
            "participants",
            "averaged / alone / reported",
            "seconds",
            "sent MB",
            "recv MB",
            "failed groups",
        ):
            rounds.add_column(col, justify="right")
        for r in snapshot["rounds"]:
            rounds.add_row(
                str(r["round"]),
                str(r["step"]),
                str(r["participants"]),
                f"{r['ok']} / {r['alone']} / {len(r['reported_by'])}",
                f"{r['seconds']:.2f}",
                f"{r['bytes_sent'] / 1e6:.1f}",
                f"{r['bytes_received'] / 1e6:.1f}",
                str(r["failed_groups"]),
                style="yellow" if r["failed_groups"] or r["alone"] else None,
            )
        console.print(rounds)


def _address(maddrs: list[str]) -> str:
    """HOST:PORT of the first multiaddr (the peer column already names the peer; --json has them all)."""
    if not maddrs:
        return "-"
    parts = maddrs[0].split("/")
    if len(parts) >= 5 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6") and parts[3] in ("tcp", "udp"):
        return f"{parts[2]}:{parts[4]}"
    return maddrs[0].split("/p2p/")[0]


def watch(
    dht: DHT, run_id: str, interval: float, console: Console, as_json: bool, iterations: int | None = None
) -> None:
    """Print a snapshot every ``interval`` seconds (``iterations`` bounds it; Ctrl-C stops it)."""
    count = 0
    while iterations is None or count < iterations:
        snapshot = collect(dht, run_id)
        if as_json:
            print(json.dumps(snapshot), flush=True)
        else:
            console.clear()
            render(snapshot, console)
        count += 1
        time.sleep(interval)
