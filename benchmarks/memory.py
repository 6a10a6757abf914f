"""Per-peer training memory: centralized (every expert trained), a full-replica DiLoCo peer, and a
SPES peer (n of E experts), each with ``train.optimizer`` adamw and muon.

For each config the model is built on the ``meta`` device and its bytes of weights, gradients and
optimizer state are computed from the shapes; for the tiny config the same numbers are also measured
by real allocation on CPU after one optimizer step, and the two must agree.

    python -m benchmarks.memory [--configs tiny spes-1b spes-7b] [--peers 4] [--variant NAME]

Writes ``benchmarks/results/memory/<variant>.json`` (default ``main``).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.lab import results
from p2p_spes.config import TrainConfig, load_config
from p2p_spes.memory import expected_memory, measure_memory
from p2p_spes.model import MoETransformer
from p2p_spes.optim import build_optimizer

GIB = 1024**3


def _row(name: str, setup: str, report, method: str, optimizer: str) -> dict:
    weights = sum(report.parameters.values())
    grads = sum(report.gradients.values())
    optim = sum(report.optimizer.values())
    return {
        "config": name,
        "setup": setup,
        "method": method,
        "optimizer": optimizer,
        "weights_bytes": weights,
        "gradients_bytes": grads,
        "optimizer_bytes": optim,
        "total_bytes": weights + grads + optim,
        "expert_weights_bytes": report.parameters["local_experts"] + report.parameters["frozen_experts"],
    }


def setups(cfg, peers: int) -> list[tuple[str, list[int], TrainConfig]]:
    """Centralized and a SPES peer, each with AdamW and with Muon (one fp32 buffer for the attention
    and expert matrices where AdamW keeps two)."""
    e = cfg.moe.num_experts
    out = []
    for optimizer in ("adamw", "muon"):
        train = dataclasses.replace(cfg.train, optimizer=optimizer)
        out += [
            (f"centralized, {optimizer}", list(range(e)), train),
            (f"spes {e // peers}/{e}, {optimizer}", list(range(e // peers)), train),
        ]
    return out


def computed(name: str, peers: int) -> list[dict]:
    cfg = load_config(name)
    rows = []
    for setup, local, train in setups(cfg, peers):
        model = MoETransformer(cfg.model, cfg.moe, local_experts=local, device="meta")
        rows.append(_row(name, setup, expected_memory(model, train), "computed", train.optimizer))
    # a DiLoCo peer trains a full replica and keeps the outer optimizer's anchor and Nesterov momentum
    # (two more fp32 copies of every weight) on top of what centralized training needs
    diloco = dict(rows[0], setup="diloco replica (nesterov), adamw")
    diloco["optimizer_bytes"] += 2 * diloco["weights_bytes"]
    diloco["total_bytes"] += 2 * diloco["weights_bytes"]
    rows.append(diloco)
    return rows


def measured_tiny(peers: int) -> list[dict]:
    cfg = load_config("tiny")
    rows = []
    for setup, local, train in setups(cfg, peers):
        model = MoETransformer(cfg.model, cfg.moe, local_experts=local)
        model.init_weights(0)
        opt = build_optimizer(model, train)
        idx = torch.randint(0, cfg.model.vocab_size, (2, 32))
        model.loss(idx, idx).loss.backward()
        opt.step()
        report = measure_memory(model, opt)
        assert report.to_dict() == expected_memory(model, train).to_dict(), "measured bytes differ from computed bytes"
        rows.append(_row("tiny", setup, report, "measured", train.optimizer))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["tiny", "spes-1b", "spes-7b"])
    parser.add_argument("--peers", type=int, default=4, help="SPES peers P: each trains E/P experts (default 4)")
    results.add_variant(parser)
    args = parser.parse_args(argv)
    writer = results.start("memory", args.variant, argv=argv)  # computed from shapes; no seed

    rows = []
    for name in args.configs:
        rows += computed(name, args.peers)
    if "tiny" in args.configs:
        rows += measured_tiny(args.peers)

    table = Table(
        title=f"Per-peer training memory (fp32 weights, fp32 grads, optimizer state), {args.peers} SPES peers"
    )
    for col in (
        "config",
        "setup",
        "method",
        "weights GiB",
        "grads GiB",
        "optimizer GiB",
        "total GiB",
        "vs centralized",
    ):
        table.add_column(col, justify="left" if col in ("config", "setup", "method") else "right")
    # each setup against centralized training with the same optimizer
    base = {
        (r["config"], r["method"], r["optimizer"]): r["total_bytes"]
        for r in rows
        if r["setup"].startswith("centralized")
    }
    for r in rows:
        ratio = r["total_bytes"] / base[(r["config"], r["method"], r["optimizer"])]
        r["ratio_to_centralized"] = ratio
        table.add_row(
            r["config"],
            r["setup"],
            r["method"],
            *(f"{r[k] / GIB:.3f}" for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes", "total_bytes")),
            f"{ratio:.2f}x",
        )
    Console(width=120).print(table)
    print(f"wrote {writer.write({'peers': args.peers, 'rows': rows})}")
    return rows


if __name__ == "__main__":
    main()
