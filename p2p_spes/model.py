"""The OLMoE-family decoder: pre-norm blocks of q/k-normed rotary attention and an MoE layer.

Parameter names follow Hugging Face's ``OlmoeForCausalLM`` where they can (``layers.{i}.self_attn.q_proj``)
and MegaBlocks' inside the MoE (``layers.{i}.mlp.router.layer``, ``layers.{i}.mlp.experts.mlp.w1``), so
export is a renaming and the two MoE backends load each other's checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from p2p_spes.config import ModelConfig, MoEConfig
from p2p_spes.moe import RouterStats, build_moe


class RMSNorm(nn.Module):
    """RMSNorm with weight, computed in fp32 (as OLMoE) and cast back."""

    def __init__(self, dim: int, eps: float, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_tables(head_dim: int, seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotation (Hugging Face's ``rotate_half`` convention); x is (B, heads, T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        d = cfg.d_model
        self.q_proj = nn.Linear(d, d, bias=False, device=device)
        self.k_proj = nn.Linear(d, d, bias=False, device=device)
        self.v_proj = nn.Linear(d, d, bias=False, device=device)
        self.o_proj = nn.Linear(d, d, bias=False, device=device)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm != "none":
            width = d if cfg.qk_norm == "full" else cfg.head_dim
            self.q_norm = RMSNorm(width, cfg.norm_eps, device=device)
            self.k_norm = RMSNorm(width, cfg.norm_eps, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.view(b, t, self.num_heads, self.head_dim) for z in (q, k, v))
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(
        self, cfg: ModelConfig, moe_cfg: MoEConfig, local_experts, device, resident_only: bool = False
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps, device=device)
        self.self_attn = Attention(cfg, device=device)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps, device=device)
        self.mlp = build_moe(moe_cfg, cfg.d_model, local_experts, device=device, resident_only=resident_only)

    def forward(self, x, cos, sin) -> tuple[torch.Tensor, RouterStats]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        y, stats = self.mlp(self.post_attention_layernorm(x))
        return x + y, stats


@dataclass
class LossOutput:
    """The training loss and each of its terms (already weighted), for logging."""

    loss: torch.Tensor
    ce: torch.Tensor
    z_loss: torch.Tensor
    lb_loss: torch.Tensor
    router_z_loss: torch.Tensor

    def as_floats(self) -> dict[str, float]:
        return {k: float(getattr(self, k).detach()) for k in ("loss", "ce", "z_loss", "lb_loss", "router_z_loss")}


@torch.no_grad()
def copy_into(targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """Copy received ``values`` into the model's ``targets`` one by one (device and dtype of the target)."""
    if len(targets) != len(values):
        raise ValueError(f"got {len(values)} tensors for {len(targets)} targets")
    for target, value in zip(targets, values):
        target.copy_(value.to(target.device).view_as(target))


class MoETransformer(nn.Module):
    """Decoder-only MoE language model with untied embeddings and no biases."""

    def __init__(
        self,
        cfg: ModelConfig,
        moe_cfg: MoEConfig,
        local_experts: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        resident_only: bool = False,
    ) -> None:
        """``resident_only``: partial residency, only ``local_experts`` have weights (see moe/experts.py)."""
        super().__init__()
        self.cfg, self.moe_cfg = cfg, moe_cfg
        self.resident_only = resident_only
        self.skip_rates: list[float] = []  # per layer, from the last forward
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, device=device)
        self.layers = nn.ModuleList(
            Block(cfg, moe_cfg, local_experts, device, resident_only) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, device=device)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device=device)
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Scales the load-balance counts of each expert (the SPES "decayed LB loss" option).
        self.register_buffer("lb_count_scale", torch.ones(moe_cfg.num_experts, device=device), persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Seeded init that does not depend on which experts are local (all peers agree)."""
        gen = torch.Generator().manual_seed(seed)
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.num_layers)

        def normal_(t: torch.Tensor, s: float) -> None:
            t.copy_(torch.nn.init.trunc_normal_(torch.empty(t.shape), std=s, a=-3 * s, b=3 * s, generator=gen))

        normal_(self.embed_tokens.weight, std)
        for layer in self.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                normal_(proj.weight, std)
            normal_(attn.o_proj.weight, out_std)
            normal_(layer.mlp.router.layer.weight, std)
            layer.mlp.expert_weights.reset_parameters(std, out_std, generator=gen)
        normal_(self.lm_head.weight, std)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def expert_modules(self):
        """The per-layer expert stores, in layer order."""
        return [layer.mlp.expert_weights for layer in self.layers]

    def set_local_experts(self, local: Sequence[int]) -> None:
        for experts in self.expert_modules():
            experts.set_local_experts(local)

    @property
    def local_experts(self) -> list[int]:
        return list(self.expert_modules()[0].local_ids)

    def held_experts(self) -> list[int]:
        """The experts with weights in memory here: all of them, or only the local ones in partial residency."""
        return self.expert_modules()[0].resident_ids

    def shared_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Every parameter that is not an expert's (attention, norms, routers, embeddings), in order."""
        return [(n, p) for n, p in self.named_parameters() if ".experts." not in n]

    def expert_tensors(self, expert: int) -> list[torch.Tensor]:
        """Expert ``expert``'s w1, v1, w2 of every layer: views into the storage, so writing them writes
        the model (the expert must be held here)."""
        out = []
        for store in self.expert_modules():
            if expert in store.local_ids:
                slot, group = store.local_ids.index(expert), "local"
            else:
                slot, group = store.frozen_ids.index(expert), "frozen"
            out += [getattr(store, f"{group}_{m}")[slot] for m in ("w1", "v1", "w2")]
        return out

    def write_expert(self, expert: int, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite expert ``expert`` in place with received tensors (as :meth:`expert_tensors` orders them)."""
        copy_into(self.expert_tensors(expert), tensors)

    def write_shared(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite the shared parameters in place (as :meth:`shared_parameters` orders them)."""
        copy_into([p for _, p in self.shared_parameters()], tensors)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, list[RouterStats]]:
        t = idx.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        x = self.embed_tokens(idx)
        cos, sin = self.rope_cos[:t].to(x.dtype), self.rope_sin[:t].to(x.dtype)
        all_stats = []
        for layer in self.layers:
            x, stats = layer(x, cos, sin)
            all_stats.append(stats)
        self.skip_rates = [s.skip_rate for s in all_stats]
        return self.lm_head(self.norm(x)), all_stats

    def loss(self, idx: torch.Tensor, targets: torch.Tensor, z_loss_weight: float = 1e-5) -> LossOutput:
        """Cross-entropy + output z-loss + load-balance loss + router z-loss (docs/method.md formulas)."""
        logits, stats = self(idx)
        logits = logits.float().reshape(-1, logits.shape[-1])
        ce = F.cross_entropy(logits, targets.reshape(-1))
        z_loss = z_loss_weight * torch.logsumexp(logits, dim=-1).pow(2).mean()
        lb, rz = auxiliary_losses(stats, self.moe_cfg, self.lb_count_scale)
        return LossOutput(loss=ce + z_loss + lb + rz, ce=ce, z_loss=z_loss, lb_loss=lb, router_z_loss=rz)


def auxiliary_losses(
    stats: list[RouterStats], cfg: MoEConfig, count_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """MegaBlocks' load-balance and router z-losses, summed over layers and weighted.

    lb = w * E / (L * T * k) * sum_l sum_e count[l, e] * mean_t p[l, t, e]
    router_z = w_z * sum_l mean_t logsumexp(logits[l, t])^2
    """
    num_layers, num_tokens = len(stats), stats[0].num_tokens
    scale = cfg.lb_loss_weight * cfg.num_experts / (num_layers * num_tokens * cfg.top_k)
    lb = sum(torch.dot(s.tokens_per_expert * (1 if count_scale is None else count_scale), s.mean_probs) for s in stats)
    rz = sum(s.router_z for s in stats)
    return scale * lb, cfg.router_z_loss_weight * rz
