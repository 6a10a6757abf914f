"""Bytes per peer per sync round: this project against the SPES reference protocol and DiLoCo.

    python benchmarks/comms.py                     # 4 loopback peers x compression none/fp16/uint8, ~6 min
    python benchmarks/comms.py --compressions none --rounds 4

Measured: a real 4-peer loopback swarm of a config whose payloads dominate (shared parameters and 8
experts of a few MB each), one run per compression. Each peer's round records hold what its groups
sent and received plus the expert refreshes it downloaded and what others downloaded from it; the
table averages rounds after the first (peers join and catch up before it).

Computed from the same model's parameter counts (fp32, P peers, each training E/P experts, one
holder per expert), per peer and round:

* this project: shared group all-reduce (reduce-scatter + all-gather: 2(P-1)/P of the shared
  parameters each way, compressed) + downloading each expert it does not train once, fp32
  (E - E/P experts) + serving its own experts to the P-1 others;
* SPES reference: upload the trained keys (shared + own experts), download the whole model, fp32;
* DiLoCo (full replicas): butterfly all-reduce of the whole model, 2(P-1)/P each way, fp32.

The same formulas project to the 1B and 7B configs. Writes ``benchmarks/results/comms.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2p_spes.config import load_config
from p2p_spes.local_swarm import LocalSwarm
from p2p_spes.model import MoETransformer

RESULTS = Path(__file__).parent / "results" / "comms.json"
PAYLOAD = [
    "model.d_model=256", "model.num_layers=2", "model.num_heads=4", "model.max_seq_len=64",
    "moe.num_experts=8", "moe.ffn_dim=512", "train.batch_size=2", "train.warmup_steps=2",
    "train.eval_interval=100000", "train.log_interval=100000", "train.checkpoint_interval=100000",
    "swarm.sync_steps=3", "swarm.matchmaking_time=4", "swarm.averaging_timeout=30",
]
CODEC_BYTES = {"none": 4.0, "fp16": 2.0, "uint8": 1.0}  # per element on the wire (uint8 adds a codebook)


def parameter_split(overrides: list[str] | None = None, name: str | None = None) -> tuple[int, int, int]:
    """(shared parameters, parameters of one expert over all layers, number of experts)."""
    cfg = load_config(name, overrides or [])
    model = MoETransformer(cfg.model, cfg.moe, local_experts=list(range(cfg.moe.num_experts)), device="meta")
    total = sum(p.numel() for p in model.parameters())
    per_expert = cfg.model.num_layers * 3 * cfg.model.d_model * cfg.moe.ffn_dim
    return total - cfg.moe.num_experts * per_expert, per_expert, cfg.moe.num_experts


def computed(shared: int, expert: int, experts: int, peers: int, codec: str = "none") -> dict[str, dict[str, float]]:
    """Bytes sent and received per peer per round for each protocol (see the module docstring)."""
    own = experts // peers
    ring = 2 * (peers - 1) / peers
    whole = shared + experts * expert
    return {
        f"p2p-spes ({codec})": {
            "sent": ring * shared * CODEC_BYTES[codec] + (peers - 1) * own * expert * 4,
            "received": ring * shared * CODEC_BYTES[codec] + (experts - own) * expert * 4,
        },
        "SPES reference": {"sent": (shared + own * expert) * 4, "received": whole * 4},
        "DiLoCo all-reduce": {"sent": ring * whole * 4, "received": ring * whole * 4},
    }


def measure(codec: str, peers: int, rounds: int, run_dir: Path) -> dict[str, float]:
    """Mean bytes sent/received per peer per round on a loopback swarm (rounds after the first)."""
    overrides = PAYLOAD + [f"swarm.compression={codec}", f"train.max_steps={3 * (rounds + 1)}"]
    swarm = LocalSwarm(None, overrides, peers=peers, run_dir=run_dir / codec, run_id=f"comms-{codec}")
    swarm.run(timeout=600, stagger=1.0)
    sent, received = [], []
    for i in range(peers):
        lines = (run_dir / codec / f"peer{i}" / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines if '"sync_round"' in line]
        for r in records[1:]:
            if r["shared_ok"] and not r["groups_failed"] and not r["refresh_missed"]:
                # as a client (contributions out, averaged parts in), as a reducer for the others
                # (contributions in, averaged parts out), and expert copies downloaded and served
                sent.append(r["bytes_sent"] + r["reducer_out_bytes"] + r["served_bytes"])
                received.append(r["bytes_received"] + r["reducer_in_bytes"] + r["downloaded_bytes"])
    if not sent:
        raise SystemExit(f"no complete round after the first; logs in {run_dir / codec}")
    return {"sent": statistics.fmean(sent), "received": statistics.fmean(received), "rounds": len(sent)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4, help="sync rounds per run (the first is not counted)")
    parser.add_argument("--compressions", nargs="+", default=["none", "fp16", "uint8"], choices=list(CODEC_BYTES))
    args = parser.parse_args()
    console = Console(width=130)
    mb = 1e6

    shared, expert, experts = parameter_split(PAYLOAD)
    run_dir = Path(tempfile.mkdtemp(prefix="p2p-spes-comms-"))
    table = Table(title=f"bytes per peer per sync round, {args.peers} loopback peers, {shared / 1e6:.1f}M shared + "
                        f"{experts} x {expert / 1e6:.2f}M expert parameters")
    for col in ("protocol", "sent MB", "received MB", "total MB", "computed MB", "SPES ref / this", "DiLoCo / this"):
        table.add_column(col, justify="left" if col == "protocol" else "right")
    base = computed(shared, expert, experts, args.peers)
    ref = base["SPES reference"]["sent"] + base["SPES reference"]["received"]
    diloco = base["DiLoCo all-reduce"]["sent"] + base["DiLoCo all-reduce"]["received"]
    rows = []
    for codec in args.compressions:
        got = measure(codec, args.peers, args.rounds, run_dir)
        model = computed(shared, expert, experts, args.peers, codec)[f"p2p-spes ({codec})"]
        total = got["sent"] + got["received"]
        rows.append({"protocol": f"p2p-spes ({codec})", "measured": got, "computed": model,
                     "vs_spes_reference": ref / total, "vs_diloco": diloco / total})
        table.add_row(f"p2p-spes ({codec}), measured", f"{got['sent'] / mb:.2f}", f"{got['received'] / mb:.2f}",
                      f"{total / mb:.2f}", f"{(model['sent'] + model['received']) / mb:.2f}",
                      f"{ref / total:.2f}x", f"{diloco / total:.2f}x")
    for name in ("SPES reference", "DiLoCo all-reduce"):
        b = base[name]
        table.add_row(f"{name}, computed", f"{b['sent'] / mb:.2f}", f"{b['received'] / mb:.2f}",
                      f"{(b['sent'] + b['received']) / mb:.2f}", "", "", "")
    console.print(table)
    console.print("ratios above 1: this project moves less per peer. The SPES reference also needs a central server "
                  f"that moves {args.peers}x a peer's traffic every round ({args.peers * ref / mb:.0f} MB here).")

    projection = Table(title=f"computed bytes per peer per round, {args.peers} peers, fp32 unless noted")
    for col in ("config", "protocol", "sent GB", "received GB", "total GB", "vs this (none)"):
        projection.add_column(col, justify="left" if col in ("config", "protocol") else "right")
    projected = {}
    for name in ("spes-1b", "spes-7b"):
        s, x, e = parameter_split(name=name)
        protocols = {**computed(s, x, e, args.peers), **computed(s, x, e, args.peers, "uint8")}
        ours = sum(protocols["p2p-spes (none)"].values())
        projected[name] = protocols
        for proto, b in protocols.items():
            total = b["sent"] + b["received"]
            projection.add_row(name, proto, f"{b['sent'] / 1e9:.2f}", f"{b['received'] / 1e9:.2f}", f"{total / 1e9:.2f}",
                               f"{total / ours:.2f}x")
    console.print(projection)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "command": "python benchmarks/comms.py " + " ".join(sys.argv[1:]), "peers": args.peers,
        "payload_config": PAYLOAD, "shared_params": shared, "expert_params": expert, "experts": experts,
        "measured": rows, "computed_baselines": base, "projected": projected,
    }, indent=1))
    console.print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
