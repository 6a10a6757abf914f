"""Partial versus full expert residency: per-peer memory, bytes per sync round, validation loss.

Memory is computed from the shapes on the ``meta`` device (weights, fp32 gradients and AdamW state
of a peer training E/P experts) for each config. Traffic and loss are measured: a loopback swarm of
P peers trains the same config for the same steps once with ``swarm.residency=full`` and once with
``partial``; per peer it reports the bytes received per round (averaging groups plus downloads),
the peer's own validation loss (a partial peer evaluates with its skips) and the validation loss
of the full model assembled from the peers' final checkpoints (shared weights from one peer, each
expert from its holder), all at equal tokens.

    python -m benchmarks.residency [--configs tiny spes-1b spes-7b] [--peers 4] [--run-config tiny]
        [--run-peers 2] [--steps 100] [--sync-steps 20] [--set k=v ...] [--skip-runs] [--variant NAME]

Writes ``benchmarks/results/residency/<variant>.json`` (default ``main``).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.lab import results
from p2p_spes.config import load_config
from p2p_spes.memory import expected_memory
from p2p_spes.metrics_log import read_metrics
from p2p_spes.model import MoETransformer

GIB = 1024**3


def memory_rows(name: str, peers: int) -> list[dict]:
    cfg = load_config(name)
    e = cfg.moe.num_experts
    rows = []
    for residency in ("full", "partial"):
        model = MoETransformer(
            cfg.model,
            cfg.moe,
            local_experts=list(range(e // peers)),
            device="meta",
            resident_only=residency == "partial",
        )
        report = expected_memory(model, cfg.train)
        weights, grads, optim = (sum(d.values()) for d in (report.parameters, report.gradients, report.optimizer))
        rows.append(
            {
                "config": name,
                "residency": residency,
                "experts_held": f"{e // peers}/{e}",
                "weights_bytes": weights,
                "gradients_bytes": grads,
                "optimizer_bytes": optim,
                "total_bytes": weights + grads + optim,
            }
        )
    return rows


def assembled_val_loss(config: str, overrides: list[str], peer_dirs: list[Path]) -> float:
    """Validation loss of the full model put together from the peers' final checkpoints."""
    from safetensors.torch import load_file

    from p2p_spes.checkpoint import WEIGHTS, find_checkpoint
    from p2p_spes.train import Trainer

    cfg = load_config(config, [o for o in overrides if not o.startswith("swarm.residency")])
    tmp = Path(tempfile.mkdtemp(prefix="residency-eval-"))
    try:
        trainer = Trainer(cfg, run_dir=tmp)
        for run_dir in peer_dirs:  # after the last round the shared weights agree; experts come from holders
            trainer.model.load_state_dict(load_file(str(find_checkpoint(run_dir) / WEIGHTS)), strict=False)
        return trainer.evaluate()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def swarm_rows(config: str, peers: int, steps: int, sync_steps: int, extra: list[str], work: Path) -> list[dict]:
    from p2p_spes.local_swarm import LocalSwarm

    rows = []
    for residency in ("full", "partial"):
        overrides = [
            f"train.max_steps={steps}",
            f"swarm.sync_steps={sync_steps}",
            "swarm.merge_interval=0",
            f"train.eval_interval={steps}",
            f"train.checkpoint_interval={steps}",
            f"swarm.residency={residency}",
            *extra,
        ]
        run_dir = work / residency
        swarm = LocalSwarm(config, overrides, peers=peers, run_dir=run_dir)
        swarm.run(timeout=60 * 60)
        dirs = [run_dir / f"peer{i}" for i in range(peers)]
        assembled = assembled_val_loss(config, overrides, dirs)
        for i, s in enumerate(swarm.summaries()):
            rounds = read_metrics(dirs[i])
            skips = [sum(r["skip_rate"]) / len(r["skip_rate"]) for r in rounds if "skip_rate" in r]
            n_rounds = max(s["rounds_joined"] + s["rounds_failed"], 1)
            mem = s["memory"]
            rows.append(
                {
                    "residency": residency,
                    "peer": i,
                    "experts": s["local_experts"],
                    "tokens": s["tokens"],
                    "rounds": n_rounds,
                    "mb_received_per_round": s["bytes_received"] / n_rounds / 1e6,
                    "mb_sent_per_round": s["bytes_sent"] / n_rounds / 1e6,
                    "memory_mb": (
                        sum(mem["parameters"].values())
                        + sum(mem["gradients"].values())
                        + sum(mem["optimizer"].values())
                    )
                    / 1e6,
                    "peer_val_loss": s["final_val_loss"],
                    "assembled_val_loss": assembled,
                    "mean_skip_rate": sum(skips) / len(skips) if skips else 0.0,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["tiny", "spes-1b", "spes-7b"])
    parser.add_argument("--peers", type=int, default=4, help="peers P for the memory table: each holds E/P experts")
    parser.add_argument("--run-config", default="tiny", help="config of the measured loopback swarms")
    parser.add_argument("--run-peers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--sync-steps", type=int, default=20)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    parser.add_argument("--skip-runs", action="store_true", help="memory table only")
    results.add_variant(parser)
    args = parser.parse_args(argv)
    seeds = [] if args.skip_runs else [load_config(args.run_config, args.overrides).train.seed]  # the swarms'
    writer = results.start("residency", args.variant, seeds=seeds, argv=argv)

    console = Console(width=140)
    memory = [row for name in args.configs for row in memory_rows(name, args.peers)]
    table = Table(title=f"per-peer training memory, E/{args.peers} experts held (GiB)")
    for col in ("config", "residency", "experts", "weights", "grads", "optimizer", "total", "vs full"):
        table.add_column(col, justify="left" if col in ("config", "residency", "experts") else "right")
    for row in memory:
        full = next(r for r in memory if r["config"] == row["config"] and r["residency"] == "full")
        table.add_row(
            row["config"],
            row["residency"],
            row["experts_held"],
            f"{row['weights_bytes'] / GIB:.3f}",
            f"{row['gradients_bytes'] / GIB:.3f}",
            f"{row['optimizer_bytes'] / GIB:.3f}",
            f"{row['total_bytes'] / GIB:.3f}",
            f"{row['total_bytes'] / full['total_bytes']:.2f}x",
        )
    console.print(table)

    runs: list[dict] = []
    if not args.skip_runs:
        with tempfile.TemporaryDirectory(prefix="residency-") as work:
            runs = swarm_rows(args.run_config, args.run_peers, args.steps, args.sync_steps, args.overrides, Path(work))
        table = Table(
            title=f"loopback swarm, {args.run_config}, {args.run_peers} peers, {args.steps} steps, "
            f"sync every {args.sync_steps}"
        )
        for col in (
            "residency",
            "peer",
            "experts",
            "tokens",
            "rounds",
            "recv MB/round",
            "sent MB/round",
            "memory MB",
            "skip rate",
            "peer val loss",
            "assembled val loss",
        ):
            table.add_column(col, justify="left" if col in ("residency", "experts") else "right")
        for r in runs:
            table.add_row(
                r["residency"],
                str(r["peer"]),
                str(r["experts"]),
                str(r["tokens"]),
                str(r["rounds"]),
                f"{r['mb_received_per_round']:.2f}",
                f"{r['mb_sent_per_round']:.2f}",
                f"{r['memory_mb']:.1f}",
                f"{r['mean_skip_rate']:.3f}",
                f"{r['peer_val_loss']:.3f}",
                f"{r['assembled_val_loss']:.3f}",
            )
        console.print(table)

    out = {"memory": memory, "swarm": runs, "args": vars(args)}
    print(f"wrote {writer.write(out)}")
    return out


if __name__ == "__main__":
    main()
