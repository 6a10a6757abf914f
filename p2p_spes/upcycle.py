"""Sparse upcycling: start our MoE from a dense Hugging Face model of the same width.

Attention, norms, embeddings and the output head are copied; the dense SwiGLU MLP
(gate/up/down) is copied into every expert (w1 <- gate_proj, v1 <- up_proj, w2 <- down_proj^T),
optionally with Gaussian noise of std ``noise_std`` on a random ``noise_fraction`` of each
expert's entries (a different draw per expert) so that experts can diverge; the router starts
at zeros (uniform routing) or normal(0, ``model.init_std``).

When the upcycled MoE computes exactly the dense model: with noise 0, every expert equals the
dense MLP, so the layer outputs (sum of the top-k weights) x MLP(x). That sum is 1 only with
``moe.normalize_top_k=true``; without it a zeros router gives each of the k chosen experts 1/E
and the MLP is scaled by k/E (a normal router: by whatever top-k mass it assigns). Use
``moe.normalize_top_k=true`` to start exactly from the dense model's function.

Supported dense families (their function is one our model reproduces exactly):
Qwen3 (q/k RMSNorm per head -> ``model.qk_norm=per_head``) and Llama / Mistral without sliding
window (no q/k-norm -> ``model.qk_norm=none``). Grouped-query attention is expanded by repeating
each key/value head for the query heads that share it, which keeps the function. Tied input
and output embeddings are untied by copying. The output is a checkpoint directory that
``train.init_from`` (or :meth:`p2p_spes.train.Trainer.load_initial_weights`) starts a run from.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open

from p2p_spes.checkpoint import save_checkpoint
from p2p_spes.config import Config
from p2p_spes.errors import CheckpointError, ConfigError
from p2p_spes.model import MoETransformer

QK_NORM_OF = {"qwen3": "per_head", "llama": "none", "mistral": "none"}


class DenseCheckpoint:
    """A local Hugging Face dense model directory: its config, and safetensors read tensor by tensor."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"{self.path} is not a Hugging Face model directory (no config.json)")
        self.config: dict[str, Any] = json.loads(config_file.read_text())
        self._files: dict[str, Path] | None = None

    @property
    def files(self) -> dict[str, Path]:
        """Tensor name -> safetensors file, from the index of a sharded model or the single file."""
        if self._files is None:
            index = self.path / "model.safetensors.index.json"
            single = self.path / "model.safetensors"
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                self._files = {name: self.path / file for name, file in weight_map.items()}
            elif single.is_file():
                try:
                    with safe_open(str(single), framework="pt") as f:
                        names = f.keys()
                except SafetensorError as exc:
                    raise CheckpointError(f"{single} is not a readable safetensors file ({exc})") from None
                self._files = {name: single for name in names}
            else:
                raise CheckpointError(
                    f"{self.path} has no model.safetensors (or index); only safetensors weights are read, never "
                    "pickled .bin files: re-save the model with save_pretrained(..., safe_serialization=True)"
                )
        return self._files

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Tensor ``name`` as fp32, checked against the expected shape."""
        if name not in self.files:
            raise CheckpointError(f"{self.path}: tensor {name} is missing")
        with safe_open(str(self.files[name]), framework="pt") as f:
            tensor = f.get_tensor(name)
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"{self.path}: {name} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor.float()


def _rope(hf: dict[str, Any]) -> tuple[str, float | None]:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = params.get("rope_theta", hf.get("rope_theta"))
    return rope_type, theta


def check_compatible(hf: dict[str, Any], cfg: Config) -> None:
    """Refuse a dense model whose function our MoE cannot reproduce, naming each fix."""
    model_type = hf.get("model_type")
    if model_type not in QK_NORM_OF:
        raise ConfigError(
            f"dense model_type {model_type!r} is not supported for upcycling; supported: "
            f"{', '.join(sorted(QK_NORM_OF))} (pre-norm SwiGLU decoders our model reproduces exactly)"
        )
    m, moe = cfg.model, cfg.moe
    heads = hf.get("num_attention_heads")
    head_dim = hf.get("head_dim") or (hf["hidden_size"] // heads)
    rope_type, theta = _rope(hf)
    problems = []

    def need(ok: bool, text: str) -> None:
        if not ok:
            problems.append(text)

    need(
        hf.get("hidden_size") == m.d_model,
        f"hidden_size {hf.get('hidden_size')}: --set model.d_model={hf.get('hidden_size')}",
    )
    need(heads == m.num_heads, f"num_attention_heads {heads}: --set model.num_heads={heads}")
    need(
        head_dim * heads == hf.get("hidden_size"),
        f"head_dim {head_dim} x {heads} heads != hidden_size {hf.get('hidden_size')} "
        "(our model needs d_model = heads x head_dim)",
    )
    need(
        hf.get("num_hidden_layers") == m.num_layers,
        f"num_hidden_layers {hf.get('num_hidden_layers')}: --set model.num_layers={hf.get('num_hidden_layers')}",
    )
    need(
        hf.get("vocab_size") == m.vocab_size,
        f"vocab_size {hf.get('vocab_size')}: --set model.vocab_size={hf.get('vocab_size')}",
    )
    need(
        hf.get("intermediate_size") == moe.ffn_dim,
        f"intermediate_size {hf.get('intermediate_size')}: --set moe.ffn_dim={hf.get('intermediate_size')}",
    )
    eps = hf.get("rms_norm_eps")
    need(
        eps is not None and math.isclose(eps, m.norm_eps, rel_tol=1e-9),
        f"rms_norm_eps {eps}: --set model.norm_eps={eps}",
    )
    need(rope_type == "default", f"rope type {rope_type!r}: only plain rotary positions are supported")
    need(
        theta is not None and math.isclose(float(theta), m.rope_theta, rel_tol=1e-9),
        f"rope_theta {theta}: --set model.rope_theta={theta}",
    )
    qk = QK_NORM_OF[model_type]
    need(m.qk_norm == qk, f"{model_type} q/k-norm is {qk!r}: --set model.qk_norm={qk}")
    need(
        hf.get("hidden_act", "silu") == "silu", f"hidden_act {hf.get('hidden_act')!r}: only silu (SwiGLU) is supported"
    )
    need(not hf.get("attention_bias") and not hf.get("mlp_bias"), "attention or MLP biases: our model has none")
    kv = hf.get("num_key_value_heads") or heads
    need(heads % kv == 0, f"num_key_value_heads {kv} does not divide num_attention_heads {heads}")
    sliding = hf.get("use_sliding_window", model_type == "mistral") and hf.get("sliding_window")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    need(
        not sliding and layer_types == {"full_attention"},
        "sliding-window attention: our model attends to the full context",
    )
    if problems:
        raise ConfigError(f"the dense {model_type} model does not fit the MoE config; change: " + "; ".join(problems))


def _noisy(weight: torch.Tensor, std: float, fraction: float, gen: torch.Generator) -> torch.Tensor:
    if std == 0 or fraction == 0:
        return weight.clone()
    mask = torch.rand(weight.shape, generator=gen) < fraction
    return weight + mask * torch.randn(weight.shape, generator=gen) * std


def _expand_kv(weight: torch.Tensor, kv_heads: int, heads: int, head_dim: int) -> torch.Tensor:
    """Repeat each key/value head for the query heads that share it (grouped-query attention)."""
    if kv_heads == heads:
        return weight
    return weight.view(kv_heads, head_dim, -1).repeat_interleave(heads // kv_heads, dim=0).reshape(heads * head_dim, -1)


def upcycled_state_dict(
    dense: DenseCheckpoint,
    cfg: Config,
    noise_std: float = 0.0,
    noise_fraction: float = 0.5,
    router_init: Literal["zeros", "normal"] = "zeros",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Our MoE's state dict (all experts) built from the dense weights."""
    m, moe = cfg.model, cfg.moe
    d, ffn, num_experts = m.d_model, moe.ffn_dim, moe.num_experts
    hf = dense.config
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    head_dim = d // heads
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {"embed_tokens.weight": dense.get("model.embed_tokens.weight", (m.vocab_size, d))}
    for i in range(m.num_layers):
        src, dst = f"model.layers.{i}", f"layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{dst}.{norm}.weight"] = dense.get(f"{src}.{norm}.weight", (d,))
        out[f"{dst}.self_attn.q_proj.weight"] = dense.get(f"{src}.self_attn.q_proj.weight", (d, d))
        out[f"{dst}.self_attn.o_proj.weight"] = dense.get(f"{src}.self_attn.o_proj.weight", (d, d))
        for proj in ("k_proj", "v_proj"):
            weight = dense.get(f"{src}.self_attn.{proj}.weight", (kv * head_dim, d))
            out[f"{dst}.self_attn.{proj}.weight"] = _expand_kv(weight, kv, heads, head_dim)
        if m.qk_norm == "per_head":
            for norm in ("q_norm", "k_norm"):
                out[f"{dst}.self_attn.{norm}.weight"] = dense.get(f"{src}.self_attn.{norm}.weight", (head_dim,))
        if router_init == "zeros":
            router = torch.zeros(num_experts, d)
        else:
            router = torch.randn(num_experts, d, generator=gen) * m.init_std
        out[f"{dst}.mlp.router.layer.weight"] = router
        dense_mlp = {
            "w1": dense.get(f"{src}.mlp.gate_proj.weight", (ffn, d)),
            "v1": dense.get(f"{src}.mlp.up_proj.weight", (ffn, d)),
            "w2": dense.get(f"{src}.mlp.down_proj.weight", (d, ffn)).t().contiguous(),
        }
        for name, weight in dense_mlp.items():
            experts = [_noisy(weight, noise_std, noise_fraction, gen) for _ in range(num_experts)]
            out[f"{dst}.mlp.experts.mlp.{name}"] = torch.cat(experts)
    out["norm.weight"] = dense.get("model.norm.weight", (d,))
    if dense.has("lm_head.weight"):
        out["lm_head.weight"] = dense.get("lm_head.weight", (m.vocab_size, d))
    elif hf.get("tie_word_embeddings", False):
        out["lm_head.weight"] = out["embed_tokens.weight"].clone()
    else:
        raise CheckpointError(f"{dense.path}: lm_head.weight is missing and the embeddings are not tied")
    return out


def upcycle(
    dense_dir: str | Path,
    cfg: Config,
    out_dir: str | Path,
    noise_std: float = 0.0,
    noise_fraction: float = 0.5,
    router_init: Literal["zeros", "normal"] = "zeros",
    seed: int = 0,
) -> Path:
    """Write ``out_dir/checkpoints/step_00000000`` holding the upcycled MoE; return its path.

    Start training from it with ``--set train.init_from=OUT_DIR`` and the same model/moe config.
    """
    if router_init not in ("zeros", "normal"):
        raise ConfigError(f"router_init must be 'zeros' or 'normal', got {router_init!r}")
    if noise_std < 0 or not 0 <= noise_fraction <= 1:
        raise ConfigError(f"noise_std must be >= 0 and noise_fraction in [0, 1], got {noise_std} and {noise_fraction}")
    dense = DenseCheckpoint(dense_dir)
    check_compatible(dense.config, cfg)
    state = upcycled_state_dict(dense, cfg, noise_std, noise_fraction, router_init, seed)
    model = MoETransformer(cfg.model, cfg.moe, device="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"upcycled weights do not fit the model (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    trainer_state = {
        "tokens": 0,
        "model_fingerprint": cfg.model_fingerprint(),
        "local_experts": list(range(cfg.moe.num_experts)),
        "config": cfg.to_dict(),
        "val_loss": None,
        "initial_weights_only": True,
        "upcycled_from": {
            "dense": str(Path(dense_dir).resolve()),
            "model_type": dense.config.get("model_type"),
            "noise_std": noise_std,
            "noise_fraction": noise_fraction,
            "router_init": router_init,
            "seed": seed,
        },
    }
    return save_checkpoint(out_dir, 0, model, None, trainer_state, keep=1)
