"""Where a peer's step goes, against the hardware's limit: forward, backward, optimizer (Muon's
Newton-Schulz iteration within it), data and logging, per optimizer arm, and the model's FLOP/s over
a matmul rate measured in the same run.

    python -m benchmarks.step_time --steps 3 --repeats 3   # tiny + a spes-1b-shaped stack, every arm (~8 min, 2 cores)
    python -m benchmarks.step_time --shapes tiny --repeats 3 --steps 4 --variant quick

Shapes: ``tiny`` is one peer of the main job (``configs/tiny.yaml``, 2 peers: 4 of 8 experts trained,
1,024 tokens a step) built by the real :class:`~p2p_spes.train.Trainer` on the embedded corpus;
``spes-1b-stack`` is ``--layers`` layers of spes-1b's shapes (d_model 768, 16 experts of FFN 2048,
4 trained as a SPES peer's) with an 8k vocabulary and random tokens (the Qwen vocabulary's head
would be most of a CPU step and says nothing about the experts). Arms: AdamW; Muon with 5
(Muon's usual), 4 and 3 Newton-Schulz iterations (3 is the tiny config's ``train.muon_ns_steps``);
Muon on attention only with the experts on AdamW (``muon-attn``). Each arm keeps its own model
and optimizer; after one warm-up step per arm the arms run ``--steps`` steps each in turn,
``--repeats`` times, so a noisy shared machine slows them alike, and every figure is also given as a
ratio to AdamW's step in the same repeat (median, min-max over repeats).

The parts of a step are timed back to back (``torch.cuda.synchronize`` at each mark on a GPU): data
(the loader's next batch), forward (the loss), backward, optimizer (gradient clipping, the step, zero
grad; the Newton-Schulz time is the calls of :func:`p2p_spes.optim.orthogonalize` inside it) and
logging (the loss parts and gradient norm read back as floats and a metrics line written, as the
trainer does). Model FLOPs are ``benchmarks.gpu_throughput.flops_per_token`` (6 x active parameters
plus attention) x tokens; MFU is the achieved model FLOP/s over the fp32 matmul rate of a large
square matmul timed on the same device in the same run. The Newton-Schulz FLOPs are counted apart
(:func:`p2p_spes.optim.ns_flops`): they do not grow with the batch, which is why the optimizer is
most of a step at 1,024 tokens; ``projected`` gives the optimizer's share at the config's real
tokens per step (spes-1b: 4 x 8 x 2048) from the measured per-token forward+backward time.
Writes ``benchmarks/results/step_time/<variant>.json`` (default ``main``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.gpu_throughput import flops_per_token
from benchmarks.lab import results
from p2p_spes import optim
from p2p_spes.config import Config, load_config
from p2p_spes.metrics_log import MetricsWriter
from p2p_spes.model import MoETransformer
from p2p_spes.optim import MuonAdamW, build_optimizer, ns_flops, trainable_parameters

PARTS = ("data", "forward", "backward", "optimizer", "logging")
# what the clock reads: wall time, or (``--clock cpu``, CPU only) this process's CPU time, which a crowded
# machine's descheduling does not inflate; with one thread (OMP_NUM_THREADS=1) it is the compute's time
CLOCK: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
now = CLOCK["wall"]


def use_clock(name: str) -> None:
    """Read ``name``'s clock (:data:`CLOCK`) from now on, in this benchmark and in those that use its steps."""
    global now
    now = CLOCK[name]


@dataclass(frozen=True)
class Arm:
    """An optimizer as ``train.optimizer`` and ``train.muon_ns_steps`` would set it."""

    name: str
    optimizer: str
    ns_steps: int = 5
    muon_experts: bool = True  # False: the expert stacks on AdamW, Muon on attention only


ARMS = {
    a.name: a
    for a in (
        Arm("adamw", "adamw"),
        Arm("muon", "muon"),
        Arm("muon-4", "muon", 4),
        Arm("muon-3", "muon", 3),
        Arm("muon-attn", "muon", 5, False),
    )
}
SHAPES: dict[str, list[str]] = {
    "tiny": ["peer.count=2", "peer.index=0"],
    "spes-1b-stack": ["peer.count=4", "peer.index=0", "model.vocab_size=8192", "model.max_seq_len=1024"],
}


@dataclass
class StepTimes:
    """One step's parts in seconds; ``total`` is timed around the whole step, apart from the parts."""

    data: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    optimizer: float = 0.0
    orthogonalize: float = 0.0
    logging: float = 0.0
    total: float = 0.0

    def parts_sum(self) -> float:
        return sum(getattr(self, k) for k in PARTS)


@dataclass
class Runner:
    """An arm's model, optimizer and batches: the trainer's pieces, stepped here with a clock at each part."""

    arm: Arm
    cfg: Config
    model: MoETransformer
    optimizer: torch.optim.Optimizer
    next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    device: torch.device
    log_dir: Path
    steps: list[StepTimes] = field(default_factory=list)

    def step(self) -> StepTimes:
        """One training step as ``Trainer.train_step`` takes it (one micro-batch), its parts timed."""
        tr, times = self.cfg.train, StepTimes()
        clock = Clock(self.device)
        start = clock()
        self.model.train()
        x, y = self.next_batch()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        times.data = clock.lap()
        out = self.model.loss(x, y, z_loss_weight=tr.z_loss_weight)
        times.forward = clock.lap()
        out.loss.backward()
        times.backward = clock.lap()
        params = [p for _, p in trainable_parameters(self.model)]
        with timed_orthogonalize(self.device) as ns:
            norm = torch.nn.utils.clip_grad_norm_(params, tr.grad_clip if tr.grad_clip > 0 else math.inf)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        times.optimizer, times.orthogonalize = clock.lap(), ns[0]
        record = {**out.as_floats(), "grad_norm": float(norm), "step": len(self.steps)}
        MetricsWriter(self.log_dir).append(record)
        times.logging = clock.lap()
        times.total = clock() - start
        self.steps.append(times)
        return times


class Clock:
    """``perf_counter`` after a device synchronize; ``lap`` is the time since the previous mark."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.last = self()

    def __call__(self) -> float:
        sync(self.device)
        return now()

    def lap(self) -> float:
        now = self()
        lap, self.last = now - self.last, now
        return lap


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def timed_orthogonalize(device: torch.device) -> Iterator[list[float]]:
    """Within the block, every call of ``optim.orthogonalize`` (what ``MuonAdamW`` calls) adds its time
    to the yielded cell."""
    inner, cell = optim.orthogonalize, [0.0]

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        sync(device)
        t0 = now()
        out = inner(*args, **kwargs)
        sync(device)
        cell[0] += now() - t0
        return out

    optim.orthogonalize = wrapped
    try:
        yield cell
    finally:
        optim.orthogonalize = inner


def matmul_rate(device: torch.device, n: int, repeat: int = 5) -> float:
    """FP32 FLOP/s of an n x n matmul on ``device``, best of ``repeat``: the limit MFU is measured against."""
    a, b = (torch.randn(n, n, device=device) for _ in range(2))
    a @ b
    best = math.inf
    for _ in range(repeat):
        sync(device)
        t0 = now()
        a @ b
        sync(device)
        best = min(best, now() - t0)
    return 2 * n**3 / best


def shape_config(shape: str, arm: Arm, extra: list[str]) -> Config:
    base = "spes-1b" if shape == "spes-1b-stack" else None
    sets = [*SHAPES[shape], f"train.optimizer={arm.optimizer}", *extra]
    return load_config(base, sets)


def build_runner(shape: str, arm: Arm, device: torch.device, extra: list[str], log_dir: Path, seed: int) -> Runner:
    """The tiny shape through :class:`~p2p_spes.train.Trainer` (its model, optimizer and data loader);
    other shapes from the model and optimizer alone, with random tokens."""
    cfg = shape_config(shape, arm, extra)
    log_dir.mkdir(parents=True, exist_ok=True)
    if shape == "tiny":
        from p2p_spes.train import Trainer  # the data preparation it brings is needed here only

        trainer = Trainer(cfg, run_dir=log_dir / "run")
        model, next_batch = trainer.model, trainer.loader.next_batch
    else:
        model = MoETransformer(cfg.model, cfg.moe, local_experts=cfg.local_experts(), device=device)
        model.init_weights(seed)
        gen = torch.Generator().manual_seed(seed)
        shape_xy = (cfg.train.batch_size, cfg.model.max_seq_len + 1)

        def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
            w = torch.randint(0, cfg.model.vocab_size, shape_xy, generator=gen)
            return w[:, :-1], w[:, 1:]

    optimizer = build_optimizer(model, cfg.train, ns_steps=arm.ns_steps, muon_experts=arm.muon_experts)
    return Runner(arm, cfg, model, optimizer, next_batch, device, log_dir)


def optimizer_ns_flops(runner: Runner) -> int:
    """Newton-Schulz FLOPs per step of the runner's Muon groups (0 with AdamW)."""
    opt = runner.optimizer
    if not isinstance(opt, MuonAdamW):
        return 0
    return sum(ns_flops(tuple(p.shape), g["ns_steps"]) for g in opt.param_groups if g["muon"] for p in g["params"])


def real_tokens_per_step(shape: str) -> int:
    """Tokens of one optimizer step as the shape's own config sets it (spes-1b: its full batch and sequence)."""
    full = load_config("spes-1b" if shape == "spes-1b-stack" else None)
    return full.train.batch_size * full.train.grad_accum * full.model.max_seq_len


def measure_shape(
    shape: str, arms: list[Arm], steps: int, repeats: int, device: torch.device, extra: list[str], seed: int
) -> dict[str, Any]:
    """Every arm of one shape, interleaved: per arm the mean step and parts of each repeat, and the ratios
    to AdamW's step in the same repeat."""
    with tempfile.TemporaryDirectory() as tmp:
        runners = []
        for arm in arms:
            torch.manual_seed(seed)
            runners.append(build_runner(shape, arm, device, extra, Path(tmp) / arm.name, seed))
        for r in runners:  # warm-up: first allocations, optimizer state
            r.step()
            r.steps.clear()
        per_repeat: dict[str, list[StepTimes]] = {a.name: [] for a in arms}
        for rep in range(repeats):
            order = runners if rep % 2 == 0 else runners[::-1]
            for r in order:
                r.steps.clear()
                for _ in range(steps):
                    r.step()
                per_repeat[r.arm.name].append(mean_times(r.steps))
        cfg = runners[0].cfg
        tokens = cfg.train.batch_size * cfg.model.max_seq_len
        model_flops = flops_per_token(cfg) * tokens
        out = {
            "steps": {"per_repeat": steps, "repeats": repeats},
            "config": {
                "overrides": [*SHAPES[shape], *extra],
                "d_model": cfg.model.d_model,
                "layers": cfg.model.num_layers,
                "experts": cfg.moe.num_experts,
                "experts_trained": len(cfg.local_experts()),
                "ffn_dim": cfg.moe.ffn_dim,
                "vocab_size": cfg.model.vocab_size,
                "seq_len": cfg.model.max_seq_len,
                "batch": cfg.train.batch_size,
            },
            "tokens_per_step": tokens,
            "model_flops_per_step": model_flops,
            "real_tokens_per_step": real_tokens_per_step(shape),
            "arms": {},
        }
        base = per_repeat.get("adamw")
        for r in runners:
            reps = per_repeat[r.arm.name]
            step_s = statistics.median(t.total for t in reps)
            fb_per_token = statistics.median((t.forward + t.backward) for t in reps) / tokens
            opt_s = statistics.median(t.optimizer for t in reps)
            real = out["real_tokens_per_step"]
            arm: dict[str, Any] = {
                **asdict(r.arm),
                "repeats": [asdict(t) for t in reps],
                "step_s": step_s,
                "parts_s": {k: statistics.median(getattr(t, k) for t in reps) for k in (*PARTS, "orthogonalize")},
                "parts_sum_over_step": statistics.median(t.parts_sum() / t.total for t in reps),
                "achieved_flops": model_flops / step_s,
                "ns_flops_per_step": optimizer_ns_flops(r),
                "projected": {
                    "tokens_per_step": real,
                    "optimizer_share": opt_s / (opt_s + fb_per_token * real),
                },
            }
            if base:
                ratios = [t.total / b.total for t, b in zip(reps, base)]
                arm["step_ratio_to_adamw"] = {
                    "median": statistics.median(ratios),
                    "min": min(ratios),
                    "max": max(ratios),
                }
            out["arms"][r.arm.name] = arm
        return out


def mean_times(steps: list[StepTimes]) -> StepTimes:
    return StepTimes(**{k: statistics.fmean(getattr(s, k) for s in steps) for k in asdict(steps[0])})


def add_mfu(shape: dict[str, Any], rates: list[float]) -> None:
    """MFU of every arm against the median matmul rate of the run."""
    rate = statistics.median(rates)
    for arm in shape["arms"].values():
        arm["mfu"] = arm["achieved_flops"] / rate
        arm["ns_share_of_limit_time"] = arm["ns_flops_per_step"] / rate / arm["step_s"]


def print_table(console: Console, shapes: dict[str, dict[str, Any]], rate: float) -> None:
    for name, shape in shapes.items():
        table = Table(
            title=f"{name}: {shape['tokens_per_step']:,} tokens a step; matmul limit {rate / 1e9:.1f} GFLOP/s (fp32)"
        )
        for col in ("arm", "step s", "x adamw", *PARTS, "of which NS", "MFU", "opt share at real batch"):
            table.add_column(col, justify="left" if col == "arm" else "right")
        for arm_name, a in shape["arms"].items():
            p = a["parts_s"]
            ratio = a.get("step_ratio_to_adamw")
            table.add_row(
                arm_name,
                f"{a['step_s']:.3f}",
                f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "",
                *(f"{p[k]:.3f}" for k in PARTS),
                f"{p['orthogonalize']:.3f}",
                f"{a['mfu']:.1%}",
                f"{a['projected']['optimizer_share']:.1%} of {a['projected']['tokens_per_step']:,}",
            )
        console.print(table)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--steps", type=int, default=4, help="steps per arm per repeat (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the arms (default 3)")
    parser.add_argument("--layers", type=int, default=2, help="layers of the spes-1b-shaped stack (default 2)")
    parser.add_argument("--stack-steps", type=int, default=1, help="--steps for the spes-1b-shaped stack (default 1)")
    parser.add_argument("--stack-repeats", type=int, default=2, help="--repeats for that stack (default 2)")
    parser.add_argument("--matmul", type=int, default=0, help="matmul size for the limit (default 2048 CPU, 8192 GPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], help="one more config override for every shape")
    parser.add_argument(
        "--clock", choices=list(CLOCK), default="wall", help="wall (default) or cpu: this process's CPU time (CPU only)"
    )
    results.add_variant(parser)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.clock == "cpu" and device.type != "cpu":
        parser.error("--clock cpu times CPU work only")
    use_clock(args.clock)
    writer = results.start("step_time", args.variant, seeds=[args.seed], argv=argv)
    n = args.matmul or (8192 if device.type == "cuda" else 2048)
    arms = [ARMS[a] for a in args.arms]
    rates = [matmul_rate(device, n)]
    shapes = {}
    for name in args.shapes:
        extra, steps, repeats = [f"train.device={device.type}", *args.set], args.steps, args.repeats
        if name == "spes-1b-stack":  # a step of it is tens of seconds on 2 CPU cores
            extra.append(f"model.num_layers={args.layers}")
            steps, repeats = args.stack_steps, args.stack_repeats
        shapes[name] = measure_shape(name, arms, steps, repeats, device, extra, args.seed)
        rates.append(matmul_rate(device, n))  # the limit before, between and after: the machine drifts
    for shape in shapes.values():
        add_mfu(shape, rates)
    payload = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "matmul": {"n": n, "dtype": "float32", "flops_per_s": rates, "median": statistics.median(rates)},
        "steps": {name: s["steps"] for name, s in shapes.items()},
        "shapes": shapes,
    }
    print_table(Console(width=160), shapes, statistics.median(rates))
    if args.variant:
        print(f"wrote {writer.write(payload)}")
    return payload


if __name__ == "__main__":
    main()
