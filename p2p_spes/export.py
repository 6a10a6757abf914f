"""Export a p2p-spes checkpoint as a Hugging Face ``OlmoeForCausalLM`` directory.

The exported model computes the same function as ours (same logits up to float rounding), so
lm-evaluation-harness, ``generate()`` and any other Hugging Face tooling see the trained model.

Weight layout. Transformers 5.x keeps OLMoE experts fused in memory
(``mlp.experts.gate_up_proj`` of shape (E, 2F, H), gate rows first, and ``mlp.experts.down_proj``
of shape (E, H, F)), but its ``save_pretrained`` writes, and its ``from_pretrained`` loads
without missing or unexpected keys, the original per-expert layout
(``mlp.experts.{e}.gate_proj.weight`` (F, H), ``up_proj`` (F, H), ``down_proj`` (H, F)), fusing
on load through its checkpoint conversion mapping (olmoe -> qwen2_moe rules). We write that
per-expert layout: it is what the published OLMoE checkpoints use and it loads in transformers
4.x as well. Expert e of ours maps as w1 -> gate_proj, v1 -> up_proj, w2^T -> down_proj; the
router ``mlp.router.layer`` becomes ``mlp.gate``.

What OLMoE cannot express is refused (:func:`check_exportable`): q/k-norm per head or none
(OLMoE normalises the whole q and k projections). ``moe.normalize_top_k`` maps to OLMoE's
``norm_topk_prob``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from p2p_spes.checkpoint import STATE, WEIGHTS, find_checkpoint, read_state
from p2p_spes.config import Config, load_config
from p2p_spes.corpus import embedded_tokenizer_path
from p2p_spes.errors import CheckpointError, ConfigError
from p2p_spes.run_data import manifest_tokenizer

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
PROVENANCE = "p2p_spes_export.json"
DEFAULT_SHARD_BYTES = 4 << 30
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def resolve_checkpoint(checkpoint: str | Path) -> Path:
    """A checkpoint directory, or the newest checkpoint of a run directory."""
    path = find_checkpoint(checkpoint)
    if path is None:
        raise CheckpointError(
            f"{checkpoint}: no checkpoint found; pass a run directory or a checkpoints/step_* directory "
            "written by `p2p-spes train` (or `p2p-spes upcycle`)"
        )
    return path


def checkpoint_config(state: dict[str, Any], path: Path) -> Config:
    """The run configuration stored in a checkpoint's trainer state."""
    if "config" not in state:
        raise CheckpointError(f"{path / STATE} has no 'config'; it was not written by this version of p2p-spes")
    try:
        return load_config(None, data=state["config"])
    except ConfigError as exc:
        raise CheckpointError(f"{path / STATE}: its stored config is not valid here ({exc})") from None


def check_exportable(cfg: Config) -> None:
    """Refuse a model that OLMoE would compute differently, naming the option to change."""
    if cfg.model.qk_norm != "full":
        raise ConfigError(
            f"model.qk_norm={cfg.model.qk_norm!r} cannot be exported to OlmoeForCausalLM: OLMoE applies one "
            "RMSNorm over the whole q and k projections (model.qk_norm=full). Train with model.qk_norm=full "
            "to export to OLMoE"
        )


def olmoe_config(cfg: Config, eos_token_id: int | None, pad_token_id: int | None, bos_token_id: int | None):
    """The ``OlmoeConfig`` equivalent to our model and MoE settings."""
    from transformers import OlmoeConfig

    m, moe = cfg.model, cfg.moe
    return OlmoeConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        intermediate_size=moe.ffn_dim,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_heads,
        hidden_act="silu",
        max_position_embeddings=m.max_seq_len,
        initializer_range=m.init_std,
        rms_norm_eps=m.norm_eps,
        use_cache=True,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rope_theta)},
        attention_bias=False,
        attention_dropout=0.0,
        clip_qkv=None,
        num_experts_per_tok=moe.top_k,
        num_experts=moe.num_experts,
        output_router_logits=False,
        router_aux_loss_coef=moe.lb_loss_weight,
        norm_topk_prob=moe.normalize_top_k,
        architectures=["OlmoeForCausalLM"],
    )


def hf_tensors(weights_file: Path, cfg: Config) -> Iterator[tuple[str, torch.Tensor]]:
    """Our checkpoint's tensors renamed (and experts split) into OLMoE's per-expert layout."""
    m, moe = cfg.model, cfg.moe
    num_experts, ffn = moe.num_experts, moe.ffn_dim
    with safe_open(str(weights_file), framework="pt") as f:
        names = set(f.keys())
        used: set[str] = set()

        def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in names:
                raise CheckpointError(
                    f"{weights_file}: tensor {name} is missing; the checkpoint does not match its config"
                )
            tensor = f.get_tensor(name)
            if tuple(tensor.shape) != shape:
                raise CheckpointError(
                    f"{weights_file}: {name} has shape {tuple(tensor.shape)}, its config implies {shape}"
                )
            used.add(name)
            return tensor

        d, vocab = m.d_model, m.vocab_size
        yield "model.embed_tokens.weight", take("embed_tokens.weight", (vocab, d))
        for i in range(m.num_layers):
            src, dst = f"layers.{i}", f"model.layers.{i}"
            for norm in ("input_layernorm", "post_attention_layernorm"):
                yield f"{dst}.{norm}.weight", take(f"{src}.{norm}.weight", (d,))
            for proj in _ATTENTION:
                yield f"{dst}.self_attn.{proj}.weight", take(f"{src}.self_attn.{proj}.weight", (d, d))
            for norm in ("q_norm", "k_norm"):
                yield f"{dst}.self_attn.{norm}.weight", take(f"{src}.self_attn.{norm}.weight", (d,))
            yield f"{dst}.mlp.gate.weight", take(f"{src}.mlp.router.layer.weight", (num_experts, d))
            experts = {
                name: take(f"{src}.mlp.experts.mlp.{name}", (num_experts * ffn, d)).view(num_experts, ffn, d)
                for name in ("w1", "v1", "w2")
            }
            for e in range(num_experts):
                prefix = f"{dst}.mlp.experts.{e}"
                yield f"{prefix}.gate_proj.weight", experts["w1"][e].clone()
                yield f"{prefix}.up_proj.weight", experts["v1"][e].clone()
                yield f"{prefix}.down_proj.weight", experts["w2"][e].t().contiguous()
        yield "model.norm.weight", take("norm.weight", (d,))
        yield "lm_head.weight", take("lm_head.weight", (vocab, d))
        extra = sorted(names - used)
        if extra:
            raise CheckpointError(
                f"{weights_file}: tensors {extra[:5]} have no OLMoE counterpart; export would drop them"
            )


def write_safetensors(tensors: Iterator[tuple[str, torch.Tensor]], out_dir: Path, shard_bytes: int) -> list[Path]:
    """Write ``model.safetensors``, or shards plus an index once the tensors exceed ``shard_bytes``.

    Shards are written as they fill, so memory stays near one shard even for a large model.
    """
    files: list[Path] = []
    weight_map: dict[str, int] = {}
    shard: dict[str, torch.Tensor] = {}
    size = total = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > shard_bytes:
            files.append(out_dir / f".shard-{len(files)}.safetensors")
            save_file(shard, str(files[-1]), metadata={"format": "pt"})
            shard, size = {}, 0
        shard[name] = tensor
        weight_map[name] = len(files)
        size += nbytes
        total += nbytes
    if not files:
        save_file(shard, str(out_dir / HF_WEIGHTS), metadata={"format": "pt"})
        return [out_dir / HF_WEIGHTS]
    files.append(out_dir / f".shard-{len(files)}.safetensors")
    save_file(shard, str(files[-1]), metadata={"format": "pt"})
    names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    for path, name in zip(files, names):
        path.rename(out_dir / name)
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in sorted(weight_map.items())}}
    (out_dir / HF_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [out_dir / name for name in names]


def resolve_tokenizer(cfg: Config, tokenizer: str | Path | None, data_fingerprint: str | None = None) -> Path:
    """The tokenizer given, else the run's (``data.tokenizer``, else the copy a data.manifest run
    fetched with its data ``data_fingerprint``), else the embedded one."""
    if tokenizer is None and cfg.data.tokenizer is None and cfg.data.manifest is not None:
        found = manifest_tokenizer(cfg, data_fingerprint)
        if found is None:
            raise ConfigError(
                f"the run trained on data.manifest {cfg.data.manifest}, whose tokenizer is not on this machine; "
                "pass it as --tokenizer DIR (the tokenizer/ directory of the run's token directory)"
            )
        return found
    if tokenizer is None and cfg.data.tokenizer is None:
        return embedded_tokenizer_path()
    path = Path(tokenizer if tokenizer is not None else cfg.data.tokenizer).expanduser()
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        source = "--tokenizer" if tokenizer is not None else "the run's data.tokenizer"
        raise ConfigError(
            f"{source} {path} is not a local Hugging Face tokenizer directory; pass the tokenizer the run was "
            "trained with as --tokenizer DIR"
        )
    return path


def export_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    tokenizer: str | Path | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write ``out_dir`` as a Hugging Face OLMoE model (weights, config, tokenizer, generation config).

    ``checkpoint`` is a run directory (its newest checkpoint) or a ``checkpoints/step_*`` directory.
    Every expert is exported: checkpoints hold all of them, whichever subset the peer trained.
    """
    from transformers import AutoTokenizer, GenerationConfig

    path = resolve_checkpoint(checkpoint)
    state = read_state(path)
    cfg = checkpoint_config(state, path)
    check_exportable(cfg)
    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        names = f.keys()  # safe_open has keys() and no __iter__
        if any(name.endswith("resident_experts") for name in names):
            raise CheckpointError(
                f"{path} was written by a partial-residency peer and holds only its own experts; export a full "
                "peer's checkpoint, or assemble the model from the live run with `p2p-spes export --from-swarm "
                "--initial-peers MADDR --run-id ID --out DIR`"
            )
    tok = AutoTokenizer.from_pretrained(str(resolve_tokenizer(cfg, tokenizer, state.get("data_fingerprint"))))
    if len(tok) > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {len(tok)} tokens but model.vocab_size is {cfg.model.vocab_size}; "
            "pass the tokenizer the run was trained with as --tokenizer DIR"
        )
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    bos = tok.bos_token_id

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not (out / PROVENANCE).is_file():
            raise ConfigError(f"{out} exists and is not a p2p-spes export; choose an empty or new --out directory")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)

    hf_cfg = olmoe_config(cfg, eos_token_id=eos, pad_token_id=pad, bos_token_id=bos)
    hf_cfg.dtype = "float32"
    hf_cfg.save_pretrained(str(out))
    config_file = out / "config.json"
    config_json = json.loads(config_file.read_text())
    config_json.setdefault("rope_theta", float(cfg.model.rope_theta))  # read by transformers 4.x
    config_file.write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    write_safetensors(hf_tensors(path / WEIGHTS, cfg), out, shard_bytes)
    tok.save_pretrained(str(out))
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad).save_pretrained(str(out))
    provenance = {
        "checkpoint": str(path.resolve()),
        "step": state.get("step"),
        "tokens": state.get("tokens"),
        "model_fingerprint": state.get("model_fingerprint"),
        "config": cfg.to_dict(),
    }
    (out / PROVENANCE).write_text(json.dumps(provenance, indent=1) + "\n")
    return out
