"""One peer's training throughput on a GPU: tokens/s, model FLOPs utilisation and peak memory.

    python -m benchmarks.gpu_throughput                      # CUDA: the spes-1b shape, every backend, ~5 min
    python -m benchmarks.gpu_throughput --largest            # also the deepest spes-1b-wide model that fits
    python -m benchmarks.gpu_throughput --cpu-smoke          # the same code on CPU with tiny shapes (checks the script)

Arms, measured side by side in one process on the same device: each MoE backend (MegaBlocks when
importable, the torch backend with ``torch._grouped_mm``, the torch backend's per-expert loop) x the
experts a peer trains (all E, as a centralized or full-replica DiLoCo peer; E/4, a SPES peer: no
gradients or AdamW state for the other experts). bf16 autocast on CUDA, AdamW, random tokens (the
speed does not depend on the data). After ``--warmup`` steps, ``--steps`` steps are timed.

Model FLOPs per token are ``6 * N_active + 12 * layers * d_model * seq_len`` (weights and attention;
``N_active`` counts the top-k experts, not the embedding), the same for every arm, so MFU ratios are
tokens/s ratios. MFU is given against the bf16 matmul rate this device reached in the same run (an
8192^3 matmul; ~800 TFLOP/s on an H100 here) and, where known, the vendor's dense bf16 peak. Peak
memory is ``torch.cuda.max_memory_allocated`` per arm; the SPES arm's ratio to the all-experts arm
is the per-peer saving measured on the GPU. Writes ``benchmarks/results/gpu_throughput/<variant>.json``
(``--variant``, default ``main``; with ``--cpu-smoke`` only when ``--variant`` is given).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from benchmarks.lab import results
from p2p_spes.config import load_config
from p2p_spes.memory import measure_memory
from p2p_spes.model import MoETransformer
from p2p_spes.optim import build_optimizer

NOMINAL_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A6000": 155e12}
SMOKE = [
    "model.vocab_size=512",
    "model.d_model=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.max_seq_len=32",
    "moe.num_experts=8",
    "moe.ffn_dim=64",
]
BACKENDS = {
    "megablocks": ["moe.impl=megablocks"],
    "torch grouped_mm": ["moe.impl=torch", "moe.torch_kernel=grouped_mm"],
    "torch loop": ["moe.impl=torch", "moe.torch_kernel=loop"],
}


def matmul_rate(device: torch.device, n: int = 8192, repeat: int = 20) -> float:
    """bf16 FLOP/s of an n^3 matmul on ``device`` (the practical peak MFU is measured against)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        a @ b
    _sync(device)
    return 2 * n**3 * repeat / (time.perf_counter() - t0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def flops_per_token(cfg) -> float:
    m, e = cfg.model, cfg.moe
    attn = 4 * m.d_model * m.d_model
    router = m.d_model * e.num_experts
    experts = e.top_k * 3 * m.d_model * e.ffn_dim
    active = m.num_layers * (attn + router + experts) + m.d_model * m.vocab_size  # + the output head
    return 6 * active + 12 * m.num_layers * m.d_model * m.max_seq_len


def measure(
    overrides: list[str], experts: list[int], batch: int, warmup: int, steps: int, device: torch.device
) -> dict:
    """Train ``steps`` timed steps of one arm; the model is freed afterwards."""
    cfg = load_config(None, overrides)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = MoETransformer(cfg.model, cfg.moe, local_experts=experts, device=device)
    model.init_weights(0)
    optimizer = build_optimizer(model, cfg.train)
    seq = cfg.model.max_seq_len
    gen = torch.Generator(device="cpu").manual_seed(0)
    data = torch.randint(0, cfg.model.vocab_size, (warmup + steps, batch, seq + 1), generator=gen)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    )
    times = []
    for i in range(warmup + steps):
        x, y = data[i, :, :-1].to(device), data[i, :, 1:].to(device)
        _sync(device)
        t0 = time.perf_counter()
        with autocast:
            out = model.loss(x, y)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step_s = sum(times) / len(times)
    tokens_per_s = batch * seq / step_s
    report = measure_memory(model, optimizer)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else report.total
    params = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    del model, optimizer, out
    gc.collect()
    return {
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "model_flops_per_s": tokens_per_s * flops_per_token(cfg),
        "peak_memory_bytes": int(peak),
        "state_bytes": int(report.total),
        "parameters": int(params),
    }


def run_arm(name: str, overrides: list[str], experts: list[int], args, device) -> dict:
    try:
        return {"arm": name, **measure(overrides, experts, args.batch, args.warmup, args.steps, device)}
    except Exception as exc:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"arm": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"}


def largest(base: list[str], experts_fn, backend: list[str], args, device) -> dict | None:
    """The deepest model of the base width that trains (E/4 experts, batch ``args.batch``)."""
    best = None
    for layers in (12, 16, 24, 32, 48, 64):
        overrides = base + backend + [f"model.num_layers={layers}"]
        got = run_arm(f"{layers} layers", overrides, experts_fn(overrides), args, device)
        if "error" in got:
            break
        best = {**got, "num_layers": layers}
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="spes-1b")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--largest", action="store_true", help="also search the deepest model that fits")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU: checks the script, not a GPU")
    results.add_variant(
        parser,
        default=None,
        help="writes benchmarks/results/gpu_throughput/<variant>.json (default main, none with --cpu-smoke)",
    )
    args = parser.parse_args()
    variant = args.variant or (None if args.cpu_smoke else results.MAIN)
    writer = results.start("gpu_throughput", variant, seeds=[0]) if variant else None  # the tokens' generator: seed 0

    if args.cpu_smoke:
        device, base, args.batch, args.warmup, args.steps = torch.device("cpu"), SMOKE, 2, 1, 2
    elif torch.cuda.is_available():
        device, base = torch.device("cuda"), load_config(args.config).to_dict()
        base = [
            f"{section}.{k}={v}"
            for section in ("model", "moe")
            for k, v in base[section].items()
            if k not in ("impl", "torch_kernel") and not isinstance(v, (list, dict))
        ]
    else:
        raise SystemExit("no CUDA device here: run on a GPU machine, or pass --cpu-smoke to check the script on CPU")

    num_experts = load_config(None, base).moe.num_experts
    subsets = {"all experts": list(range(num_experts)), "E/4 (SPES)": list(range(max(num_experts // 4, 1)))}
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    measured_peak = matmul_rate(device) if device.type == "cuda" else None
    nominal = next((v for k, v in NOMINAL_BF16.items() if k in device_name), None)

    rows = []
    for backend, extra in BACKENDS.items():
        for subset, experts in subsets.items():
            rows.append(
                {
                    "backend": backend,
                    "experts": subset,
                    **run_arm(f"{backend}, {subset}", base + extra, experts, args, device),
                }
            )

    table = Table(
        title=f"one peer's training step on {device_name} ({args.config if not args.cpu_smoke else 'smoke'}, "
        f"batch {args.batch}, bf16={device.type == 'cuda'})"
    )
    for col in (
        "backend",
        "experts trained",
        "tokens/s",
        "vs torch loop",
        "MFU (matmul)",
        "MFU (nominal)",
        "peak memory GiB",
        "vs all experts",
    ):
        table.add_column(col, justify="left" if col in ("backend", "experts trained") else "right")
    for row in rows:
        if "error" in row:
            table.add_row(row["backend"], row["experts"], escape(row["error"][:70]), "", "", "", "", "")
            continue
        loop = next(
            (r for r in rows if r["backend"] == "torch loop" and r["experts"] == row["experts"] and "error" not in r),
            None,
        )
        full = next(
            (r for r in rows if r["backend"] == row["backend"] and r["experts"] == "all experts" and "error" not in r),
            None,
        )
        row["mfu_measured_peak"] = row["model_flops_per_s"] / measured_peak if measured_peak else None
        row["mfu_nominal_peak"] = row["model_flops_per_s"] / nominal if nominal else None
        table.add_row(
            row["backend"],
            row["experts"],
            f"{row['tokens_per_s']:,.0f}",
            f"{row['tokens_per_s'] / loop['tokens_per_s']:.2f}x" if loop else "-",
            f"{row['mfu_measured_peak']:.1%}" if row["mfu_measured_peak"] else "-",
            f"{row['mfu_nominal_peak']:.1%}" if row["mfu_nominal_peak"] else "-",
            f"{row['peak_memory_bytes'] / 2**30:.2f}",
            f"{row['peak_memory_bytes'] / full['peak_memory_bytes']:.2f}x" if full else "-",
        )
    console = Console(width=150)
    console.print(table)
    if measured_peak:
        console.print(
            f"bf16 8192^3 matmul: {measured_peak / 1e12:.0f} TFLOP/s; nominal dense bf16: {nominal / 1e12:.0f} TFLOP/s"
            if nominal
            else ""
        )
    deepest = None
    if args.largest and device.type == "cuda":
        fastest = max(
            (r for r in rows if "error" not in r and r["experts"] == "E/4 (SPES)"),
            key=lambda r: r["tokens_per_s"],
            default=None,
        )
        if fastest is not None:
            deepest = largest(base, lambda o: subsets["E/4 (SPES)"], BACKENDS[fastest["backend"]], args, device)
            if deepest:
                console.print(
                    f"deepest that trains with {fastest['backend']}, E/4 experts, batch {args.batch}: "
                    f"{deepest['num_layers']} layers, {deepest['parameters'] / 1e9:.2f}B parameters, "
                    f"{deepest['tokens_per_s']:,.0f} tokens/s, {deepest['peak_memory_bytes'] / 2**30:.1f} GiB"
                )
    if writer is None:
        return
    out = writer.write(
        {
            "device": device_name,
            "torch": torch.__version__,
            "matmul_bf16_flops": measured_peak,
            "nominal_bf16_flops": nominal,
            "batch": args.batch,
            "config": base,
            "rows": rows,
            "largest": deepest,
        }
    )
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
