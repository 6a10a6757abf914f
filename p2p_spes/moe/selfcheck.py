"""Start-up check: the MoE backend and expert kernel chosen on a GPU must prove themselves on that GPU.

Why: neither MegaBlocks nor ``torch._grouped_mm`` is exercised by this project's tests (there is no
GPU in CI), and ``torch._grouped_mm`` does not support every GPU generation. So when a peer starts
on CUDA, :func:`choose_backend` runs each candidate once on a small input of the run's shapes and
dtype and compares its outputs, routing statistics and gradients with the plain per-expert loop
(same weights). Candidates, best first: MegaBlocks, the torch backend with ``grouped_mm``, the torch
backend with the loop. The first that runs and agrees is used; each that fails is logged and listed
in the findings. A setting given explicitly (``moe.impl=megablocks``, ``moe.torch_kernel=grouped_mm``)
is never silently replaced: if it fails, start-up fails with the finding. On the CPU nothing is
checked (the torch backend is what the tests cover) unless ``check=True`` (the tests do).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from p2p_spes.config import MoEConfig
from p2p_spes.errors import BackendError
from p2p_spes.moe.backend import build_moe, resolve_impl, torch_kernel_label
from p2p_spes.moe.experts import uses_grouped_mm
from p2p_spes.moe.megablocks import megablocks_available
from p2p_spes.moe.torch_backend import TorchMoE

log = logging.getLogger(__name__)

# Largest norm-wise relative error (||a - b|| / ||b||) accepted against the loop, by autocast dtype.
TOLERANCE: dict[torch.dtype | None, float] = {
    None: 1e-4,
    torch.float32: 1e-4,
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
}
SEED = 1234

# (cfg with impl and torch_kernel set, d_model, local experts, device, resident_only) -> one MoE layer
Builder = Callable[[MoEConfig, int, Sequence[int] | None, torch.device, bool], nn.Module]


@dataclass
class BackendChoice:
    """The MoE backend and expert kernel a peer trains with, and how that was decided."""

    impl: str  # "megablocks" or "torch"
    kernel: str  # expert kernel: "grouped_mm" or "loop" (MegaBlocks uses our storage's grouped_mm)
    checked: bool = False  # True when it passed the start-up check on this device
    findings: list[str] = field(default_factory=list)  # candidates that failed, and why

    @property
    def label(self) -> str:
        """``megablocks``, ``torch:grouped_mm`` or ``torch:loop`` (summary and DHT record)."""
        return "megablocks" if self.impl == "megablocks" else f"torch:{self.kernel}"

    def apply(self, cfg: MoEConfig) -> MoEConfig:
        """``cfg`` with this choice made explicit (unchanged when nothing was checked)."""
        if not self.checked:
            return cfg
        if self.impl == "megablocks":
            return replace(cfg, impl="megablocks")
        return replace(cfg, impl="torch", torch_kernel=self.kernel)


@dataclass(frozen=True)
class Candidate:
    """One backend and expert kernel to try."""

    impl: str
    kernel: str

    @property
    def label(self) -> str:
        return BackendChoice(self.impl, self.kernel).label

    def config(self, cfg: MoEConfig) -> MoEConfig:
        if self.impl == "megablocks":
            return replace(cfg, impl="megablocks")
        return replace(cfg, impl="torch", torch_kernel=self.kernel)


def candidates(cfg: MoEConfig, d_model: int, megablocks: bool, resident_only: bool = False) -> list[Candidate]:
    """What may run, best first, as ``cfg`` allows: an explicit setting leaves no fall-back."""
    plan = []
    if cfg.impl == "megablocks" or (cfg.impl == "auto" and megablocks and not resident_only):
        plan.append(Candidate("megablocks", "grouped_mm"))
    if cfg.impl == "megablocks":
        return plan
    grouped_ok = uses_grouped_mm("grouped_mm", d_model, cfg.ffn_dim, torch.float32, on_cuda=True)
    if cfg.torch_kernel == "grouped_mm" or (cfg.torch_kernel == "auto" and grouped_ok):
        plan.append(Candidate("torch", "grouped_mm"))
    if cfg.torch_kernel != "grouped_mm":
        plan.append(Candidate("torch", "loop"))
    return plan


def choose_backend(
    cfg: MoEConfig,
    d_model: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    local_experts: Sequence[int] | None = None,
    resident_only: bool = False,
    check: bool | None = None,
    builders: Mapping[str, Builder] | None = None,
    megablocks: bool | None = None,
) -> BackendChoice:
    """The backend a peer trains with on ``device``, checked there when it is a GPU (or ``check``).

    ``builders`` replaces how a candidate (by label) is built, and ``megablocks`` whether MegaBlocks
    counts as installed: both for tests. Raises :class:`BackendError` when an explicit setting fails
    its check, or when nothing passes.
    """
    if not (device.type == "cuda" if check is None else check):
        impl = resolve_impl(cfg, device, resident_only)
        kernel = "grouped_mm" if impl == "megablocks" else torch_kernel_label(cfg, d_model, device)
        return BackendChoice(impl, kernel)
    have_megablocks = megablocks_available() if megablocks is None else megablocks
    findings = []
    if cfg.impl == "auto" and not have_megablocks and not resident_only:
        findings.append("megablocks: not installed")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # leave the run's RNG alone
        probe = Probe(cfg, d_model, device, autocast_dtype, local_experts, resident_only)
        for cand in candidates(cfg, d_model, have_megablocks, resident_only):
            build = (builders or {}).get(cand.label, build_moe)
            finding = probe.check(cand, build)
            if finding is None:
                log.info("MoE backend %s passed its start-up check on %s", cand.label, device)
                return BackendChoice(cand.impl, cand.kernel, checked=True, findings=findings)
            log.warning("MoE backend %s failed its start-up check on %s: %s", cand.label, device, finding)
            findings.append(f"{cand.label}: {finding}")
    raise BackendError(_failure_message(cfg, device, findings))


def _failure_message(cfg: MoEConfig, device: torch.device, findings: list[str]) -> str:
    found = "; ".join(findings)
    if cfg.impl == "megablocks":
        return (
            f"moe.impl=megablocks failed its start-up check on {device}: {found}. Set moe.impl=auto to fall "
            "back to the torch backend, or moe.impl=torch"
        )
    if cfg.torch_kernel == "grouped_mm":
        return (
            f"moe.torch_kernel=grouped_mm failed its start-up check on {device}: {found}. Set "
            "moe.torch_kernel=auto to fall back to the per-expert loop, or moe.torch_kernel=loop"
        )
    return f"no MoE backend passed its start-up check on {device}: {found}"


def describe(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters (CUDA errors run long)."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``||value - reference|| / ||reference||`` in fp32 (the absolute error when the reference is 0)."""
    diff = float((value.float() - reference.float()).norm())
    scale = float(reference.float().norm())
    return diff / scale if scale > 0 else diff


class Probe:
    """One MoE layer of the run's shapes with fixed weights and input, and the loop's results on it."""

    def __init__(
        self,
        cfg: MoEConfig,
        d_model: int,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
        local_experts: Sequence[int] | None,
        resident_only: bool,
    ) -> None:
        self.cfg, self.d_model, self.device, self.autocast_dtype = cfg, d_model, device, autocast_dtype
        self.local_experts, self.resident_only = local_experts, resident_only
        self.tolerance = TOLERANCE.get(autocast_dtype, TOLERANCE[torch.bfloat16])
        gen = torch.Generator().manual_seed(SEED)
        tokens = min(max(128, 4 * cfg.num_experts), 2048)  # every expert gets a few tokens
        self.x = torch.randn(1, tokens, d_model, generator=gen).to(device)
        self.grad_out = torch.randn(1, tokens, d_model, generator=gen).to(device)
        reference = TorchMoE(
            replace(cfg, impl="torch", torch_kernel="loop"), d_model, local_experts, device, resident_only=resident_only
        )
        with torch.no_grad():
            weight = torch.randn(cfg.num_experts, d_model, generator=gen) / math.sqrt(d_model)
            reference.router.layer.weight.copy_(weight)
            reference.expert_weights.reset_parameters(d_model**-0.5, cfg.ffn_dim**-0.5, generator=gen)
        self.state = reference.state_dict()
        try:
            self.expected = self.run(reference)
        except Exception as exc:  # nothing can be checked without the reference
            raise BackendError(
                f"the per-expert loop (the reference of the MoE check) fails on {device}: {describe(exc)}"
            ) from exc
        finally:
            del reference
            self._free()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _free(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def run(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Outputs, statistics and gradients of one train-mode step and one eval-mode forward."""
        module.train()
        x = self.x.clone().requires_grad_(True)
        with self._autocast():
            out, stats = module(x)
        loss = (out.float() * self.grad_out).sum() + torch.dot(stats.tokens_per_expert, stats.mean_probs)
        (loss + stats.router_z).backward()
        results = {
            "output": out.detach(),
            "tokens_per_expert": stats.tokens_per_expert,
            "mean_probs": stats.mean_probs.detach(),
            "router_z": stats.router_z.detach(),
            "gradient of the input": x.grad,
        }
        for name, param in module.named_parameters():
            if param.grad is not None:
                results[f"gradient of {name}"] = param.grad
        module.eval()
        with torch.no_grad(), self._autocast():
            out, stats = module(self.x)
        results["eval-mode output"] = out
        results["eval-mode tokens_per_expert"] = stats.tokens_per_expert
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # asynchronous CUDA errors surface here, inside the check
        return {k: v.detach().float() for k, v in results.items()}

    def check(self, cand: Candidate, build: Builder) -> str | None:
        """None if ``cand`` runs and agrees with the loop, else what went wrong."""
        cfg = cand.config(self.cfg)
        if (
            cand.kernel == "grouped_mm"
            and cand.impl == "torch"
            and not uses_grouped_mm("grouped_mm", self.d_model, cfg.ffn_dim, torch.float32, on_cuda=True)
        ):
            return "torch._grouped_mm is missing from this torch, or the expert rows are not 16-byte aligned"
        module = None
        try:
            module = build(cfg, self.d_model, self.local_experts, self.device, self.resident_only)
            module.load_state_dict(self.state)
            got = self.run(module)
        except Exception as exc:  # any failure of a candidate is a finding, not a crash
            log.debug("MoE backend %s raised in its start-up check", cand.label, exc_info=True)
            return describe(exc)
        finally:
            del module
            self._free()
        return self.compare(got)

    def compare(self, got: dict[str, torch.Tensor]) -> str | None:
        problems = []
        for key, want in self.expected.items():
            value = got.get(key)
            if value is None:
                problems.append(f"no {key}")
            elif value.shape != want.shape:
                problems.append(f"{key} has shape {tuple(value.shape)}, the loop's {tuple(want.shape)}")
            elif not torch.isfinite(value).all():
                problems.append(f"{key} is not finite")
            else:
                err = relative_error(value, want)
                if not err <= self.tolerance:
                    problems.append(
                        f"{key} differs from the per-expert loop (relative error {err:.3g} > {self.tolerance:g})"
                    )
        return "; ".join(problems) or None
