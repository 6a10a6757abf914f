"""Validation loss at equal tokens: centralized training against 4-peer swarms, all scored on the same tokens.

    python -m benchmarks.convergence      # 7 arms x 3 seeds x 480 steps: ~76 min on 2 cores
    python -m benchmarks.convergence --arms centralized spes --seeds 0 --steps 120 --variant quick
                                          # a quick look: ~2.5 min

Arms (every one trains the same model config on the same embedded corpus with the same token budget,
P x b x seq_len tokens per step for ``--steps`` steps, with the same seeds):

* ``centralized``: one process, the full model, batch P x b;
* ``spes``: P peers, each training its SPES block of E/P experts, batch b; shared weights averaged over
  all peers and each expert among its holders every ``--sync-steps`` steps (``swarm.outer_optimizer=
  average``, ``swarm.compression=none``), warm-up merging every ``--merge-interval`` steps;
* ``diloco``: P full-replica peers (``swarm.experts_per_peer=E``, no merging) with DiLoCo's outer step
  (``swarm.outer_optimizer=nesterov``, outer lr 0.7, outer momentum 0.9, as in the DiLoCo paper);
* ``spes-fp16``, ``spes-int8``, ``spes-int4``, ``spes-topk``: ``spes`` with that ``swarm.compression``
  (topk: ``swarm.topk_fraction``, 1/64 by default, of each block of 256 values, with error feedback);
* ``spes-topk-keep`` (not run by default): ``spes-topk`` with ``swarm.keep_local_progress`` (members keep
  in their weights what their messages have not carried);
* ``spes-topk-dense``, ``spes-topk-keep-dense`` (not run by default): ``spes-topk`` and ``spes-topk-keep``
  with ``swarm.topk_result_fraction`` 4/64 (the groups' averaged parts keep 16 of each block's 256
  values, where the members' messages keep 4);
* ``spes-sparse`` (not run by default): ``spes`` with ``swarm.compression=sparse`` (top-k per chunk of
  4,096 at 2 bits, the members' messages forwarded by the reducers and each value averaged over the
  members that sent it, decaying error feedback);
* ``spes-every4``, ``spes-topk-dense-every4`` (not run by default): ``spes`` and ``spes-topk-dense`` with
  ``swarm.expert_sync_rounds=4`` (experts averaged, and frozen copies refreshed, every 4th round and
  the last; the shared weights every round);
* ``spes-topk-dense-lone5``: ``spes-topk-dense`` with ``swarm.topk_lone_fraction`` 5/256 (a lone holder's
  update, what its frozen copies download, at 5 of each block's 256 values);
* ``spes-topk-dense8-lone8`` (not run by default): ``spes-topk`` with ``swarm.topk_result_fraction`` and
  ``swarm.topk_lone_fraction`` both 8/256 (the groups' averaged parts and a lone holder's update at 8 of
  each block's 256 values: about the bytes of ``spes-topk-dense-lone5``, more of them to the copies);
* ``spes-topk-dense12-lone7`` (not run by default): the same at 12/256 and 7/256;
* ``spes-no-merge`` (not run by default): ``spes`` without the warm-up merge.

The partial-residency arm of earlier versions is gone: its peers' checkpoints hold only their own
experts, so scoring it needs the model assembled from every peer; ``benchmarks/residency.py`` covers it.

Data. ``train.seed`` (initialisation) and ``data.seed`` (the order of the training windows) are both set
to the seed. A swarm peer with data partition p reads positions p, p + P, ... of the seed's permutation
of the training windows, b per step; the centralized run reads positions 32k .. 32k + 31 at step k
(P = 4, b = 8), so at every step the union of what the peers read is exactly what centralized reads
(as long as no peer skips a step: the table counts the tokens every arm really trained).

Model: the embedded tiny config narrowed to d_model 64, 2 layers, 4 heads, 8 experts (ffn 128, top-2),
seq_len 64; P = 4 peers, b = 8, 480 steps (0.98M tokens), sync every 30 steps, merge every 60, warm-up
5% of the steps, cosine to 10% of the peak lr at the last step.

Lockstep. The swarm peers are started through this module (``--peer-launcher``), which holds each peer
before the hook that runs a sync round until all P peers have reached that boundary step; nothing else
changes. Without it (``--free-pacing``) the first peer at a boundary opens the round and the others
join at the end of the step they are in, skipping the rest: on 2 shared cores the first round alone
loses the start-up skew (10+ steps of 3 peers), so the arms would not see equal tokens. The table
counts the tokens each arm really trained, the steps peers jumped or skipped, and the round outcomes.

Scoring. Every run writes a checkpoint every ``--eval-every`` steps (60, a multiple of the sync
steps: a swarm peer saves after the boundary's round, so it holds the weights the round agreed on).
After the run this script loads every checkpoint with ``p2p_spes.checkpoint`` into a full
``p2p_spes.model.MoETransformer`` and computes, itself, the mean next-token cross-entropy (fp32, no
auxiliary losses) over one fixed set of validation windows, the same for every arm, seed and step:
windows 0 .. W-1 (``--val-windows``, default 1024 of the 2324) of the embedded corpus's validation split
(held-out documents, see ``p2p_spes/corpus.py``), window i being the ``seq_len + 1`` tokens at
``i * seq_len`` of the validation token stream (``TokenDataset.windows``), so with seq_len 64 it is
the prediction of tokens 1 .. 64 W of that stream. The training processes' own validation is
switched off (``train.eval_batches=1``, once at the end), since its windows follow the batch size.
A swarm's value at a step is its model: the shared weights with each expert taken from the checkpoint
of the peer that trains it. After an averaged round uncompressed peers are bit-identical; under a
lossy codec a lone holder trains ahead of the copies the others follow by encoded deltas, and between
the rounds that average the experts (``-every4``) every holder does, so its own checkpoint is where its
expert is. The JSON also keeps the mean over the peers' own checkpoints
(``peer_mean_curve``) and says at each step how many distinct weight files the peers held. The
checkpoints are deleted once scored.

Prints a table, writes ``benchmarks/results/convergence/main.json`` (per arm and seed: the curve, the final
loss, the run's rounds, skipped steps and tokens; per arm: mean, min-max and std over seeds, the gap to
centralized and to uncompressed spes) and plots the curves to ``benchmarks/results/convergence/main.png``
(needs matplotlib: ``pip install -e .[bench]``). ``--variant NAME`` writes ``NAME.json`` and ``NAME.png``
there instead (a quick look, or a setup other than the default).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from benchmarks.lab import results
from benchmarks.lab.spread import spread
from dht.node import sigterm_as_interrupt
from p2p_spes.checkpoint import WEIGHTS, load_checkpoint, read_state
from p2p_spes.config import load_config
from p2p_spes.corpus import prepare_embedded_data
from p2p_spes.data import TokenDataset
from p2p_spes.errors import SwarmError
from p2p_spes.export import checkpoint_config
from p2p_spes.local_swarm import LocalSwarm, PeerPlace
from p2p_spes.metrics_log import read_metrics
from p2p_spes.model import MoETransformer
from p2p_spes.run_summary import read_summary

# a narrow version of the embedded tiny model, so that every arm x 3 seeds fits ~75 min on 2 cores
CONFIG = [
    "model.d_model=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.max_seq_len=64",
    "moe.num_experts=8",
    "moe.ffn_dim=128",
    "train.log_interval=10",
    "swarm.matchmaking_time=3",
    "swarm.averaging_timeout=20",
    # every stored run of this benchmark and of quality.py, local_steps.py and grad_norms.py trained with
    # AdamW, the default until train.optimizer became muon; their muon arms set it themselves, and ran with
    # the AdamW-stepped parameters at lr x 1 until that became x 4 (train.muon_adamw_lr_scale)
    "train.optimizer=adamw",
    "train.muon_adamw_lr_scale=1",
]
SPES = [
    "experts.placement=spes",
    "swarm.merge_interval={merge}",
    "swarm.outer_optimizer=average",
    "swarm.compression=none",
]
ARMS: dict[str, list[str] | None] = {
    "centralized": None,
    "spes": SPES,
    "diloco": [
        "swarm.experts_per_peer={experts}",
        "swarm.merge_interval=0",
        "swarm.outer_optimizer=nesterov",
        "swarm.outer_lr=0.7",
        "swarm.outer_momentum=0.9",
        "swarm.compression=none",
    ],
    "spes-fp16": [*SPES[:-1], "swarm.compression=fp16"],
    "spes-int8": [*SPES[:-1], "swarm.compression=int8"],
    "spes-int4": [*SPES[:-1], "swarm.compression=int4"],
    "spes-topk": [*SPES[:-1], "swarm.compression=topk"],
    "spes-topk-keep": [*SPES[:-1], "swarm.compression=topk", "swarm.keep_local_progress=true"],
    "spes-topk-dense": [*SPES[:-1], "swarm.compression=topk", "swarm.topk_result_fraction=0.0625"],
    "spes-topk-keep-dense": [
        *SPES[:-1],
        "swarm.compression=topk",
        "swarm.keep_local_progress=true",
        "swarm.topk_result_fraction=0.0625",
    ],
    "spes-topk-dense-lone5": [
        *SPES[:-1],
        "swarm.compression=topk",
        "swarm.topk_result_fraction=0.0625",
        "swarm.topk_lone_fraction=0.01953125",
    ],
    # the averaged parts at 8 values a block and a lone holder's update at 8: more of the budget to the copies
    "spes-topk-dense8-lone8": [
        *SPES[:-1],
        "swarm.compression=topk",
        "swarm.topk_result_fraction=0.03125",
        "swarm.topk_lone_fraction=0.03125",
    ],
    # between the two: the averaged parts at 12 values a block and a lone holder's update at 7
    "spes-topk-dense12-lone7": [
        *SPES[:-1],
        "swarm.compression=topk",
        "swarm.topk_result_fraction=0.046875",
        "swarm.topk_lone_fraction=0.02734375",
    ],
    # the lone holders' updates in a dense codec, the experts every K rounds ("-decay": residuals x 0.95)
    **{
        f"spes-topk-dense-{codec}-every{k}{'-decay' if decay else ''}": [
            *SPES[:-1],
            "swarm.compression=topk",
            "swarm.topk_result_fraction=0.0625",
            f"swarm.lone_compression={codec}",
            f"swarm.expert_sync_rounds={k}",
            *(["swarm.feedback_decay=0.95"] if decay else []),
        ]
        for codec, k, decay in (("int4", 16, False), ("int8", 32, False), ("none", 16, False), ("int4", 16, True))
    },
    "spes-sparse": [*SPES[:-1], "swarm.compression=sparse"],
    "spes-every4": [*SPES, "swarm.expert_sync_rounds=4"],
    "spes-every16": [*SPES, "swarm.expert_sync_rounds=16"],
    "spes-int8-every16": [*SPES[:-1], "swarm.compression=int8", "swarm.expert_sync_rounds=16"],
    "spes-topk-dense-every4": [
        *SPES[:-1],
        "swarm.compression=topk",
        "swarm.topk_result_fraction=0.0625",
        "swarm.expert_sync_rounds=4",
    ],
    "spes-no-merge": [
        "experts.placement=spes",
        "swarm.merge_interval=0",
        "swarm.outer_optimizer=average",
        "swarm.compression=none",
    ],
}
DEFAULT_ARMS = [
    a
    for a in ARMS
    if a
    not in (
        "spes-no-merge",
        "spes-topk-keep",
        "spes-topk-dense",
        "spes-topk-keep-dense",
        "spes-sparse",
        "spes-every4",
        "spes-every16",
        "spes-int8-every16",
        "spes-topk-dense-every4",
        "spes-topk-dense-int4-every16",
        "spes-topk-dense-int8-every32",
        "spes-topk-dense-none-every16",
        "spes-topk-dense-int4-every16-decay",
        "spes-topk-dense8-lone8",
        "spes-topk-dense12-lone7",
    )
]
SUMMARY_KEYS = (
    "step",
    "tokens",
    "local_experts",
    "rounds_joined",
    "rounds_alone",
    "rounds_failed",
    "tokens_averaged",
    "schedule_steps_advanced",
    "steps_skipped",
    "updates_refused",
    "refresh_missed",
    "delta_refreshes",
    "anchors_rebased",
    "compression",
    "bytes_sent",
    "bytes_received",
    "final_train_loss",
    "memory",
    "sync_memory",
)


def schedule(steps: int) -> list[str]:
    """The overrides for a run of ``steps`` steps with its warm-up (a twentieth of them): the same in
    every benchmark that scores on this model."""
    return [f"train.max_steps={steps}", f"train.warmup_steps={max(steps // 20, 1)}"]


# Scoring ---------------------------------------------------------------------------------------------
class Validation:
    """Windows 0 .. count-1 of the embedded validation split, scored by mean next-token cross-entropy."""

    def __init__(self, seq_len: int, count: int | None, batch: int = 64) -> None:
        data = TokenDataset(prepare_embedded_data(), split="validation", verify=True)
        total = data.num_windows(seq_len)
        self.count = min(count, total) if count else total
        self.seq_len = seq_len
        windows = torch.from_numpy(data.windows(list(range(self.count)), seq_len))
        self.batches = [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows.split(batch)]
        self.describe = {
            "split": "validation of the embedded corpus (p2p_spes/corpus.py: held-out documents)",
            "directory": str(data.path),
            "shards": [s.sha256 for s in data.entries],
            "seq_len": seq_len,
            "windows": self.count,
            "windows_available": total,
            "predicted_tokens": self.count * seq_len,
            "which": f"window i = tokens [{seq_len} i, {seq_len} i + {seq_len}] of the validation stream, "
            f"i = 0 .. {self.count - 1}",
        }
        self._models: dict[str, MoETransformer] = {}

    def load(self, checkpoint: Path, state: dict[str, Any], slot: int = 0) -> MoETransformer:
        """The checkpoint in a full model (every expert trainable: all of them are ordinary weights);
        ``slot`` picks one of several models kept per configuration."""
        cfg = checkpoint_config(state, checkpoint)
        key = f"{cfg.model_fingerprint()}/{slot}"
        if key not in self._models:
            self._models[key] = MoETransformer(cfg.model, cfg.moe, local_experts=list(range(cfg.moe.num_experts)))
        model = self._models[key]
        load_checkpoint(checkpoint, model, state=state)
        return model

    def score(self, checkpoint: Path, state: dict[str, Any]) -> float:
        return self.loss(self.load(checkpoint, state))

    def score_assembled(self, checkpoints: list[tuple[Path, dict[str, Any]]], holders: list[list[int]]) -> float:
        """The swarm's model: the first peer's checkpoint with each expert taken from a peer that trains
        it. A lone holder under a lossy codec trains ahead of the copies the other peers follow by
        encoded deltas, so its own checkpoint is where its expert's weights are."""
        model = self.load(*checkpoints[0], slot=0)
        for (path, state), experts in zip(checkpoints[1:], holders[1:]):
            source = self.load(path, state, slot=1)
            for e in experts:
                if e not in holders[0]:
                    model.write_expert(e, source.expert_tensors(e))
        return self.loss(model)

    @torch.no_grad()
    def loss(self, model: MoETransformer) -> float:
        model.eval()
        total = 0.0
        for x, y in self.batches:
            logits, _ = model(x)
            total += float(
                F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
            )
        return total / (self.count * self.seq_len)


def score_run(
    peer_dirs: list[Path], validation: Validation, boundaries: list[int], holders: list[list[int]] | None = None
) -> dict[str, Any]:
    """The validation loss at every boundary of the swarm's model (with ``holders``, each peer's
    experts: shared weights and each expert from a peer that trains it; else the mean over peers) and
    of every peer's own checkpoint (identical weights scored once)."""
    cache: dict[str, float] = {}
    per_step: dict[int, list[float]] = {}
    assembled: dict[int, float] = {}
    distinct: dict[int, int] = {}
    for step in boundaries:
        losses, digests, found = [], set(), []
        for peer in peer_dirs:
            path = peer / "checkpoints" / f"step_{step:08d}"
            if not path.is_dir():
                continue
            state = read_state(path)  # also checks the files against their SHA-256
            found.append((path, state))
            digest = state["checksums"][WEIGHTS]
            if digest not in cache:
                cache[digest] = validation.score(path, state)
            losses.append(cache[digest])
            digests.add(digest)
        if losses:
            per_step[step] = losses
            distinct[step] = len(digests)
        if holders and len(found) == len(peer_dirs):
            assembled[step] = (
                cache[next(iter(digests))] if len(digests) == 1 else validation.score_assembled(found, holders)
            )
    curve = {s: statistics.fmean(v) for s, v in per_step.items()}
    return {
        "curve": {s: assembled.get(s, v) for s, v in curve.items()},
        "peer_mean_curve": curve,
        "peers_scored": {s: len(v) for s, v in per_step.items()},
        "distinct_weights": distinct,
        "peer_spread": {s: max(v) - min(v) for s, v in per_step.items()},
    }


# Lockstep peers ----------------------------------------------------------------------------------------
LAUNCHER = "--peer-launcher"
BARRIER_TIMEOUT = 300.0


def lockstep_place(gate: Path, peers: int):
    """LocalSwarm places that start each peer through :func:`peer_launcher` (same process id, loopback):
    ``env`` execs ``python -m benchmarks.convergence`` with the checkout on the path, whatever the cwd."""
    module = "benchmarks.convergence"
    prefix = ("env", f"PYTHONPATH={results.REPO}", sys.executable, "-m", module, LAUNCHER, str(gate), str(peers))
    return lambda index: PeerPlace(argv_prefix=prefix)


def peer_launcher(argv: list[str]) -> int:
    """``-m benchmarks.convergence --peer-launcher GATE P python -m p2p_spes train ...``: that peer, held at
    each boundary.

    Before the hook that runs a sync round at a boundary step, the peer waits until all P peers have
    reached that step (a file per peer and step under GATE). Nothing else changes: the round, the
    averaging and the schedule are the swarm's. Without this, the first peer to reach a boundary opens
    the round and the others join at the end of the step they are in, skipping the rest (on 2 shared
    cores: 1-3 steps per round, and the first round's whole start-up skew), so the arms would not see
    equal tokens.
    """
    gate, peers = Path(argv[0]), int(argv[1])
    rest = argv[argv.index("p2p_spes") + 1 :]
    from p2p_spes.cli import main as cli_main
    from p2p_spes.peer import SwarmSync

    run_hook = SwarmSync.post_step

    def held(self: SwarmSync, trainer) -> None:
        if trainer.step % self.sync_steps == 0 and trainer.step <= trainer.cfg.train.max_steps:
            (gate / f"{trainer.step:08d}.{os.getpid()}").touch()
            deadline = time.monotonic() + BARRIER_TIMEOUT
            while len(list(gate.glob(f"{trainer.step:08d}.*"))) < peers:
                if time.monotonic() > deadline:  # a peer died: go on, and say so
                    (gate / f"timeout-{trainer.step:08d}.{os.getpid()}").touch()
                    break
                time.sleep(0.01)
        run_hook(self, trainer)

    SwarmSync.post_step = held
    return cli_main(rest)


# Running ---------------------------------------------------------------------------------------------
def run_centralized(overrides: list[str], run_dir: Path, timeout: float) -> None:
    cmd = [sys.executable, "-m", "p2p_spes", "train", "--no-progress", "--run-dir", str(run_dir)]
    for item in overrides:
        cmd += ["--set", item]
    log_path = run_dir.parent / f"{run_dir.name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:  # timed out, or this benchmark interrupted: the run stops with it
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if code != 0:
        raise SystemExit(f"centralized training failed (exit {code}); see {log_path}:\n{log_path.read_text()[-2000:]}")


def swarm_report(peer_dirs: list[Path]) -> dict[str, Any]:
    """What the peers did: their summaries, and per round the outcome and schedule jump of each peer."""
    peers, rounds = [], []
    for i, peer in enumerate(peer_dirs):
        summary = read_summary(peer)
        peers.append({k: summary.get(k) for k in SUMMARY_KEYS})
        for r in read_metrics(peer):
            if "sync_round" in r:
                rounds.append(
                    {
                        "peer": i,
                        "round": r["sync_round"],
                        "step": r["step"],
                        "outcome": r.get("outcome"),
                        "members": r.get("shared_members"),
                        "jump": r.get("schedule_jump", 0),
                        "groups_failed": r.get("groups_failed", []),
                        "seconds": r.get("sync_seconds"),
                        "errors": {g: v["error"] for g, v in (r.get("groups") or {}).items() if v.get("error")},
                    }
                )
    outcomes: dict[str, int] = {}
    for r in rounds:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    return {
        "peers": peers,
        "rounds": rounds,
        "round_outcomes": outcomes,
        "steps_jumped": sum(r["jump"] or 0 for r in rounds),
        "steps_skipped": sum(p.get("steps_skipped") or 0 for p in peers),
        "groups_failed": sum(len(r["groups_failed"]) for r in rounds),
        "updates_refused": sum(p.get("updates_refused") or 0 for p in peers),
        "refresh_missed": sum(p.get("refresh_missed") or 0 for p in peers),
        "tokens": sum(p.get("tokens") or 0 for p in peers),
    }


def run_arm(
    arm: str,
    seed: int,
    args: argparse.Namespace,
    common: list[str],
    work: Path,
    validation: Validation,
    boundaries: list[int],
    extra: list[str] | None,
    peers: int | None = None,
) -> dict[str, Any]:
    """One arm at one seed: trained, scored at ``boundaries`` and summarised. ``extra`` is the arm's
    swarm overrides, ``None`` for one centralized process with the batch of ``peers`` (default
    ``args.peers``) peers; its run directory is deleted unless ``args.keep_runs``."""
    peers = peers or args.peers
    run_dir = work / f"{arm}-seed{seed}"
    seeded = [f"train.seed={seed}", f"data.seed={seed}"]
    t0 = time.monotonic()
    if extra is None:
        overrides = common + seeded + [f"train.batch_size={peers * args.batch}", f"train.threads={args.threads}"]
        run_centralized(overrides, run_dir, timeout=args.timeout)
        peer_dirs, report = [run_dir], None
        summary = read_summary(run_dir)
        tokens, memory = summary["tokens"], summary.get("memory")
    else:
        overrides = common + seeded + [f"train.batch_size={args.batch}", *extra]
        gate = run_dir / "gate"
        gate.mkdir(parents=True)
        place = None if args.free_pacing else lockstep_place(gate, peers)
        swarm = LocalSwarm(None, overrides, peers=peers, run_dir=run_dir, run_id=f"conv-{arm}-{seed}", place=place)
        try:
            swarm.run(timeout=args.timeout, stagger=1.0)
        except SwarmError as exc:
            raise SystemExit(f"{arm} seed {seed}: {exc}") from None
        peer_dirs = [run_dir / f"peer{i}" for i in range(peers)]
        report = swarm_report(peer_dirs)
        report["barrier_timeouts"] = sorted(p.name for p in gate.glob("timeout-*"))
        tokens, memory = report["tokens"], None
    seconds = time.monotonic() - t0
    holders = None if report is None else [p.get("local_experts") or [] for p in report["peers"]]
    scored = score_run(peer_dirs, validation, boundaries, holders)
    score_seconds = time.monotonic() - t0 - seconds
    if args.steps not in scored["curve"]:
        raise SystemExit(f"{arm} seed {seed}: no checkpoint at the last step {args.steps} (see {run_dir})")
    result = {
        "seed": seed,
        "overrides": overrides,
        "train_seconds": round(seconds, 1),
        "score_seconds": round(score_seconds, 1),
        "final": scored["curve"][args.steps],
        "tokens_trained": tokens,
        **scored,
        "swarm": report,
    }
    if memory is not None:
        result["memory"] = memory
    if not args.keep_runs:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


# the payload keys that make two runs of this script the same measurement (with the arm's overrides and the seed)
SETUP_KEYS = (
    "config",
    "peers",
    "batch",
    "steps",
    "sync_steps",
    "eval_every",
    "merge_interval",
    "pacing",
    "validation",
    "threads",
)
SETUP_DEFAULTS = {"threads": 1}  # what a result written before the key was recorded ran with
BY_STEP = ("curve", "peer_mean_curve", "peers_scored", "distinct_weights", "peer_spread")


def reusable(
    earlier: results.Result, setup: dict[str, Any], arms: list[str], platform: str | None = None
) -> dict[tuple[str, int], dict[str, Any]]:
    """The runs of an earlier result of this script that this one takes instead of running them again
    (``--reuse``: an interrupted run resumed, or a baseline whose runs are deterministic): each run of an
    arm of ``arms`` that the earlier file ran with the same overrides, by (arm, seed). Refused
    (:class:`results.ResultError`) when the file measured another setup, or on another ``platform`` than
    this one (given): runs repeat to the last digit only on the machine that ran them."""
    if platform is not None and earlier.platform not in (None, platform):
        raise results.ResultError(
            f"{earlier.path} was measured on {earlier.platform}, this machine is {platform}: its runs would not "
            "repeat here, so a comparison with them mixes machines; run without --reuse"
        )
    setup = json.loads(json.dumps(setup))  # as the file holds it
    differs = [k for k in SETUP_KEYS if earlier.payload.get(k, SETUP_DEFAULTS.get(k)) != setup[k]]
    if differs:
        raise results.ResultError(
            f"{earlier.path} measured another setup ({', '.join(differs)} differ): its runs are not this one's; "
            "run without --reuse, or name a result of the same command"
        )
    taken = {}
    for arm, seeds in earlier.payload.get("runs", {}).items():
        if arm in arms and earlier.payload.get("arms", {}).get(arm) == ARMS[arm]:
            for run in seeds:
                run = {k: {int(s): x for s, x in v.items()} if k in BY_STEP else v for k, v in run.items()}
                origin = {"variant": earlier.path.stem, "commit": earlier.provenance["commit"]}
                # a run the earlier result took from another keeps the file that measured it
                taken[(arm, run["seed"])] = {**run, "reused_from": run.get("reused_from") or origin}
    return taken


def take_runs(
    earlier: list[results.Result],
    setup: dict[str, Any],
    arms: list[str],
    seeds: list[int],
    other_machine: bool = False,
    only: list[list[str] | None] | None = None,
) -> tuple[dict[tuple[str, int], dict[str, Any]], list[results.Result]]:
    """:func:`reusable` over several earlier results, the first that has a run winning, for the ``seeds``
    this run asks for (and, where ``only`` names them for a result, from those of its arms), all measured
    on this machine unless ``other_machine``; with the results that gave a run (oldest first, as a
    provenance lists them, each with its machine)."""
    taken: dict[tuple[str, int], dict[str, Any]] = {}
    given: dict[tuple[str, int], results.Result] = {}
    here = None if other_machine else results.machine()["platform"]
    for result, named in reversed(list(zip(earlier, only or [None] * len(earlier)))):
        wanted = [a for a in arms if named is None or a in named]
        for key, run in reusable(result, setup, wanted, here).items():
            if key[1] in seeds:
                taken[key], given[key] = run, result
    used = {id(r): r for r in given.values()}.values()
    return taken, sorted(used, key=lambda r: r.provenance.get("date") or "")


# Reporting -------------------------------------------------------------------------------------------
def summarise(runs: dict[str, list[dict[str, Any]]], budget: int, steps: int, boundaries: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm, seeds in runs.items():
        finals = [r["final"] for r in seeds]
        mean_curve = {
            s: statistics.fmean(r["curve"][s] for r in seeds) for s in boundaries if all(s in r["curve"] for r in seeds)
        }
        early = [s for s in mean_curve if s <= 0.8 * steps]
        out[arm] = {
            "final": spread(finals),
            "finals": {r["seed"]: r["final"] for r in seeds},
            "mean_curve": mean_curve,
            # how flat the end is: relative drop of the seed-mean loss over the last 20% of the steps
            "last_20pct_drop": (mean_curve[early[-1]] - mean_curve[steps]) / mean_curve[early[-1]] if early else None,
            "tokens_trained_share": statistics.fmean(r["tokens_trained"] for r in seeds) / budget,
            "steps_jumped": sum(r["swarm"]["steps_jumped"] for r in seeds if r["swarm"]),
            "steps_skipped": sum(r["swarm"]["steps_skipped"] for r in seeds if r["swarm"]),
            "round_outcomes": add_counts([r["swarm"]["round_outcomes"] for r in seeds if r["swarm"]]),
            "groups_failed": sum(r["swarm"]["groups_failed"] for r in seeds if r["swarm"]),
            "updates_refused": sum(r["swarm"]["updates_refused"] for r in seeds if r["swarm"]),
            "refresh_missed": sum(r["swarm"]["refresh_missed"] for r in seeds if r["swarm"]),
            "barrier_timeouts": sum(len(r["swarm"]["barrier_timeouts"]) for r in seeds if r["swarm"]),
            "not_identical_steps": sorted({s for r in seeds for s, n in r["distinct_weights"].items() if n > 1}),
            "train_seconds": sum(r["train_seconds"] for r in seeds),
        }
    for ref in ("centralized", "spes"):
        if ref not in out:
            continue
        base = out[ref]
        for arm, o in out.items():
            o[f"gap_to_{ref}"] = o["final"]["mean"] / base["final"]["mean"] - 1
            paired = [o["finals"][s] / base["finals"][s] - 1 for s in o["finals"] if s in base["finals"]]
            o[f"paired_gap_to_{ref}"] = spread(paired) if paired else None
    return out


def add_counts(counters: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in counters:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return total


def sentence(arm: str, o: dict[str, Any], seeds: int) -> str:
    f = o["final"]
    text = (
        f"{arm}: final validation loss {f['mean']:.4f} (mean of {seeds} seeds, min-max {f['min']:.4f}-{f['max']:.4f})"
    )
    if arm != "centralized" and "gap_to_centralized" in o:
        gap = o["gap_to_centralized"]
        text += f"; {abs(gap):.2%} {'above' if gap >= 0 else 'below'} centralized"
    if arm.startswith("spes-") and "gap_to_spes" in o:
        gap = o["gap_to_spes"]
        text += f", {abs(gap):.2%} {'above' if gap >= 0 else 'below'} uncompressed spes"
    return text


def print_table(console: Console, summary: dict[str, Any], seeds: list[int], tokens_per_step: int, steps: int) -> None:
    table = Table(
        title=f"final validation loss at {steps * tokens_per_step / 1e6:.2f}M tokens "
        f"(seeds {', '.join(map(str, seeds))}; same {tokens_per_step} tokens per step in every arm)"
    )
    for col in (
        "arm",
        "mean",
        "min-max",
        "std",
        "vs centralized (paired min-max)",
        "vs spes",
        "last 20% drop",
        "tokens trained",
        "rounds (outcomes)",
        "steps jumped / skipped",
        "train s",
    ):
        table.add_column(col, justify="left" if col in ("arm", "rounds (outcomes)") else "right")
    for arm, o in summary.items():
        f = o["final"]
        gap_c = (
            "-"
            if arm == "centralized" or "gap_to_centralized" not in o
            else (
                f"{o['gap_to_centralized']:+.2%} ({o['paired_gap_to_centralized']['min']:+.2%} .. "
                f"{o['paired_gap_to_centralized']['max']:+.2%})"
            )
        )
        gap_s = "-" if arm in ("centralized", "spes") or "gap_to_spes" not in o else f"{o['gap_to_spes']:+.2%}"
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(o["round_outcomes"].items())) or "-"
        swarm = arm != "centralized"
        table.add_row(
            arm,
            f"{f['mean']:.4f}",
            f"{f['min']:.4f}-{f['max']:.4f}",
            f"{f['std']:.4f}",
            gap_c,
            gap_s,
            "-" if o["last_20pct_drop"] is None else f"{o['last_20pct_drop']:.2%}",
            f"{o['tokens_trained_share']:.1%}",
            outcomes,
            f"{o['steps_jumped']} / {o['steps_skipped']}" if swarm else "-",
            f"{o['train_seconds']:.0f}",
        )
    console.print(table)


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None (said once) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[bench]): no plot")
        return None
    return plt


def plot(runs: dict[str, list[dict[str, Any]]], tokens_per_step: int, out: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for name, seeds in runs.items():
        steps = sorted(set.intersection(*(set(r["curve"]) for r in seeds)))
        x = [s * tokens_per_step / 1e6 for s in steps]
        values = [[r["curve"][s] for r in seeds] for s in steps]
        mean = [statistics.fmean(v) for v in values]
        for ax in axes:
            (line,) = ax.plot(x, mean, marker="o", markersize=2.5, linewidth=1.2, label=name)
            ax.fill_between(x, [min(v) for v in values], [max(v) for v in values], color=line.get_color(), alpha=0.15)
    half = max(s for r in runs.values() for s in r[0]["curve"]) * tokens_per_step / 1e6 / 2
    axes[1].set_xlim(left=half)
    late = [
        r["curve"][s] for seeds in runs.values() for r in seeds for s in r["curve"] if s * tokens_per_step / 1e6 >= half
    ]
    if late:
        pad = (max(late) - min(late)) * 0.05 + 1e-3
        axes[1].set_ylim(min(late) - pad, max(late) + pad)
    axes[0].set_title("validation loss (same windows for every arm)")
    axes[1].set_title("second half, zoomed")
    for ax in axes:
        ax.set_xlabel("tokens trained by the whole run (millions)")
        ax.set_ylabel("validation loss (mean of seeds; band: min-max)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=480, help="steps per run (centralized: the same, P x batch)")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="per-peer batch size b")
    parser.add_argument("--sync-steps", type=int, default=30)
    parser.add_argument("--merge-interval", type=int, default=60)
    parser.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="steps between scored checkpoints, a multiple of --sync-steps (default: 2 x --sync-steps)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the centralized run (peers: 1 each; 2 threads ran 8x slower beside other jobs)",
    )
    parser.add_argument("--val-windows", type=int, default=1024, help="validation windows scored (0: all 2324)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    parser.add_argument(
        "--free-pacing",
        action="store_true",
        help="do not hold peers at sync boundaries: the swarm's own pacing (peers may skip steps)",
    )
    parser.add_argument("--keep-runs", action="store_true", help="keep the run directories (and checkpoints)")
    parser.add_argument(
        "--reuse",
        nargs="+",
        default=[],
        metavar="VARIANT[:ARM,...]",
        help="take the runs (arm and seed) that convergence/VARIANT.json measured with this same setup instead of "
        "running them again (the first file that has one; with :ARM,... only those arms' runs): resume a stopped "
        "run, or keep a deterministic baseline; each run taken names its file's commit. The result holds only "
        "this command's arms and seeds, also when it writes the variant it reuses",
    )
    parser.add_argument(
        "--reuse-other-machine",
        action="store_true",
        help="let --reuse take runs measured on another platform (refused by default: floating point may differ "
        "there); only after a run of the same arm and seed repeated here to the last digit. The file's "
        "provenance names each reused file's machine",
    )
    results.add_variant(parser, help="writes benchmarks/results/convergence/<variant>.json and .png (default main)")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="K=V")
    args = parser.parse_args()
    sigterm_as_interrupt()  # SIGTERM stops the runs this benchmark started, as Ctrl-C does
    args.eval_every = args.eval_every or 2 * args.sync_steps
    if args.eval_every % args.sync_steps or args.steps % args.eval_every:
        parser.error(
            "--eval-every must be a multiple of --sync-steps, and --steps a multiple of --eval-every "
            "(every scored point is a sync boundary, the last one the last step)"
        )
    writer = results.start("convergence", args.variant, seeds=args.seeds)

    cfg = load_config(None, CONFIG + args.extra)
    seq, args.experts = cfg.model.max_seq_len, cfg.moe.num_experts
    boundaries = list(range(args.eval_every, args.steps + 1, args.eval_every))
    common = (
        CONFIG
        + schedule(args.steps)
        + [
            f"swarm.sync_steps={args.sync_steps}",
            f"train.checkpoint_interval={args.eval_every}",
            f"train.keep_checkpoints={len(boundaries) + 1}",
            f"train.eval_interval={args.steps}",
            "train.eval_batches=1",
            f"swarm.merge_decay_steps={args.steps}",
            *args.extra,
        ]
    )
    tokens_per_step = args.peers * args.batch * seq
    budget = tokens_per_step * args.steps
    torch.set_num_threads(1)  # scoring runs between trainings; 2 threads crawl when other jobs share the cores
    validation = Validation(seq, args.val_windows)
    console = Console(width=200)
    console.print(
        f"{len(args.arms)} arms x {len(args.seeds)} seeds, {args.steps} steps of {tokens_per_step} tokens "
        f"({budget / 1e6:.2f}M tokens per run); scoring on {validation.count} validation windows "
        f"({validation.count * seq} tokens)"
    )
    work = Path(tempfile.mkdtemp(prefix="p2p-spes-convergence-"))
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in args.arms}
    t_start = time.monotonic()
    png = writer.sibling(".png")
    png.parent.mkdir(parents=True, exist_ok=True)

    setup = {
        "config": common,
        "peers": args.peers,
        "batch": args.batch,
        "steps": args.steps,
        "sync_steps": args.sync_steps,
        "eval_every": args.eval_every,
        "merge_interval": args.merge_interval,
        "pacing": "swarm" if args.free_pacing else "lockstep (boundary barrier)",
        "validation": validation.describe,
        "threads": args.threads,
    }
    specs = [spec.partition(":") for spec in args.reuse]
    unknown = sorted({a for _, _, named in specs for a in named.split(",") if named and a not in ARMS})
    if unknown:
        parser.error(f"--reuse names arms that do not exist: {', '.join(unknown)}")
    taken, earlier = take_runs(
        [results.own("convergence", variant) for variant, _, _ in specs],
        setup,
        args.arms,
        args.seeds,
        args.reuse_other_machine,
        [named.split(",") if named else None for _, _, named in specs],
    )

    def save(seeds_done: list[int]) -> tuple[Path, bool, dict[str, Any]]:
        """The result file with the seeds done so far: an hours-long run stopped early keeps them."""
        summary = summarise(runs, budget, args.steps, boundaries)
        plotted = plot(runs, tokens_per_step, png)
        reused = {
            arm: {r["seed"]: r["reused_from"] for r in seeds if "reused_from" in r} for arm, seeds in runs.items()
        }
        path = writer.write(
            {
                **setup,
                "arms": {arm: ARMS[arm] for arm in args.arms},
                "seeds": seeds_done,
                "complete": seeds_done == list(args.seeds),
                "reused": {arm: seeds for arm, seeds in reused.items() if seeds},
                "tokens_per_step": tokens_per_step,
                "token_budget": budget,
                "wall_seconds": round(time.monotonic() - t_start, 1),
                "summary": jsonable(summary),
                "runs": {arm: [jsonable(r) for r in seeds] for arm, seeds in runs.items()},
                "plot": png.name if plotted else None,
            },
            merged=earlier,
        )
        return path, plotted, summary

    try:
        for n, seed in enumerate(args.seeds):  # seed-major: an interrupted benchmark has every arm at the first seeds
            for arm in args.arms:
                t0 = time.monotonic()
                if (arm, seed) in taken:
                    runs[arm].append(taken[(arm, seed)])
                    console.print(
                        f"{arm} seed {seed}: final validation loss {taken[(arm, seed)]['final']:.4f}, "
                        "reused from {variant}.json (commit {commit})".format(**taken[(arm, seed)]["reused_from"])
                    )
                    continue
                extra = (
                    None
                    if ARMS[arm] is None
                    else [o.format(merge=args.merge_interval, experts=args.experts) for o in ARMS[arm]]
                )
                result = run_arm(arm, seed, args, common, work, validation, boundaries, extra)
                runs[arm].append(result)
                swarm = result["swarm"]
                extra = (
                    ""
                    if swarm is None
                    else (
                        f", rounds {swarm['round_outcomes']}, steps jumped {swarm['steps_jumped']}, skipped "
                        f"{swarm['steps_skipped']}, groups failed {swarm['groups_failed']}, updates refused "
                        f"{swarm['updates_refused']}, refresh missed {swarm['refresh_missed']}, barrier timeouts "
                        f"{len(swarm['barrier_timeouts'])}"
                    )
                )
                console.print(
                    f"{arm} seed {seed}: final validation loss {result['final']:.4f}, "
                    f"{result['tokens_trained'] / budget:.1%} of the token budget{extra} "
                    f"({time.monotonic() - t0:.0f} s; {(time.monotonic() - t_start) / 60:.1f} min so far)"
                )
            saved = save(list(args.seeds[: n + 1]))
    finally:
        if not args.keep_runs:
            shutil.rmtree(work, ignore_errors=True)
    json_path, plotted, summary = saved  # the last seed's save holds every seed
    print_table(console, summary, args.seeds, tokens_per_step, args.steps)
    for arm, o in summary.items():
        console.print(sentence(arm, o, len(args.seeds)))
    console.print(f"total wall time {(time.monotonic() - t_start) / 60:.1f} min")
    console.print(f"wrote {json_path}" + (f" and {png}" if plotted else ""))


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == LAUNCHER:
        sys.exit(peer_launcher(sys.argv[2:]))
    main()
