"""Where the swarm's gap to centralized comes from: P model replicas averaged every H steps, in one process.

    python -m benchmarks.local_steps                 # every arm, seeds 0 1 2 (~3 min per arm and seed)
    python -m benchmarks.local_steps --arms h50 h1 --seeds 0 --variant quick
    python -m benchmarks.local_steps --arms h1-moments --seeds 0 --add   # merged into the stored runs

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
  load-balancing term included, is taken over its own batch of 8;
* ``h1-pooled``, ``h50-pooled``: each replica's AdamW divides the noise part of its second moment
  (``v - m^2``) by P (``PooledNoiseAdamW``): the step scale the P batches' mean gradient would get.
  A probe of a method change; at seed 0 it moved h1 from +8.1% to +7.2% and made h50 worse (+13.3%
  against +11.6%), so the trainer does not use it;
* ``h50-nesterov``: h50 with the swarm's Nesterov outer step (``swarm/outer.py``, DiLoCo's lr 0.7 and
  momentum 0.9) on the averaged pseudo-gradient instead of taking the mean;
* ``h1-moments-pooled``: h1-moments with ``PooledNoiseAdamW``: if the second moment is all that separates
  h1-moments from ``dp``, this closes it;
* ``h50-lr05``, ``h1-lr05``, ``centralized-lr05``: the learning rate halved (a batch of 8 may want a
  smaller one than the batch of 32 the schedule was set for);
* ``h50-beta2``: h50 with AdamW's beta2 0.99 instead of 0.95 (a longer memory of a noisier square);
* ``h50-dp100``, ``h50-dp30``: data parallel for the first 100 / 30 steps, then h50 (how much of the
  gap the early steps make: "post-local SGD");
* ``h50-ramp``: averaged after steps 1, 2, 4, 8, 16 and 32 (intervals doubling from one step), then
  every 50: six more averages than h50, all at the start;
* ``h50-outer08``, ``h50-outer06``: the new value is the anchor minus 0.8 / 0.6 times the averaged
  pseudo-gradient (outer SGD with a step below the plain average's 1; the quality benchmark's
  ``outer-sgd-2`` took 2 and lost 13 points);
* ``h1-rows``, ``h50-rows``: the input embedding's rows are averaged weighted by how often each
  replica saw that token since the last average (a row only one replica saw keeps that replica's
  change, where the plain mean divides it by P); every other parameter as h1 / h50.
* ``h50-topk``: h50 with the swarm's ``topk`` codec and error feedback (``CompressedAverage``): each
  replica's pseudo-gradient, then the mean encoded again by the reducer; ``h50-topk-1stage``: the mean
  of the replicas' messages applied as it is (an all-gather: P messages to download, not one);
  ``-ef95``: each replica's residual scaled by 0.95 before it is added (SparseLoCo's decayed error
  feedback, which its authors report stands in for the outer momentum); ``h10-topk...``: the same
  averaged every 10 steps (40 rounds instead of 8); ``h10-topk-dense``: the reducer's encoding at
  ``swarm.topk_result_fraction`` 4/64 (16 values per block, where each member sends 4).
* ``h10-randk``, ``h10-randk64`` (``RandomK``): every replica sends its pseudo-gradient (with its residual)
  at the same k positions of each block of 256, drawn afresh each round from a seed every replica
  knows (so no positions travel), 2-bit values on topk's levels with one fp16 scale per block; the mean
  is then k-sparse on those positions whatever the number of replicas, and the reducer re-encodes it at
  the same positions with its own residual (no second-stage loss of support). k = 20 costs what a topk
  member's message costs (2 + 20/4 bytes per block against topk's 2 + 4 + 1); k = 64 about a topk-dense
  averaged part (18 bytes against 22).
* ``centralized-muon``, ``h50-muon``, ``h1-muon``, ``dp-muon``: centralized, h50, h1 and dp with
  ``train.optimizer=muon`` (``optim.MuonAdamW``: Muon on the hidden matrices, AdamW on embeddings, head,
  router and norms). MuLoCo (arXiv 2505.23725) reports that Muon's normalized steps make
  pseudo-gradients that average better across workers than AdamW's. ``h10-muon``: every 10 steps;
  ``h50-muon-nesterov``: with the swarm's Nesterov outer step (the pair the swarm
  test found unstable once); ``h50-muon-outer15``: the anchor minus 1.5x the averaged pseudo-gradient
  (Muon's steps have a fixed size, so the mean of P noisy ones is shorter than one clean one);
  ``-m98``: Muon's momentum 0.98 instead of 0.95 (a longer momentum averages more of a
  small batch's noise before the step is normalized); ``-lr2``: the learning rate x2
  (a replica's normalized step on a batch of B/P carries about 1/sqrt(P) of the signal of one on B).
* ``centralized-muon-adam2``, ``h50-muon-adam2`` (and ``4``, ``8``): the learning rate x2 (x4, x8) with
  Muon's update size divided by as much, so the parameters AdamW steps (embeddings, head, router, norms)
  and Muon's decoupled weight decay take x2 (x4, x8) while Muon's step stays the same. (The trainer's
  ``train.muon_adamw_lr_scale`` leaves Muon's weight decay alone; quality.py's ``-4x`` arms measure it.)
  ``h50-muon-outer2``: as ``h50-muon-outer15`` with 2x; ``h50-muon-adam4-outer15``: ``-adam4`` and ``-outer15``.
  ``centralized-muon-4x``, ``h50-muon-4x``: the shipped ``train.muon_adamw_lr_scale: 4`` itself.
  ``h1-muon-moments``: weights and every optimizer state (Muon's momentum, AdamW's moments) averaged
  after every step, so the replicas differ only in the step each takes on its own batch: what is left
  of ``h1-muon``'s gap to ``dp-muon`` is the normalization of that step alone.
* ``-b2``, ``-b4`` (``h25-b2``, ``h25-muon-4x-b2``, ``h12-muon-4x-b4``, ``centralized-b2``,
  ``centralized-muon-4x-b2``): batches 2x / 4x larger for half / a quarter of the steps, so the same
  tokens, with the sync interval in those steps (the same tokens per round as h50, up to rounding for
  b4). Each replica's normalized step then sees less of a small batch's noise, at the cost of fewer
  steps; the DiLoCo scaling-law study (arXiv 2503.09799) finds a larger best global batch for DiLoCo than
  for data parallel. The swarm arms are compared with the centralized run of the default batch.
  ``-b05`` (``h100-muon-4x-b05``, ``centralized-muon-4x-b05``): half the batch for twice the steps.
* ``h50-frozen``: AdamW whose denominator (the root of the second moment) is the replicas' mean second
  moment at the last average, frozen until the next (``freeze_denominators``); each replica keeps its
  own first moment. A replica's step is then linear in its gradients within a round, as SGD's is;
  ``-pooled``: the noise part of that second moment divided by the replicas; ``centralized-frozen``: one
  replica of batch 32 with its own denominator frozen the same way (what the freezing alone costs).
  ``-hidden``: only the hidden matrices' denominators frozen (embedding rows a batch did not touch keep
  a second moment near zero, which a frozen denominator turns into a huge step when the token comes
  back). ``-floor``: each replica divides by no less than its own second moment, ``-floor4`` /
  ``-floor16`` no less than 1/4 / 1/16 of it (a step at most 2x / 4x its own AdamW's, linear wherever
  the frozen denominator is the larger, which it is but where a gradient grew within the round);
  ``h1-``, ``h10-``, ``h50-frozen-floor4``: that step averaged every 1 / 10 / 50 steps;
  ``-floor16-pooled``: the frozen denominator's noise part divided by the replicas; ``-noclip`` (and
  ``h50-noclip``): no gradient clipping in the replicas (batches of 8 are clipped at every step past
  step 200, batches of 32 never; AdamW's own step mostly undoes that scale, a frozen denominator only
  as far as the clipping was the same when it froze).
* ``centralized-sgd``, ``h50-sgd``, ``h1-sgd``: a diagnostic, not a candidate: SGD with Nesterov momentum
  at 100x the learning rate. Its step is linear in the gradients, so averaging replicas loses nothing to
  a per-replica normalization; if the gap to its own centralized run is small, the normalization of
  each replica's noisy step (AdamW's, Muon's) is what the averaged swarms lose. ``-lr3``: at 300x.

``--steps`` other than 400 writes its own variant (``benchmarks/results/local_steps/<steps>.json``), so that a
longer budget never mixes with the stored 400-step runs; ``--set K=V`` (a wider model, say) needs a
``--variant`` of its own. ``--add`` merges only a file this script wrote with its provenance
(``benchmarks/lab/results.py``), never one from elsewhere.

The table's ``spread`` (arms averaged without a codec, runs since it was added): at each average, the
RMS distance of the replicas from their mean (all trainable parameters), and in brackets that over the
distance their mean moved since the last average, each averaged over the run's averages (``replica_spread()``):
how far the replicas went apart in a round, and that for the progress they made together.

Scored by ``convergence.Validation`` (the same 1,024 validation windows as every quality arm). Prints a
table and writes ``benchmarks/results/local_steps/<variant>.json`` (default ``main``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from benchmarks import convergence
from benchmarks.lab import feedback, results
from benchmarks.lab.spread import spread
from p2p_spes.averaging.compression import BLOCK, Codec
from p2p_spes.config import Config, SwarmConfig, load_config
from p2p_spes.corpus import prepare_embedded_data
from p2p_spes.data import BatchLoader, TokenDataset
from p2p_spes.model import MoETransformer
from p2p_spes.optim import build_optimizer, is_hidden_matrix, lr_at, parameter_groups, set_lr, trainable_parameters
from p2p_spes.swarm.outer import OuterOptimizer, flatten

PEERS = 4  # replicas of the averaged arms; centralized trains one replica of PEERS x the batch


@dataclass(frozen=True)
class Probe:
    replicas: int
    sync: int  # steps between averages
    moments: bool = False  # average AdamW's exp_avg and exp_avg_sq too
    lr_scale: float = 1.0
    clip_scale: float = 1.0  # gradient clipping threshold times this
    grads: bool = False  # average the gradients before every step: data parallel, one AdamW state in effect
    pooled: bool = False  # PooledNoiseAdamW (below) with peers = replicas
    nesterov: bool = False  # the swarm's Nesterov outer step (lr 0.7, momentum 0.9) instead of the plain mean
    beta2: float | None = None  # AdamW's beta2 instead of the config's
    dp_steps: int = 0  # data parallel (gradients averaged) for this many first steps, then every `sync`
    ramp: bool = False  # average after steps 1, 2, 4, ... (doubling) while below `sync`, then every `sync`
    outer_lr: float | None = None  # the new value is the anchor minus this times the averaged pseudo-gradient
    rows: bool = False  # input embedding rows: each replica's change weighted by how often it saw the token
    codec: str | None = None  # pseudo-gradients through this codec (compression.py), with error feedback
    restage: bool = True  # with `codec`: the average is encoded again, as the swarm's reducers do
    feedback_decay: float | None = None  # with `codec`: each replica's residual is scaled by this (None: the codec's)
    result_fraction: float | None = None  # with `codec` and `restage`: swarm.topk_result_fraction
    random_k: int = 0  # with codec "randk": positions per block of 256, shared by the replicas each round
    muon: bool = False  # Muon on the hidden matrices, AdamW on the rest (optim.MuonAdamW)
    muon_momentum: float | None = None  # with `muon`: Muon's momentum instead of 0.95
    muon_rms: float | None = None  # with `muon`: the RMS of Muon's step per unit lr instead of 0.2
    muon_adamw_scale: float = 1.0  # with `muon`: train.muon_adamw_lr_scale (the shipped knob)
    sgd: bool = False  # SGD with Nesterov momentum 0.9, no weight decay, at lr_scale x the config's lr
    frozen: bool = False  # AdamW dividing by a second moment shared by the replicas and frozen between averages
    frozen_hidden: bool = False  # with `frozen`: only the hidden matrices' (optim.is_hidden_matrix) second moments
    frozen_floor: float = 0.0  # with `frozen`: divide by no less than this times the replica's own second moment
    batch_mult: float = (
        1.0  # batches this many times larger for as many times fewer steps (same tokens; `sync` in its steps)
    )


PROBES = {
    "centralized": Probe(1, 0),
    "h50": Probe(PEERS, 50),
    "h10": Probe(PEERS, 10),
    "h1": Probe(PEERS, 1),
    "h50-moments": Probe(PEERS, 50, True),
    "h10-moments": Probe(PEERS, 10, True),
    "h1-moments": Probe(PEERS, 1, True),
    "h1-moments-lr": Probe(PEERS, 1, True, math.sqrt(PEERS)),
    "centralized-lr2": Probe(1, 0, lr_scale=2.0),
    "h50-lr2": Probe(PEERS, 50, lr_scale=2.0),
    "h50-clip": Probe(PEERS, 50, clip_scale=math.sqrt(PEERS)),
    "h1-moments-clip": Probe(PEERS, 1, True, clip_scale=math.sqrt(PEERS)),
    "dp": Probe(PEERS, 1, grads=True),
    "h1-pooled": Probe(PEERS, 1, pooled=True),
    "h50-pooled": Probe(PEERS, 50, pooled=True),
    "h50-nesterov": Probe(PEERS, 50, nesterov=True),
    "h1-moments-pooled": Probe(PEERS, 1, True, pooled=True),
    "h50-lr05": Probe(PEERS, 50, lr_scale=0.5),
    "h1-lr05": Probe(PEERS, 1, lr_scale=0.5),
    "centralized-lr05": Probe(1, 0, lr_scale=0.5),
    "h50-beta2": Probe(PEERS, 50, beta2=0.99),
    "h50-dp100": Probe(PEERS, 50, dp_steps=100),
    "h50-dp30": Probe(PEERS, 50, dp_steps=30),
    "h50-ramp": Probe(PEERS, 50, ramp=True),
    "h50-outer08": Probe(PEERS, 50, outer_lr=0.8),
    "h50-outer06": Probe(PEERS, 50, outer_lr=0.6),
    "h1-rows": Probe(PEERS, 1, rows=True),
    "h50-rows": Probe(PEERS, 50, rows=True),
    "h50-topk": Probe(PEERS, 50, codec="topk"),
    "h50-topk-1stage": Probe(PEERS, 50, codec="topk", restage=False),
    "h50-topk-ef95": Probe(PEERS, 50, codec="topk", feedback_decay=0.95),
    "h50-topk-1stage-ef95": Probe(PEERS, 50, codec="topk", restage=False, feedback_decay=0.95),
    "h10-topk": Probe(PEERS, 10, codec="topk"),
    "h10-topk-1stage-ef95": Probe(PEERS, 10, codec="topk", restage=False, feedback_decay=0.95),
    "h10-topk-ef95": Probe(PEERS, 10, codec="topk", feedback_decay=0.95),
    "h10-topk-1stage": Probe(PEERS, 10, codec="topk", restage=False),
    "h10-topk-dense": Probe(PEERS, 10, codec="topk", result_fraction=4 / 64),
    "h10-randk": Probe(PEERS, 10, codec="randk", random_k=20),
    "h10-randk64": Probe(PEERS, 10, codec="randk", random_k=64),
    "centralized-muon": Probe(1, 0, muon=True),
    "h50-muon": Probe(PEERS, 50, muon=True),
    "h1-muon": Probe(PEERS, 1, muon=True),
    "dp-muon": Probe(PEERS, 1, grads=True, muon=True),
    "h10-muon": Probe(PEERS, 10, muon=True),
    "h50-muon-moments": Probe(PEERS, 50, True, muon=True),
    "h1-muon-moments": Probe(PEERS, 1, True, muon=True),
    "h25-b2": Probe(PEERS, 25, batch_mult=2),
    "centralized-b2": Probe(1, 0, batch_mult=2),
    "h25-muon-4x-b2": Probe(PEERS, 25, muon=True, muon_adamw_scale=4.0, batch_mult=2),
    "h12-muon-4x-b4": Probe(PEERS, 12, muon=True, muon_adamw_scale=4.0, batch_mult=4),
    "centralized-muon-4x-b2": Probe(1, 0, muon=True, muon_adamw_scale=4.0, batch_mult=2),
    "h100-muon-4x-b05": Probe(PEERS, 100, muon=True, muon_adamw_scale=4.0, batch_mult=0.5),
    "centralized-muon-4x-b05": Probe(1, 0, muon=True, muon_adamw_scale=4.0, batch_mult=0.5),
    "h50-muon-nesterov": Probe(PEERS, 50, nesterov=True, muon=True),
    "h50-muon-outer15": Probe(PEERS, 50, outer_lr=1.5, muon=True),
    "centralized-muon-m98": Probe(1, 0, muon=True, muon_momentum=0.98),
    "h50-muon-m98": Probe(PEERS, 50, muon=True, muon_momentum=0.98),
    "centralized-muon-lr2": Probe(1, 0, lr_scale=2.0, muon=True),
    "h1-muon-lr2": Probe(PEERS, 1, lr_scale=2.0, muon=True),
    "h50-muon-lr2": Probe(PEERS, 50, lr_scale=2.0, muon=True),
    **{
        f"{name}-muon-adam{k}": Probe(n, sync, lr_scale=k, muon=True, muon_rms=0.2 / k)
        for name, n, sync in (("centralized", 1, 0), ("h50", PEERS, 50))
        for k in (2, 4, 8)
    },
    "h50-muon-outer2": Probe(PEERS, 50, outer_lr=2.0, muon=True),
    "centralized-muon-4x": Probe(1, 0, muon=True, muon_adamw_scale=4.0),
    "h50-muon-4x": Probe(PEERS, 50, muon=True, muon_adamw_scale=4.0),
    "h50-muon-adam4-outer15": Probe(PEERS, 50, lr_scale=4, muon=True, muon_rms=0.05, outer_lr=1.5),
    "centralized-frozen": Probe(1, 50, frozen=True),
    "h50-frozen": Probe(PEERS, 50, frozen=True),
    "h50-frozen-pooled": Probe(PEERS, 50, frozen=True, pooled=True),
    "centralized-frozen-hidden": Probe(1, 50, frozen=True, frozen_hidden=True),
    "h50-frozen-hidden": Probe(PEERS, 50, frozen=True, frozen_hidden=True),
    "centralized-frozen-floor": Probe(1, 50, frozen=True, frozen_floor=1.0),
    "h50-frozen-floor": Probe(PEERS, 50, frozen=True, frozen_floor=1.0),
    "centralized-frozen-floor4": Probe(1, 50, frozen=True, frozen_floor=0.25),
    "h50-frozen-floor4": Probe(PEERS, 50, frozen=True, frozen_floor=0.25),
    "h1-frozen-floor4": Probe(PEERS, 1, frozen=True, frozen_floor=0.25),
    "h10-frozen-floor4": Probe(PEERS, 10, frozen=True, frozen_floor=0.25),
    "h50-frozen-floor4-noclip": Probe(PEERS, 50, frozen=True, frozen_floor=0.25, clip_scale=1e6),
    "h10-frozen-floor4-noclip": Probe(PEERS, 10, frozen=True, frozen_floor=0.25, clip_scale=1e6),
    "h1-frozen-floor4-noclip": Probe(PEERS, 1, frozen=True, frozen_floor=0.25, clip_scale=1e6),
    "h50-noclip": Probe(PEERS, 50, clip_scale=1e6),
    "centralized-frozen-floor16": Probe(1, 50, frozen=True, frozen_floor=1 / 16),
    "h10-frozen-floor16-pooled": Probe(PEERS, 10, frozen=True, frozen_floor=1 / 16, pooled=True),
    "h50-frozen-floor16-pooled": Probe(PEERS, 50, frozen=True, frozen_floor=1 / 16, pooled=True),
    "centralized-sgd": Probe(1, 0, lr_scale=100, sgd=True),
    "h50-sgd": Probe(PEERS, 50, lr_scale=100, sgd=True),
    "h1-sgd": Probe(PEERS, 1, lr_scale=100, sgd=True),
    "centralized-sgd-lr3": Probe(1, 0, lr_scale=300, sgd=True),
    "h50-sgd-lr3": Probe(PEERS, 50, lr_scale=300, sgd=True),
}
NESTEROV = SwarmConfig(outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)  # DiLoCo's, and quality.py's


class PooledNoiseAdamW(torch.optim.Optimizer):
    """AdamW whose step is scaled by the second moment of a gradient averaged over ``peers`` batches.

    A peer's AdamW divides by the root of its own ``E[g^2]``: signal squared plus its batch's noise
    variance. When P peers' steps are averaged, the noise in their first moments averages out but each
    step was already shrunk by its own noise, so coordinates where noise dominates move up to sqrt(P)
    times less than under one AdamW on the P batches' mean gradient. Here the noise part of the second
    moment, estimated as ``v - m^2`` (bias-corrected), is divided by ``peers``; with ``peers`` = 1 it is
    AdamW exactly. The state keeps AdamW's names (``exp_avg``, ``exp_avg_sq``, ``step``), so moment
    averaging reads it the same way; a ``frozen_v`` entry (``freeze_denominators``) replaces the second
    moment. A probe, not the trainer's: neither helped (the module docstring).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        peers: float = 1.0,
        floor: float = 0.0,
    ) -> None:
        if peers < 1:
            raise ValueError(f"peers must be at least 1, got {peers}")
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "peers": peers, "floor": floor}
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, peers = group["lr"], group["eps"], float(group["peers"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                p.mul_(1 - lr * group["weight_decay"])
                m_hat = m / (1 - beta1**t)
                v_hat = v / (1 - beta2**t)
                if "frozen_v" in state and group["floor"]:  # at most 1/sqrt(floor) x the replica's own AdamW step
                    v_hat = torch.maximum(state["frozen_v"], v_hat.mul_(group["floor"]))
                elif "frozen_v" in state:  # set by freeze_denominators at the last average
                    v_hat = state["frozen_v"].clone()
                elif peers > 1:
                    signal = m_hat.square()
                    v_hat = signal.add_((v_hat - signal).clamp_(min=0).div_(peers))
                p.addcdiv_(m_hat, v_hat.sqrt_().add_(eps), value=-lr)
        return loss


def make_optimizer(model: MoETransformer, cfg: Config, probe: Probe) -> torch.optim.Optimizer:
    """The project's AdamW, Muon with AdamW (``-muon``), SGD (``-sgd``), or ``PooledNoiseAdamW`` for the
    ``-pooled`` probes and (with one peer, so plain AdamW until a denominator is frozen) ``-frozen``."""
    tr = cfg.train
    if probe.sgd:
        return torch.optim.SGD([p for _, p in trainable_parameters(model)], lr=tr.lr, momentum=0.9, nesterov=True)
    if probe.muon:
        return build_optimizer(
            model, dataclasses.replace(tr, optimizer="muon", muon_adamw_lr_scale=probe.muon_adamw_scale)
        )
    if not (probe.pooled or probe.frozen):
        return build_optimizer(model, tr)
    return PooledNoiseAdamW(
        parameter_groups(model, tr),
        lr=tr.lr,
        betas=tuple(tr.betas),
        eps=tr.eps,
        peers=1 if probe.frozen else probe.replicas,
        floor=probe.frozen_floor,
    )


def train(
    cfg: Config,
    probe: Probe,
    batch: int,
    seed: int,
    data: TokenDataset,
    spreads: list[tuple[float, float]] | None = None,
    after_step: Callable[[int, MoETransformer], None] | None = None,
) -> MoETransformer:
    """``probe.replicas`` replicas from one initialisation, averaged every ``probe.sync`` steps; each
    uncompressed average appends the replicas' :func:`replica_spread` before it to ``spreads``.
    ``after_step(steps done, first replica)`` is called after every step and its average, if any."""
    experts = list(range(cfg.moe.num_experts))
    first = MoETransformer(cfg.model, cfg.moe, local_experts=experts)
    first.init_weights(seed)
    models = [first] + [MoETransformer(cfg.model, cfg.moe, local_experts=experts) for _ in range(probe.replicas - 1)]
    for m in models[1:]:
        m.load_state_dict(first.state_dict())
    optimizers = [make_optimizer(m, cfg, probe) for m in models]
    for opt in optimizers:
        for group in opt.param_groups:
            if probe.beta2 is not None:
                group["betas"] = (group["betas"][0], probe.beta2)
            if probe.muon_momentum is not None:
                group["momentum"] = probe.muon_momentum
            if probe.muon_rms is not None:
                group["update_rms"] = probe.muon_rms
    loaders = [
        BatchLoader(data, cfg.model.max_seq_len, batch, seed=seed, peer_index=i, num_peers=probe.replicas)
        for i in range(probe.replicas)
    ]
    tr = cfg.train
    outer = OuterOptimizer(NESTEROV) if probe.nesterov else None
    if probe.outer_lr is not None:  # outer SGD: Nesterov's step with no momentum
        outer = OuterOptimizer(SwarmConfig(outer_optimizer="nesterov", outer_lr=probe.outer_lr, outer_momentum=0.0))
    anchors = [p.detach().clone() for _, p in trainable_parameters(first)]
    momenta: list[torch.Tensor | None] = [None] * len(anchors)
    seen = torch.zeros(probe.replicas, cfg.model.vocab_size)  # tokens each replica read since the last average
    embedding = first.embed_tokens.weight.detach().clone()  # its value at the last average
    compressed = None
    if probe.codec:
        compressed = RandomK(probe, first) if probe.codec == "randk" else CompressedAverage(probe, first)
    last = flatten(p for _, p in trainable_parameters(first))  # the replicas' common value at the last average
    for step in range(tr.max_steps):
        for i, (model, loader) in enumerate(zip(models, loaders)):
            model.train()
            x, y = loader.next_batch()
            if probe.rows:
                seen[i] += torch.bincount(x.reshape(-1), minlength=cfg.model.vocab_size)
            model.loss(x, y, z_loss_weight=tr.z_loss_weight).loss.backward()
        if probe.grads or step < probe.dp_steps:
            average_grads(models)
        for model, opt in zip(models, optimizers):
            set_lr(opt, lr_at(step, tr) * probe.lr_scale)
            params = [p for _, p in trainable_parameters(model)]
            torch.nn.utils.clip_grad_norm_(params, tr.grad_clip * probe.clip_scale)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if probe.frozen and (step + 1) % probe.sync == 0:
            freeze_denominators(models, optimizers, pooled=probe.pooled, hidden_only=probe.frozen_hidden)
        syncs = probe.replicas > 1 and averages_after(step + 1, probe)
        if syncs and compressed is not None:
            compressed.average(models)
        elif syncs:
            if spreads is not None:
                spreads.append(replica_spread(models, last))
            rows = [m.embed_tokens.weight.detach().clone() for m in models] if probe.rows else None
            average(models, optimizers, probe.moments)
            if rows is not None:
                average_rows(models, rows, embedding, seen)
                embedding = first.embed_tokens.weight.detach().clone()
                seen.zero_()
            if outer is not None:  # from the anchor, the averaged pseudo-gradient through the outer step
                with torch.no_grad():
                    for i, column in enumerate(zip(*[[p for _, p in trainable_parameters(m)] for m in models])):
                        anchors[i], momenta[i] = outer.outer_step(anchors[i], anchors[i] - column[0], momenta[i])
                        for p in column:
                            p.copy_(anchors[i])
            last = flatten(p for _, p in trainable_parameters(first))
        if after_step is not None:
            after_step(step + 1, models[0])
    return models[0]


@torch.no_grad()
def replica_spread(models: list[MoETransformer], last: torch.Tensor) -> tuple[float, float]:
    """How far the replicas moved apart in a round: the RMS distance of each replica from the replicas'
    mean, and that over the distance the mean moved from ``last`` (their common value at the previous
    average). Both 0 when every replica took the same steps."""
    flat = torch.stack([flatten(p for _, p in trainable_parameters(m)) for m in models])
    mean = flat.mean(0)
    distance = float((flat - mean).square().sum(1).mean().sqrt())
    return distance, distance / float((mean - last).norm())


def replica_batch(batch: int, probe: Probe) -> int:
    """Sequences per step of each replica: ``batch`` (PEERS x ``batch`` for one replica, the
    centralized run), times ``probe.batch_mult``; ``main`` runs such a probe for steps / batch_mult."""
    return round((batch * PEERS if probe.replicas == 1 else batch) * probe.batch_mult)


def probe_config(common: list[str], steps: int, probe: Probe, seed: int) -> Config:
    """The config ``probe`` trains with at ``seed``: ``common`` (which ends with ``--set``), with the
    schedule of steps / ``batch_mult`` steps for a batch multiple (it then wins over ``--set``)."""
    schedule = [] if probe.batch_mult == 1 else convergence.schedule(round(steps / probe.batch_mult))
    return load_config(None, [*common, *schedule, f"train.seed={seed}"])


def averages_after(steps_done: int, probe: Probe) -> bool:
    """Whether the replicas average after ``steps_done`` steps: every ``probe.sync``, and with
    ``probe.ramp`` also after 1, 2, 4, ... steps while those are below ``probe.sync``."""
    if probe.ramp and steps_done < probe.sync and steps_done & (steps_done - 1) == 0:
        return True
    return steps_done % probe.sync == 0


class CompressedAverage:
    """The swarm's compressed averaging of full replicas: each replica sends its pseudo-gradient
    (anchor - weights) plus its error-feedback residual (scaled by ``feedback_decay``) through the
    codec and keeps what the message dropped; the mean of the decoded messages is encoded again with
    the reducer's own residual (``restage``, what the swarm's reducers do so that everyone downloads
    one message of the codec's size) or applied as it is (an all-gather of the messages, as
    SparseLoCo does); every replica then takes the anchor minus that mean. A codec that forwards
    (``sparse``) takes neither path but its reducers' own: the members' messages bundled as they came,
    each value the mean over the members that sent it. Blocks run over all parameters flattened in
    order, where the swarm encodes each group's vector in P slices."""

    def __init__(self, probe: Probe, first: MoETransformer) -> None:
        self.codec, self.probe = Codec(probe.codec, result_fraction=probe.result_fraction), probe
        self.decay = self.codec.feedback_decay if probe.feedback_decay is None else probe.feedback_decay
        self.anchor = flatten(p for _, p in trainable_parameters(first))
        self.residuals = [torch.zeros_like(self.anchor) for _ in range(probe.replicas)]
        self.reducer_residual = torch.zeros_like(self.anchor)

    @staticmethod
    def through(codec: Codec, x: torch.Tensor) -> torch.Tensor:
        return codec.decode(codec.encode(x), x.numel())

    @torch.no_grad()
    def average(self, models: list[MoETransformer]) -> None:
        messages, n = [], self.anchor.numel()

        def through(x: torch.Tensor) -> torch.Tensor:
            if not self.codec.forwards:
                return self.through(self.codec, x)
            messages.append(self.codec.encode(x))
            return self.codec.decode(messages[-1], n)

        deltas = [self.anchor - flatten(p for _, p in trainable_parameters(m)) for m in models]
        decoded = feedback.send(deltas, self.residuals, through, self.decay)
        if self.codec.forwards:
            mean = self.codec.result.decode(self.codec.result.bundle(messages, [1.0] * len(messages), n), n)
        else:
            mean = torch.stack(decoded).mean(0)
        if not self.codec.forwards and self.probe.restage:
            result = self.codec.result_for(len(models))
            mean, self.reducer_residual = feedback.restage(
                mean, self.reducer_residual, lambda x: self.through(result, x)
            )
        self.anchor = self.anchor - mean
        for model in models:
            feedback.write(self.anchor, [p for _, p in trainable_parameters(model)])


class RandomK(CompressedAverage):
    """:class:`CompressedAverage` with positions every replica draws alike (``h10-randk``): per round, the
    same ``probe.random_k`` positions of each block of :data:`BLOCK` from a generator seeded with the
    round's number, values on topk's 2-bit levels with one fp16 scale per block. No positions travel,
    and the mean of the messages (and its re-encoding by the reducer) stays on those positions."""

    LEVELS = torch.tensor([-1.0, -1.0 / 3.0, 1.0 / 3.0, 1.0])

    def __init__(self, probe: Probe, first: MoETransformer) -> None:
        super().__init__(dataclasses.replace(probe, codec="none"), first)
        self.probe, self.rounds = probe, 0
        self.positions = torch.empty(0, dtype=torch.long)

    def through(self, codec: Codec, x: torch.Tensor) -> torch.Tensor:  # the codec is this round's positions
        n = x.numel()
        rows = torch.zeros(self.positions.shape[0] * BLOCK)
        rows[:n] = x
        rows = rows.view(-1, BLOCK)
        vals = rows.gather(1, self.positions)
        scale = vals.abs().amax(dim=1).clamp(min=2.0**-14).half().float()
        q = torch.round((vals / scale[:, None]).clamp(-1, 1) * 1.5 + 1.5).long()
        out = torch.zeros_like(rows)
        out.scatter_(1, self.positions, self.LEVELS[q] * scale[:, None])
        return out.view(-1)[:n]

    def average(self, models: list[MoETransformer]) -> None:
        blocks = -(-self.anchor.numel() // BLOCK)
        draw = torch.Generator().manual_seed(self.rounds)
        self.positions = torch.rand(blocks, BLOCK, generator=draw).topk(self.probe.random_k, dim=1).indices
        self.rounds += 1
        super().average(models)


@torch.no_grad()
def freeze_denominators(
    models: list[MoETransformer], optimizers: list[torch.optim.Optimizer], pooled: bool, hidden_only: bool = False
) -> None:
    """Every replica's AdamW divides, until the next call, by the mean of the replicas' bias-corrected
    second moments (with ``pooled``: its noise part, ``v - m^2`` with m the replicas' mean first moment,
    divided by the number of replicas). Between calls each replica's step is then linear in its own
    gradients, so the average of the replicas' steps is the step of their mean gradient. With
    ``hidden_only`` the embeddings, head, router and norms keep AdamW's own denominator."""
    names = [n for n, _ in trainable_parameters(models[0])]
    for name, column in zip(names, zip(*[[p for _, p in trainable_parameters(m)] for m in models])):
        states = [opt.state[p] for opt, p in zip(optimizers, column)]
        if not states[0] or (hidden_only and not is_hidden_matrix(name, column[0])):
            continue
        (beta1, beta2), t = optimizers[0].param_groups[0]["betas"], float(states[0]["step"])
        v = torch.stack([s["exp_avg_sq"] for s in states]).mean(0) / (1 - beta2**t)
        if pooled:
            signal = (torch.stack([s["exp_avg"] for s in states]).mean(0) / (1 - beta1**t)).square()
            v = signal + (v - signal).clamp(min=0) / len(states)
        for s in states:
            s["frozen_v"] = v.clone()


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
def average_rows(
    models: list[MoETransformer], rows: list[torch.Tensor], anchor: torch.Tensor, seen: torch.Tensor
) -> None:
    """The input embedding from ``anchor`` plus each replica's change since then (``rows``), each row
    weighted by how often that replica read the token (``seen``); rows no replica read keep the mean."""
    changes = torch.stack([r - anchor for r in rows])  # replicas x vocab x d
    total = seen.sum(0)
    weighted = (changes * seen[:, :, None]).sum(0) / total.clamp(min=1)[:, None]
    value = torch.where((total > 0)[:, None], anchor + weighted, models[0].embed_tokens.weight)
    for m in models:
        m.embed_tokens.weight.copy_(value)


@torch.no_grad()
def average(models: list[MoETransformer], optimizers: list[torch.optim.Optimizer], moments: bool) -> None:
    params = [[p for _, p in trainable_parameters(m)] for m in models]
    for column in zip(*params):
        mean = torch.stack(column).mean(0)
        for p in column:
            p.copy_(mean)
        if moments:
            states = [opt.state[p] for opt, p in zip(optimizers, column)]
            for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):  # AdamW's moments, Muon's momentum
                if key not in states[0]:
                    continue
                mean = torch.stack([s[key] for s in states]).mean(0)
                for s in states:
                    s[key].copy_(mean)


def baseline(arm: str, finals: dict[str, dict[int, float]]) -> str:
    """The centralized run an arm is compared with: for the Muon, SGD and frozen-denominator families,
    the centralized arm of the same optimizer and settings (``h50-muon-adam4-outer15`` ->
    ``centralized-muon-adam4``, the longest such name that ran); for every other arm plain centralized.
    A batch multiple (``-b2``) is left out of the name: such an arm is held to the default batch's run."""
    parts = [part for part in arm.split("-") if not re.fullmatch(r"b\d+", part)]
    if not {"muon", "sgd", "frozen"} & set(parts):
        return "centralized"
    for end in range(len(parts), 1, -1):
        name = "-".join(["centralized", *parts[1:end]])
        if name == arm or name in finals:
            return name
    return "centralized"


def previous_finals(
    args: argparse.Namespace, base: Path | None = None
) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, list[float]]], list[results.Result]]:
    """The stored final losses and spreads ([mean distance, mean ratio]) by arm and seed of ``--variant``
    (for ``--add``; none stored yet: nothing) and the result they come from; refused when this script did
    not write it (``results.own``) or measured it with other steps, batch or overrides."""
    if not results.path("local_steps", args.variant, base=base).exists():
        return {}, {}, []
    try:
        earlier = results.own("local_steps", args.variant, base=base)
    except results.ResultError as exc:
        raise SystemExit(f"--add: {exc}") from None
    previous = earlier.payload
    if (previous["steps"], previous["batch"], previous.get("overrides", [])) != (args.steps, args.batch, args.extra):
        raise SystemExit(
            f"{earlier.path} holds {previous['steps']} steps of batch {previous['batch']} with overrides "
            f"{previous.get('overrides', [])}: run without --add, or with another --variant"
        )
    finals = {arm: {int(s): v for s, v in row["finals"].items()} for arm, row in previous["arms"].items()}
    spreads = {arm: {int(s): v for s, v in row.get("spread", {}).items()} for arm, row in previous["arms"].items()}
    return finals, spreads, [earlier]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--arms",
        nargs="*",
        default=list(PROBES),
        choices=list(PROBES),
        help="none with --add: only the table of the stored runs",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=8, help="per-replica batch (centralized: replicas x this)")
    results.add_variant(
        parser,
        default=None,
        help="writes benchmarks/results/local_steps/<variant>.json (default main at 400 steps, <steps> otherwise)",
    )
    parser.add_argument("--add", action="store_true", help="merge into the stored runs of the same steps and batch")
    parser.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="K=V",
        help="a config override on top of the quality benchmark's model (a wider model, say); needs --variant",
    )
    args = parser.parse_args()
    if args.extra and args.variant is None:
        parser.error("--set changes what is measured: give a --variant, so it never mixes with the stored runs")
    if args.variant is None:
        args.variant = results.MAIN if args.steps == 400 else str(args.steps)
    writer = results.start("local_steps", args.variant, seeds=args.seeds)
    torch.set_num_threads(1)
    common = [*convergence.CONFIG, *convergence.schedule(args.steps), *args.extra]
    data = TokenDataset(prepare_embedded_data(), verify=True)
    validation = convergence.Validation(load_config(None, common).model.max_seq_len, 1024)
    console = Console(width=160)
    finals, spreads, merged = previous_finals(args) if args.add else ({}, {}, [])
    for arm in args.arms:
        finals.setdefault(arm, {})
        spreads.setdefault(arm, {})
    t0 = time.monotonic()
    for seed in args.seeds:
        for arm in args.arms:
            probe = PROBES[arm]
            rounds: list[tuple[float, float]] = []
            model = train(
                probe_config(common, args.steps, probe, seed),
                probe,
                replica_batch(args.batch, probe),
                seed,
                data,
                rounds,
            )
            finals[arm][seed] = validation.loss(model)
            if rounds:  # the mean distance and the mean ratio over the run's averages
                spreads[arm][seed] = [statistics.fmean(r[0] for r in rounds), statistics.fmean(r[1] for r in rounds)]
            console.print(f"{arm} seed {seed}: {finals[arm][seed]:.4f} ({(time.monotonic() - t0) / 60:.1f} min so far)")
    seeds = sorted({s for by_seed in finals.values() for s in by_seed})
    table = Table(
        title=f"full replicas averaged in one process, {args.steps} steps, seeds {seeds}"
        + (f", {' '.join(args.extra)}" if args.extra else "")
    )
    for col in (
        "arm",
        "replicas x batch",
        "sync every",
        "moments averaged",
        "lr x",
        "clip x",
        "final loss (mean)",
        "against",
        "gap (per seed)",
        "spread (ratio)",
    ):
        table.add_column(col, justify="left" if col == "arm" else "right")
    rows = {}
    for arm, by_seed in finals.items():
        probe, against = PROBES[arm], baseline(arm, finals)
        base = finals.get(against, {})
        gaps = [v / base[s] - 1 for s, v in by_seed.items() if s in base]
        rows[arm] = {
            **vars(probe),
            "finals": by_seed,
            "mean": statistics.fmean(by_seed.values()),
            "against": against,
            "gap": spread(gaps) if gaps else None,
            "spread": spreads.get(arm, {}),
        }
        gap = rows[arm]["gap"]
        table.add_row(
            arm,
            f"{probe.replicas} x {replica_batch(args.batch, probe)}",
            "-" if probe.replicas == 1 else str(probe.sync),
            "yes" if probe.moments else "no",
            f"{probe.lr_scale:g}",
            f"{probe.clip_scale:g}",
            f"{rows[arm]['mean']:.4f}",
            against,
            "-" if arm == against or gap is None else f"{gap['mean']:+.2%} ({gap['min']:+.2%} .. {gap['max']:+.2%})",
            (
                f"{statistics.fmean(v[0] for v in spreads[arm].values()):.3f} "
                f"({statistics.fmean(v[1] for v in spreads[arm].values()):.2f})"
            )
            if spreads.get(arm)
            else "-",
        )
    console.print(table)
    out = writer.write(
        {
            "steps": args.steps,
            "batch": args.batch,
            "overrides": args.extra,
            "seeds": seeds,
            "validation": validation.describe,
            "wall_seconds": round(time.monotonic() - t0, 1),
            "arms": rows,
        },
        merged=merged,
    )
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
