"""The optimizer over the trainable parameters only (AdamW, or Muon with AdamW), and the cosine
schedule with linear warmup."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.adam import adam as adam_update

from p2p_spes.config import TrainConfig


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Shared parameters and local experts; frozen experts are buffers and never appear here."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def parameter_groups(model: nn.Module, cfg: TrainConfig) -> list[dict]:
    """Weight decay on matrices, none on norm weights."""
    params = trainable_parameters(model)
    decay = [p for _, p in params if p.ndim >= 2]
    no_decay = [p for _, p in params if p.ndim < 2]
    return [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


# the ``train.optimizer`` values that step with MuonAdamW; muon_attention leaves the experts to AdamW
MUON_OPTIMIZERS = ("muon", "muon_attention")


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, *, ns_steps: int | None = None, muon_experts: bool | None = None
) -> torch.optim.Optimizer:
    """``train.optimizer``: AdamW with weight decay on matrices and none on norm weights, or
    :class:`MuonAdamW` (Muon on the hidden matrices, the same AdamW on the rest; ``muon_attention``:
    Muon on the attention matrices only). ``ns_steps`` and ``muon_experts`` override
    ``train.muon_ns_steps`` and whether the experts take Muon (benchmarks compare them)."""
    if cfg.optimizer in MUON_OPTIMIZERS:
        experts = cfg.optimizer == "muon" if muon_experts is None else muon_experts
        return MuonAdamW(
            muon_parameter_groups(model, cfg, experts=experts),
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            adamw_lr_scale=cfg.muon_adamw_lr_scale,
            ns_steps=cfg.muon_ns_steps if ns_steps is None else ns_steps,
        )
    return torch.optim.AdamW(parameter_groups(model, cfg), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def optimizer_moments(name: str, param: nn.Parameter, cfg: TrainConfig) -> int:
    """fp32 tensors the optimizer keeps for ``param``: AdamW two moments, Muon one momentum."""
    muon = cfg.optimizer == "muon" or (cfg.optimizer == "muon_attention" and not is_expert(name))
    return 1 if muon and is_hidden_matrix(name, param) else 2


def is_hidden_matrix(name: str, param: nn.Parameter) -> bool:
    """A matrix inside the network (attention projections, experts): what Muon steps. Embeddings, the
    output head and the router stay on AdamW, as Muon's authors keep them."""
    return param.ndim >= 2 and not any(k in name for k in ("embed_tokens", "lm_head", "router"))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at ``max_steps``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.max_steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


# Newton-Schulz quintic coefficients (Keller Jordan's, from Muon's reference): a steep slope at zero,
# so 5 steps bring every singular value above about 1e-3 of the Frobenius norm into roughly [0.7, 1.2],
# which is all the update needs. Each step costs a Gram matrix, its square and one product with the
# matrix: ``4 m^2 n + 2 m^3`` FLOPs for an m x n matrix (m <= n).
_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# (device, matrix shape) whose bf16 iteration failed MuonAdamW.self_check in this process: fp32 there
_BF16_REFUSED: set[tuple[str, tuple[int, ...]]] = set()


def ns_flops(shape: tuple[int, ...], steps: int) -> int:
    """Matmul FLOPs of :func:`orthogonalize` with ``steps`` iterations on a tensor of ``shape`` (a stack
    of matrices counts each): what the optimizer adds to a step, whatever the batch."""
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * steps * (4 * m * m * n + 2 * m**3)


def orthogonalize(update: torch.Tensor, bf16: bool = False, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Each matrix of ``update`` (its last two dimensions; a stack of experts is a batch) with its
    singular values pushed towards 1 by a Newton-Schulz iteration: Muon's step direction. ``bf16`` is
    how torch's and Muon's reference implementations run it on a GPU (the iteration tolerates it and
    the matmuls are the optimizer's whole cost); fp32 otherwise.

    Fewer ``steps`` (``MuonAdamW(ns_steps=...)``) keep Jordan's coefficients: with 3 they still bring
    singular values above about 1.5e-2 of the norm into the band and leave the smaller ones short of
    it. The published sets tuned for few steps were weighed and not taken: Polar Express's
    per-iteration coefficients (Amsel et al., arXiv 2505.16932, Algorithm 1) are greedy minimax steps
    for singular values down to 1e-3, optimal at every depth but centred on 1 only from about 5 steps
    on (their first 3 map [1e-3, 1] to [0.13, 1.87]); You Jiacheng's set has 6 steps. Either way the
    iteration's cost falls only with its steps, and ``benchmarks/step_time.py`` shows that at the
    main job's 1,024 tokens a step the experts' share of it matters more than the steps."""
    a, b, c = _NS_COEFFICIENTS
    x = update.bfloat16() if bf16 else update.float()
    wide = x.shape[-2] <= x.shape[-1]
    if not wide:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x if wide else x.mT).to(update.dtype)


def bf16_error(shape: tuple[int, ...], device: torch.device) -> float:
    """Relative distance of the bf16 iteration from fp32's on ``device``, for a random matrix of
    ``shape`` (about 0.03 where bf16 matmuls are right)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(device)
    low, ref = orthogonalize(x, bf16=True).float(), orthogonalize(x)
    return float((low - ref).norm() / ref.norm())


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the hidden matrices (groups with ``muon=True``), AdamW on everything else.

    Muon steps along the Nesterov momentum with its singular values set to about 1, at AdamW's
    learning rate and weight decay rescaled to AdamW's update size (``0.2 sqrt(max(rows, cols))``,
    Moonlight's rule), so one schedule serves both. Why here: MuLoCo (arXiv 2505.23725) finds Muon's
    normalized steps give pseudo-gradients that average better across workers than AdamW's. torch's
    own ``Muon`` takes 2-D parameters only; a peer's local experts are one 3-D stack, so the iteration
    runs batched over experts. ``ns_steps``: the Newton-Schulz iterations (:func:`orthogonalize`).
    AdamW groups go through torch's functional Adam with the same state
    names (``exp_avg``, ``exp_avg_sq``, ``step``) as ``torch.optim.AdamW``.
    """

    def __init__(
        self,
        groups: list[dict],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        momentum: float = 0.95,
        update_rms: float = 0.2,
        adamw_lr_scale: float = 1.0,
        ns_steps: int = 5,
    ) -> None:
        super().__init__(
            groups,
            {
                "lr": lr,
                "betas": betas,
                "eps": eps,
                "weight_decay": 0.0,
                "muon": False,
                "momentum": momentum,
                "update_rms": update_rms,
                "adamw_lr_scale": adamw_lr_scale,
                "ns_steps": ns_steps,
            },
        )

    def matrix_shapes(self) -> dict[tuple[int, ...], torch.device]:
        """The distinct matrix shapes Muon steps (an expert stack counts as its experts' matrix), and
        the device of each."""
        return {tuple(p.shape[-2:]): p.device for g in self.param_groups if g["muon"] for p in g["params"]}

    def self_check(self) -> list[str]:
        """On a GPU, the bf16 iteration against fp32 on the same device for each Muon matrix's shape:
        the findings of the shapes where they disagree (relative error above 0.1, or not finite), which
        from then on run in fp32 on that device, in this optimizer and in any rebuilt later (a resume, a
        takeover). Nothing to check off a GPU (fp32 there)."""
        findings = []
        for shape, device in sorted(self.matrix_shapes().items()):
            if device.type != "cuda":
                continue
            error = bf16_error(shape, device)
            if not math.isfinite(error) or error > 0.1:
                _BF16_REFUSED.add((str(device), shape))
                findings.append(
                    f"Muon's bf16 Newton-Schulz on {device} for a {shape[0]}x{shape[1]} matrix is "
                    f"{error:.3g} away from fp32 (relative); using fp32"
                )
        return findings

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                self._muon(group, params)
            elif params:
                self._adamw(group, params)
        return loss

    def _muon(self, group: dict, params: list[torch.Tensor]) -> None:
        lr, mu = group["lr"], group["momentum"]
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - mu)
            bf16 = p.is_cuda and (str(p.device), tuple(p.shape[-2:])) not in _BF16_REFUSED
            direction = orthogonalize(p.grad.lerp(buf, mu), bf16=bf16, steps=group["ns_steps"])
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(direction, alpha=-lr * group["update_rms"] * math.sqrt(max(p.shape[-2:])))

    def _adamw(self, group: dict, params: list[torch.Tensor]) -> None:
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam_update(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            foreach=False,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"] * group["adamw_lr_scale"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


ADAMW_STATE = frozenset({"step", "exp_avg", "exp_avg_sq"})
MUON_STATE = frozenset({"momentum_buffer"})


def state_names(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> frozenset[str] | None:
    """The state ``optimizer`` keeps for ``param`` (None: an optimizer :func:`build_optimizer` does not
    make), so that a checkpoint of another ``train.optimizer`` is refused instead of half-loaded."""
    if isinstance(optimizer, MuonAdamW):
        muon = any(g["muon"] and any(p is param for p in g["params"]) for g in optimizer.param_groups)
        return MUON_STATE if muon else ADAMW_STATE
    return ADAMW_STATE if isinstance(optimizer, torch.optim.AdamW) else None


def is_expert(name: str) -> bool:
    """An expert stack (``...mlp.experts.mlp.local_w1``): a matrix that sees only top-k/E of the tokens."""
    return ".experts." in name


def muon_parameter_groups(model: nn.Module, cfg: TrainConfig, experts: bool = True) -> list[dict]:
    """Muon for the hidden matrices (:func:`is_hidden_matrix`); AdamW for the other matrices with
    weight decay and for norm weights without. ``experts=False``: the expert stacks on AdamW at the
    plain ``lr`` (not ``muon_adamw_lr_scale`` times it), as ``train.optimizer=adamw`` steps them."""
    params = trainable_parameters(model)
    muon = [(n, p) for n, p in params if is_hidden_matrix(n, p) and (experts or not is_expert(n))]
    taken = {id(p) for _, p in muon}
    own = [p for n, p in params if id(p) not in taken and is_hidden_matrix(n, p)]
    other = [p for n, p in params if not is_hidden_matrix(n, p)]
    groups = [
        {"params": [p for _, p in muon], "weight_decay": cfg.weight_decay, "muon": True},
        {"params": [p for p in other if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in other if p.ndim < 2], "weight_decay": 0.0},
    ]
    if own:
        groups.append({"params": own, "weight_decay": cfg.weight_decay, "adamw_lr_scale": 1.0})
    return groups
