"""Where the swarm's gap to centralized comes from: P model replicas averaged every H steps, in one process.

    .venv/bin/python benchmarks/local_steps.py                 # every arm, seeds 0 1 2 (~3 min per arm and seed)
    .venv/bin/python benchmarks/local_steps.py --arms h50 h1 --seeds 0 --out /tmp/local
    .venv/bin/python benchmarks/local_steps.py --arms h1-moments --seeds 0 --add   # merged into the stored runs

No network, no DHT, no experts split: P full replicas of the quality benchmark's model
(``benchmarks/quality.py``: the convergence benchmark's narrow tiny config, 400 steps) train in turn on
the P disjoint data partitions of ``p2p_spes.data.BatchLoader`` with the project's own model, AdamW,
schedule and clipping, and their weights are replaced by the mean every H steps: what a swarm of full
replicas with plain averaging does, minus everything else. Centralized is the same code with one
replica of batch P x b, and reproduces ``p2p-spes train`` to the last digit. Arms:

* ``centralized``: one replica, batch 32;
* ``h50``, ``h10``, ``h1``: 4 replicas of batch 8 averaged every 50 / 10 / 1 steps (h1 is data
  parallel but for each replica's own AdamW state);
* ``h50-moments``, ``h10-moments``, ``h1-moments``: also averaging AdamW's first and second moments at
  each sync (h1-moments then differs from data parallel only in the second moment: the mean of the
  replicas' squared gradients instead of the squared mean gradient);
* ``h1-moments-lr``: h1-moments with the learning rate times sqrt(P), the rescaling that undoes that
  difference where gradient noise dominates the second moment;
* ``centralized-lr2``, ``h50-lr2``: centralized and h50 with the learning rate doubled (is the gap the
  swarm's, or does the schedule undertrain both?);
* ``h50-clip``, ``h1-moments-clip``: the replicas clip their gradient norm at sqrt(P) x ``grad_clip``
  (a batch P times smaller has a norm up to sqrt(P) larger where noise dominates: with the threshold
  unchanged, batches of 8 are clipped at every step past step 200 here, batches of 32 never);
* ``dp``: data parallel, the replicas' gradients averaged before every step (then clipped, one
  identical AdamW step on each): what differs from centralized is only that each replica's loss,
  load-balancing term included, is taken over its own batch of 8.

Scored by ``convergence.Validation`` (the same 1,024 validation windows as every quality arm). Prints a
table and writes ``benchmarks/results/local_steps.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import convergence

from p2p_spes.config import Config, load_config
from p2p_spes.corpus import prepare_embedded_data
from p2p_spes.data import BatchLoader, TokenDataset
from p2p_spes.model import MoETransformer
from p2p_spes.optim import build_optimizer, lr_at, set_lr, trainable_parameters

RESULTS = Path(__file__).parent / "results" / "local_steps.json"
PEERS = 4  # replicas of the averaged arms; centralized trains one replica of PEERS x the batch


@dataclass(frozen=True)
class Probe:
    replicas: int
    sync: int  # steps between averages
    moments: bool = False  # average AdamW's exp_avg and exp_avg_sq too
    lr_scale: float = 1.0
    clip_scale: float = 1.0  # gradient clipping threshold times this
    grads: bool = False  # average the gradients before every step: data parallel, one AdamW state in effect
    pooled: bool = False  # optim.PooledNoiseAdamW with peers = replicas


PROBES = {
    "centralized": Probe(1, 0), "h50": Probe(PEERS, 50), "h10": Probe(PEERS, 10), "h1": Probe(PEERS, 1),
    "h50-moments": Probe(PEERS, 50, True), "h10-moments": Probe(PEERS, 10, True), "h1-moments": Probe(PEERS, 1, True),
    "h1-moments-lr": Probe(PEERS, 1, True, math.sqrt(PEERS)),
    "centralized-lr2": Probe(1, 0, lr_scale=2.0), "h50-lr2": Probe(PEERS, 50, lr_scale=2.0),
    "h50-clip": Probe(PEERS, 50, clip_scale=math.sqrt(PEERS)), "h1-moments-clip": Probe(PEERS, 1, True, clip_scale=math.sqrt(PEERS)),
    "dp": Probe(PEERS, 1, grads=True),
    "h1-pooled": Probe(PEERS, 1, pooled=True), "h50-pooled": Probe(PEERS, 50, pooled=True),
}


def train(cfg: Config, probe: Probe, batch: int, seed: int, data: TokenDataset) -> MoETransformer:
    """``probe.replicas`` replicas from one initialisation, averaged every ``probe.sync`` steps."""
    experts = list(range(cfg.moe.num_experts))
    first = MoETransformer(cfg.model, cfg.moe, local_experts=experts)
    first.init_weights(seed)
    models = [first] + [MoETransformer(cfg.model, cfg.moe, local_experts=experts) for _ in range(probe.replicas - 1)]
    for m in models[1:]:
        m.load_state_dict(first.state_dict())
    optimizers = [build_optimizer(m, cfg.train, peers=probe.replicas if probe.pooled else 1) for m in models]
    loaders = [BatchLoader(data, cfg.model.max_seq_len, batch, seed=seed, peer_index=i, num_peers=probe.replicas)
               for i in range(probe.replicas)]
    tr = cfg.train
    for step in range(tr.max_steps):
        for model, loader in zip(models, loaders):
            model.train()
            x, y = loader.next_batch()
            model.loss(x, y, z_loss_weight=tr.z_loss_weight).loss.backward()
        if probe.grads:
            average_grads(models)
        for model, opt in zip(models, optimizers):
            set_lr(opt, lr_at(step, tr) * probe.lr_scale)
            params = [p for _, p in trainable_parameters(model)]
            torch.nn.utils.clip_grad_norm_(params, tr.grad_clip * probe.clip_scale)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if probe.replicas > 1 and (step + 1) % probe.sync == 0:
            average(models, optimizers, probe.moments)
    return models[0]


@torch.no_grad()
def average_grads(models: list[MoETransformer]) -> None:
    """Every replica's gradient becomes the replicas' mean (an expert no token reached has none)."""
    for column in zip(*[[p for _, p in trainable_parameters(m)] for m in models]):
        if all(p.grad is None for p in column):
            continue
        mean = torch.stack([torch.zeros_like(p) if p.grad is None else p.grad for p in column]).mean(0)
        for p in column:
            p.grad = mean.clone()


@torch.no_grad()
def average(models: list[MoETransformer], optimizers: list[torch.optim.Optimizer], moments: bool) -> None:
    params = [[p for _, p in trainable_parameters(m)] for m in models]
    for column in zip(*params):
        mean = torch.stack(column).mean(0)
        for p in column:
            p.copy_(mean)
        if moments:
            states = [opt.state[p] for opt, p in zip(optimizers, column)]
            for key in ("exp_avg", "exp_avg_sq"):
                mean = torch.stack([s[key] for s in states]).mean(0)
                for s in states:
                    s[key].copy_(mean)


def previous_finals(args: argparse.Namespace) -> tuple[dict[str, dict[int, float]], list[str]]:
    """The stored final losses by arm and seed (for ``--add``) and the commands that produced them;
    refused when they were measured with other steps or batch."""
    previous = json.loads(args.out.read_text())
    if (previous["steps"], previous["batch"]) != (args.steps, args.batch):
        raise SystemExit(f"{args.out} holds {previous['steps']} steps of batch {previous['batch']}: "
                         "run without --add, or with --out elsewhere")
    finals = {arm: {int(s): v for s, v in row["finals"].items()} for arm, row in previous["arms"].items()}
    return finals, previous.get("commands", [previous["command"]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="*", default=list(PROBES), choices=list(PROBES),
                        help="none with --add: only the table of the stored runs")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=8, help="per-replica batch (centralized: replicas x this)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--add", action="store_true", help="merge into the stored runs of the same steps and batch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    common = [*convergence.CONFIG, *convergence.schedule(args.steps)]
    data = TokenDataset(prepare_embedded_data()["train"], verify=True)
    validation = convergence.Validation(load_config(None, common).model.max_seq_len, 1024)
    console = Console(width=160)
    finals, commands = previous_finals(args) if args.add and args.out.exists() else ({}, [])
    for arm in args.arms:
        finals.setdefault(arm, {})
    t0 = time.monotonic()
    for seed in args.seeds:
        for arm in args.arms:
            probe = PROBES[arm]
            batch = args.batch * PEERS if probe.replicas == 1 else args.batch
            model = train(load_config(None, [*common, f"train.seed={seed}"]), probe, batch, seed, data)
            finals[arm][seed] = validation.loss(model)
            console.print(f"{arm} seed {seed}: {finals[arm][seed]:.4f} ({(time.monotonic() - t0) / 60:.1f} min so far)")
    base = finals.get("centralized", {})
    seeds = sorted({s for by_seed in finals.values() for s in by_seed})
    table = Table(title=f"full replicas averaged in one process, {args.steps} steps, seeds {seeds}")
    for col in ("arm", "replicas x batch", "sync every", "moments averaged", "lr x", "clip x", "final loss (mean)", "vs centralized (per seed)"):
        table.add_column(col, justify="left" if col == "arm" else "right")
    rows = {}
    for arm, by_seed in finals.items():
        probe = PROBES[arm]
        gaps = [v / base[s] - 1 for s, v in by_seed.items() if s in base]
        rows[arm] = {**vars(probe), "finals": by_seed, "mean": statistics.fmean(by_seed.values()),
                     "gap": convergence.spread(gaps) if gaps else None}
        gap = rows[arm]["gap"]
        table.add_row(arm, f"{probe.replicas} x {args.batch * PEERS if probe.replicas == 1 else args.batch}",
                      "-" if probe.replicas == 1 else str(probe.sync), "yes" if probe.moments else "no", f"{probe.lr_scale:g}", f"{probe.clip_scale:g}",
                      f"{rows[arm]['mean']:.4f}",
                      "-" if arm == "centralized" or gap is None else f"{gap['mean']:+.2%} ({gap['min']:+.2%} .. {gap['max']:+.2%})")
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/local_steps.py " + " ".join(sys.argv[1:])
    args.out.write_text(json.dumps({"command": command, "commands": [*commands, command],
                                    "steps": args.steps, "batch": args.batch, "seeds": seeds,
                                    "validation": validation.describe, "wall_seconds": round(time.monotonic() - t0, 1),
                                    "arms": rows}, indent=1))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
