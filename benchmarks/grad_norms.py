"""Gradient norms of a peer's batch against centralized training's, at the same weights.

    python -m benchmarks.grad_norms        # ~3 min, seed 0

Trains the quality benchmark's model (``benchmarks/quality.py``'s setup: the convergence benchmark's
narrow tiny config, 400 steps) centrally with batches of P x 8 sequences, exactly as
``benchmarks/local_steps.py``'s centralized arm, and at every step also measures the gradient norm of
each of the P batches of 8 those sequences split into (at the same weights, not applied). Where
gradient noise dominates, a batch P times smaller has a norm up to sqrt(P) larger; with
``train.grad_clip`` unchanged, a swarm peer's batches are then clipped where centralized training's
are not. Prints, per span of steps, how often each is above the clip threshold and the mean ratio of
the norms, and writes ``benchmarks/results/grad_norms/<variant>.json`` (``--variant``, default ``main``).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from rich.console import Console
from rich.table import Table

from benchmarks import convergence
from benchmarks.lab import results
from p2p_spes.config import load_config
from p2p_spes.corpus import prepare_embedded_data
from p2p_spes.data import BatchLoader, TokenDataset
from p2p_spes.model import MoETransformer
from p2p_spes.optim import build_optimizer, lr_at, set_lr, trainable_parameters

PEERS = 4


def grad_norm(model: MoETransformer, x: torch.Tensor, y: torch.Tensor, z_loss: float) -> float:
    """The unclipped gradient norm of one batch (the gradients are left in place)."""
    model.loss(x, y, z_loss_weight=z_loss).loss.backward()
    params = [p for _, p in trainable_parameters(model)]
    return torch.nn.utils.clip_grad_norm_(params, float("inf")).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=8, help="a peer's batch; centralized trains P x this")
    parser.add_argument("--seed", type=int, default=0)
    results.add_variant(parser)
    args = parser.parse_args()
    writer = results.start("grad_norms", args.variant, seeds=[args.seed])
    torch.set_num_threads(1)
    cfg = load_config(None, [*convergence.CONFIG, *convergence.schedule(args.steps), f"train.seed={args.seed}"])
    tr = cfg.train
    data = TokenDataset(prepare_embedded_data(), verify=True)
    model = MoETransformer(cfg.model, cfg.moe, local_experts=list(range(cfg.moe.num_experts)))
    model.init_weights(args.seed)
    opt = build_optimizer(model, tr)
    loader = BatchLoader(data, cfg.model.max_seq_len, PEERS * args.batch, seed=args.seed, peer_index=0, num_peers=1)
    params = [p for _, p in trainable_parameters(model)]
    norms: list[tuple[float, float]] = []  # (whole batch, mean of its P parts)
    for step in range(tr.max_steps):
        model.train()
        set_lr(opt, lr_at(step, tr))
        x, y = loader.next_batch()
        parts = []
        for i in range(PEERS):
            part = slice(i * args.batch, (i + 1) * args.batch)
            parts.append(grad_norm(model, x[part], y[part], tr.z_loss_weight))
            opt.zero_grad(set_to_none=True)
        whole = grad_norm(model, x, y, tr.z_loss_weight)  # the step centralized training takes
        torch.nn.utils.clip_grad_norm_(params, tr.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        norms.append((whole, statistics.fmean(parts)))
    spans = [(0, args.steps // 8), (args.steps // 8, args.steps // 2), (args.steps // 2, args.steps)]
    rows = []
    for lo, hi in spans:
        seg = norms[lo:hi]
        rows.append(
            {
                "steps": [lo, hi],
                "whole_clipped": sum(a > tr.grad_clip for a, _ in seg),
                "part_clipped": sum(b > tr.grad_clip for _, b in seg),
                "count": len(seg),
                "whole_norm": statistics.fmean(a for a, _ in seg),
                "part_norm": statistics.fmean(b for _, b in seg),
                "ratio": statistics.fmean(b / a for a, b in seg),
            }
        )
    table = Table(title=f"gradient norms at the same weights, clip {tr.grad_clip}, seed {args.seed}")
    for col in (
        "steps",
        f"batch {PEERS * args.batch}: mean norm",
        "clipped",
        f"batch {args.batch}: mean norm",
        "clipped",
        "ratio",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['steps'][0]}-{r['steps'][1]}",
            f"{r['whole_norm']:.3f}",
            f"{r['whole_clipped']}/{r['count']}",
            f"{r['part_norm']:.3f}",
            f"{r['part_clipped']}/{r['count']}",
            f"{r['ratio']:.2f}x",
        )
    Console(width=140).print(table)
    out = writer.write(
        {
            "steps": args.steps,
            "batch": args.batch,
            "peers": PEERS,
            "seed": args.seed,
            "grad_clip": tr.grad_clip,
            "spans": rows,
            "norms": [[round(a, 5), round(b, 5)] for a, b in norms],
        }
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
