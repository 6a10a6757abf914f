"""Validation loss at equal tokens and at equal wall time for each optimizer on the main job's shape.

    python -m benchmarks.equal_time --arms adamw muon muon-attn    # 3 seeds, ~50 min on 2 shared cores
    python -m benchmarks.equal_time --seeds 0 --steps 40 --variant quick

One process trains the tiny config (``configs/tiny.yaml``: the main job's model, batch 8 of 128
tokens, all 8 experts, as one peer alone) through the real :class:`~p2p_spes.train.Trainer` on the
embedded corpus, for ``--steps`` steps with the cosine schedule scaled to them (warm-up a tenth), once
per arm and seed (``train.seed`` and ``data.seed`` set to the seed). Arms are ``benchmarks.step_time``'s:
AdamW, Muon with 5 Newton-Schulz iterations (the default before this benchmark), 3 iterations, and
Muon on attention only with the expert stacks on AdamW at the plain lr (``muon-attn``).

Equal tokens: every arm's validation loss after ``--steps`` steps. Equal time: each arm slower per
step than AdamW trained again for ``--steps`` / (its step time over AdamW's) steps, the schedule
scaled to those, so it is scored with the tokens AdamW's wall time buys it and a finished schedule,
not cut mid-schedule. The step-time ratios are measured first, with the arms interleaved on this
run's shape (``benchmarks.step_time.measure_shape``, 3 repeats of 2 steps): on a shared machine, runs minutes
apart see different loads, steps a few seconds apart about the same (``--clock cpu`` reads this process's
CPU time instead of the wall clock: with one thread, the compute's time even on a busy machine). The arms'
order rotates per seed.
Validation: mean cross-entropy over ``--eval-batches`` batches of the embedded validation split, the
same for every arm and seed. Gaps to AdamW are paired per seed (mean, min-max). Writes
``benchmarks/results/equal_time/<variant>.json`` after every seed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.lab import results
from benchmarks.lab.spread import spread
from benchmarks.step_time import ARMS, CLOCK, Arm, measure_shape, use_clock
from p2p_spes.config import load_config
from p2p_spes.optim import build_optimizer
from p2p_spes.train import Trainer

DEFAULT_ARMS = ("adamw", "muon", "muon-3", "muon-attn")
WARM = 2  # steps left out of the seconds per step


def train_arm(arm: Arm, seed: int, steps: int, eval_batches: int, extra: list[str]) -> dict[str, Any]:
    """One run: its final validation loss, training seconds and steps."""
    cfg = load_config(
        None,
        [
            "peer.count=1",
            f"train.optimizer={arm.optimizer}",
            f"train.max_steps={steps}",
            f"train.warmup_steps={max(steps // 10, 1)}",
            f"train.seed={seed}",
            f"data.seed={seed}",
            f"train.eval_batches={eval_batches}",
            "train.device=cpu",
            *extra,
        ],
    )
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, run_dir=tmp)
        trainer.optimizer = build_optimizer(
            trainer.model, cfg.train, ns_steps=arm.ns_steps, muon_experts=arm.muon_experts
        )
        times, wall0 = [], time.perf_counter()
        while trainer.step < steps:
            times.append(trainer.train_step()["step_time_s"])
        wall = time.perf_counter() - wall0
        val = trainer.evaluate()
    steady = times[WARM:] or times  # the first steps carry one-time costs (allocation, kernels' first calls)
    per_step = statistics.fmean(steady)
    return {"steps": steps, "train_s": per_step * steps, "wall_s": wall, "s_per_step": per_step, "val_loss": val}


def summarise(
    runs: dict[str, dict[str, Any]], arms: list[str], seeds: list[int], ratios: dict[str, dict[str, float]]
) -> dict[str, Any]:
    """Per arm: loss at equal tokens and at equal time, each paired to AdamW's per seed."""
    out = {}
    for arm in arms:
        tokens = [runs[str(s)]["tokens"][arm] for s in seeds]
        same_time = [runs[str(s)]["time"].get(arm, runs[str(s)]["tokens"][arm]) for s in seeds]
        base = [runs[str(s)]["tokens"]["adamw"] for s in seeds]
        out[arm] = {
            "step_ratio_to_adamw": ratios[arm],
            "s_per_step": spread([r["s_per_step"] for r in tokens]),
            "val_equal_tokens": spread([r["val_loss"] for r in tokens]),
            "val_equal_time": spread([r["val_loss"] for r in same_time]),
            "steps_equal_time": spread([r["steps"] for r in same_time]),
            "gap_equal_tokens": spread([r["val_loss"] / b["val_loss"] - 1 for r, b in zip(tokens, base)]),
            "gap_equal_time": spread([r["val_loss"] / b["val_loss"] - 1 for r, b in zip(same_time, base)]),
        }
    return out


def print_table(console: Console, summary: dict[str, Any], steps: int, seeds: list[int]) -> None:
    table = Table(title=f"tiny, one peer, {steps} steps of 1,024 tokens; {len(seeds)} seeds (mean, min-max)")
    for col in ("arm", "s/step", "x adamw", "val @ tokens", "vs adamw", "steps @ time", "val @ time", "vs adamw "):
        table.add_column(col, justify="left" if col == "arm" else "right")
    for arm, s in summary.items():
        gt, ge = s["gap_equal_tokens"], s["gap_equal_time"]
        table.add_row(
            arm,
            f"{s['s_per_step']['mean']:.3f}",
            f"{s['step_ratio_to_adamw']['median']:.2f}",
            f"{s['val_equal_tokens']['mean']:.3f}",
            f"{gt['mean']:+.2%} ({gt['min']:+.2%}..{gt['max']:+.2%})",
            f"{s['steps_equal_time']['mean']:.0f}",
            f"{s['val_equal_time']['mean']:.3f}",
            f"{ge['mean']:+.2%} ({ge['min']:+.2%}..{ge['max']:+.2%})",
        )
    console.print(table)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100, help="steps at equal tokens (default 100)")
    parser.add_argument("--eval-batches", type=int, default=32, help="validation batches of 8 (default 32)")
    parser.add_argument("--set", action="append", default=[], help="one more config override for every run")
    parser.add_argument(
        "--merge", nargs="+", metavar="VARIANT", help="combine these variants' runs into --variant; trains nothing"
    )
    parser.add_argument(
        "--clock",
        choices=list(CLOCK),
        default="wall",
        help="what the step-time ratios are read on: wall (default) or cpu (this process's CPU time, which a "
        "crowded machine's descheduling does not inflate; with OMP_NUM_THREADS=1 the compute's time)",
    )
    results.add_variant(parser)
    args = parser.parse_args(argv)
    if "adamw" not in args.arms:
        parser.error("the arms are measured against adamw: include it")
    if args.merge:
        return merge(args.merge, args.variant, argv)
    writer = results.start("equal_time", args.variant, seeds=args.seeds, argv=argv)
    use_clock(args.clock)
    console = Console(width=140)
    ratios = step_ratios(args.arms, args.set)
    console.print(f"step time / AdamW's, interleaved: {ratios}")
    runs: dict[str, dict[str, Any]] = {}
    payload: dict[str, Any] = {}
    for i, seed in enumerate(args.seeds):
        order = args.arms[i % len(args.arms) :] + args.arms[: i % len(args.arms)]
        at_tokens, at_time = {}, {}
        for name in order:
            at_tokens[name] = train_arm(ARMS[name], seed, args.steps, args.eval_batches, args.set)
            console.print(f"seed {seed} {name} {args.steps} steps: {at_tokens[name]}")
        for name in order:
            steps = round(args.steps / ratios[name]["median"])
            if name == "adamw" or steps >= args.steps:  # as fast as AdamW: its equal-token run is the one
                continue
            at_time[name] = train_arm(ARMS[name], seed, steps, args.eval_batches, args.set)
            console.print(f"seed {seed} {name} {steps} steps (AdamW's time for {args.steps}): {at_time[name]}")
        runs[str(seed)] = {"tokens": at_tokens, "time": at_time}
        done = args.seeds[: i + 1]
        summary = summarise(runs, args.arms, done, ratios)
        print_table(console, summary, args.steps, done)
        payload = {
            "config": "tiny",
            "peers": 1,
            "steps": args.steps,
            "tokens_per_step": 1024,
            "eval_batches": args.eval_batches,
            "overrides": args.set,
            "arms": {a: vars(ARMS[a]) for a in args.arms},
            "step_ratios": ratios,
            "clock": args.clock,
            "seeds": done,
            "runs": runs,
            "summary": summary,
        }
        print(f"wrote {writer.write(payload)}")  # after every seed: a cut-short run keeps the seeds it finished
    return payload


def merge(variants: list[str], variant: str, argv: list[str] | None) -> dict[str, Any]:
    """One result from several runs of this script with the same setup (seeds run as separate processes
    on a crowded machine): their runs side by side, each seed's equal-time budget from its own process's
    interleaved ratios; the ratios shown are the median of those medians and the extremes."""
    parts = [results.own("equal_time", v) for v in variants]
    first = parts[0].payload
    keys = ("steps", "eval_batches", "overrides", "arms")
    if any(any(r.payload[k] != first[k] for k in keys) for r in parts):
        raise SystemExit(f"--merge: the variants differ in {keys}; only the same setup merges")
    runs = {seed: run for r in parts for seed, run in r.payload["runs"].items()}
    arms, seeds = list(first["arms"]), sorted(int(s) for s in runs)
    ratios = {
        arm: {
            "median": statistics.median(r.payload["step_ratios"][arm]["median"] for r in parts),
            "min": min(r.payload["step_ratios"][arm]["min"] for r in parts),
            "max": max(r.payload["step_ratios"][arm]["max"] for r in parts),
        }
        for arm in arms
    }
    summary = summarise(runs, arms, seeds, ratios)
    print_table(Console(width=140), summary, first["steps"], seeds)
    ratios_by_seed = {seed: r.payload["step_ratios"] for r in parts for seed in r.payload["runs"]}
    clocks = {seed: r.payload.get("clock", "wall") for r in parts for seed in r.payload["runs"]}
    payload = {**first, "step_ratios": ratios, "step_ratios_by_seed": ratios_by_seed, "seeds": seeds}
    payload["clock_by_seed"] = clocks
    payload |= {"runs": runs, "summary": summary}
    writer = results.start("equal_time", variant, seeds=seeds, argv=argv)
    print(f"wrote {writer.write(payload, merged=parts)}")
    return payload


def step_ratios(arms: list[str], extra: list[str], steps: int = 2, repeats: int = 3) -> dict[str, dict[str, float]]:
    """Each arm's step time over AdamW's on this run's shape, measured interleaved
    (``benchmarks.step_time``): the equal-time budgets rest on these, not on runs minutes apart."""
    shape = measure_shape(
        "tiny", [ARMS[a] for a in arms], steps, repeats, torch.device("cpu"), ["peer.count=1", *extra], 0
    )
    return {a: shape["arms"][a]["step_ratio_to_adamw"] for a in arms}


if __name__ == "__main__":
    main()
