"""The DHT status inspector: joins a run as a client-only DHT peer, reads its records, changes nothing.

What it shows comes from the records peers publish as part of their normal work (``dht/records.py``):
per peer its experts, step, round, loss, throughput and traffic; per expert its live holders; per
peer its last sync round. Malformed records are skipped.
"""

from __future__ import annotations

import time
from typing import Any

from hivemind.utils import get_dht_time

from dht.records import PeerRecord, peers_key, subkey_values


def collect(dht, run_id: str) -> dict[str, Any]:
    """One JSON-able snapshot of the run: peers, expert coverage, rounds and totals."""
    now = get_dht_time()
    raw = subkey_values(dht.get(peers_key(run_id), latest=True))
    peers = []
    for peer_id, value in sorted(raw.items()):
        record = PeerRecord.from_value(peer_id, value)
        if record is None or value.get("left"):
            continue
        extra = record.extra
        peers.append({
            "peer_id": peer_id, "maddrs": record.maddrs, "experts": record.experts, "step": record.step,
            "round": record.round, "loss": extra.get("loss"), "tokens": extra.get("tokens", 0),
            "tokens_per_s": extra.get("tokens_per_s", 0.0), "bytes_sent": extra.get("bytes_sent", 0),
            "bytes_received": extra.get("bytes_received", 0), "rounds_joined": extra.get("rounds_joined", 0),
            "rounds_failed": extra.get("rounds_failed", 0), "sync_seconds": extra.get("sync_seconds"),
            "last_seen_s": round(now - extra["time"], 1) if isinstance(extra.get("time"), float) else None,
            "version": extra.get("version"), "device": extra.get("device"), "fingerprint": record.fingerprint,
        })
    num_experts = max((r.get("num_experts", 0) for r in raw.values() if isinstance(r, dict)), default=0)
    replicas = max((r.get("replicas", 1) for r in raw.values() if isinstance(r, dict)), default=1)
    holders: dict[int, list[str]] = {e: [] for e in range(num_experts)}
    for p in peers:
        for e in p["experts"]:
            holders.setdefault(e, []).append(p["peer_id"])
    coverage = [
        {"expert": e, "holders": len(h), "peers": h, "status": "missing" if not h else ("low" if len(h) < replicas else "ok")}
        for e, h in sorted(holders.items())
    ]
    fingerprints = sorted({p["fingerprint"] for p in peers})
    return {
        "run_id": run_id, "time": now, "peers": peers, "coverage": coverage, "replicas": replicas,
        "rounds": [
            {"peer_id": p["peer_id"], "round": p["round"], "sync_seconds": p["sync_seconds"],
             "rounds_joined": p["rounds_joined"], "rounds_failed": p["rounds_failed"]}
            for p in peers
        ],
        "run": {
            "fingerprints": fingerprints, "peers": len(peers), "total_tokens": sum(p["tokens"] or 0 for p in peers),
            "tokens_per_s": round(sum(p["tokens_per_s"] or 0 for p in peers), 1),
            "bytes_sent": sum(p["bytes_sent"] or 0 for p in peers),
        },
    }


def render(snapshot: dict[str, Any], console) -> None:
    """Human-readable tables (rich) of what :func:`collect` returned."""
    from rich.table import Table

    run = snapshot["run"]
    console.print(
        f"run {snapshot['run_id']!r}: {run['peers']} live peers, model {', '.join(run['fingerprints']) or '-'}, "
        f"{run['total_tokens']:,} tokens, {run['tokens_per_s']:,} tokens/s"
    )
    peers = Table(title="peers")
    for col in ("peer", "experts", "step", "round", "loss", "tokens/s", "sent MB", "recv MB", "last seen s", "device"):
        peers.add_column(col)
    for p in snapshot["peers"]:
        peers.add_row(
            p["peer_id"][-10:], str(p["experts"]), str(p["step"]), str(p["round"]),
            "-" if p["loss"] is None else f"{p['loss']:.3f}", f"{p['tokens_per_s'] or 0:.0f}",
            f"{(p['bytes_sent'] or 0) / 1e6:.1f}", f"{(p['bytes_received'] or 0) / 1e6:.1f}",
            str(p["last_seen_s"]), str(p["device"]),
        )
    console.print(peers)
    coverage = Table(title=f"expert coverage (target {snapshot['replicas']} holder(s) each)")
    for col in ("expert", "holders", "status", "peers"):
        coverage.add_column(col)
    for c in snapshot["coverage"]:
        style = {"missing": "red", "low": "yellow"}.get(c["status"])
        coverage.add_row(str(c["expert"]), str(c["holders"]), c["status"], ", ".join(p[-10:] for p in c["peers"]), style=style)
    console.print(coverage)


def watch(dht, run_id: str, interval: float, console, as_json: bool, iterations: int | None = None) -> None:
    """Print a snapshot every ``interval`` seconds (``iterations`` bounds it; Ctrl-C stops it)."""
    import json

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
