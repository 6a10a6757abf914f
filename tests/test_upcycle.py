"""Upcycling a dense Hugging Face model: exact function at zero noise, noise and router options, clear refusals."""

from __future__ import annotations

import json

import pytest
import torch

from p2p_spes.checkpoint import find_checkpoint, load_checkpoint, read_state
from p2p_spes.cli import main as cli_main
from p2p_spes.config import load_config
from p2p_spes.errors import CheckpointError, ConfigError
from p2p_spes.model import MoETransformer
from p2p_spes.train import Trainer
from p2p_spes.upcycle import upcycle

transformers = pytest.importorskip("transformers")

D, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 96, 2, 4, 2, 8192
MOE = [
    "model.d_model=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.max_seq_len=32",
    "moe.num_experts=4",
    "moe.top_k=2",
    f"moe.ffn_dim={FFN}",
    "moe.normalize_top_k=true",
    "model.rope_theta=10000.0",
]


def dense_model(kind: str):
    """A random dense Qwen3 (per-head q/k-norm, tied embeddings) or Llama, both with grouped-query attention."""
    common = {
        "vocab_size": VOCAB,
        "hidden_size": D,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    }
    torch.manual_seed(0)
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(head_dim=D // HEADS, tie_word_embeddings=True, **common)
        )
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=False, **common))
    with torch.no_grad():  # norms are ones at init: make them matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    return model.float().eval()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense-qwen3")
    dense_model("qwen3").save_pretrained(str(path))
    return path


def moe_config(*extra: str):
    return load_config(None, MOE + list(extra))


def load_moe(path, cfg) -> MoETransformer:
    model = MoETransformer(cfg.model, cfg.moe)
    load_checkpoint(path, model, fingerprint=cfg.model_fingerprint())
    return model.eval()


@pytest.mark.parametrize("kind, qk_norm", [("qwen3", "per_head"), ("llama", "none")])
def test_zero_noise_zero_router_reproduces_the_dense_model(tmp_path, kind, qk_norm):
    dense = dense_model(kind)
    dense.save_pretrained(str(tmp_path / "dense"), max_shard_size="300KB")  # sharded, with an index
    assert (tmp_path / "dense" / "model.safetensors.index.json").is_file()
    cfg = moe_config(f"model.qk_norm={qk_norm}")
    path = upcycle(tmp_path / "dense", cfg, tmp_path / "moe")
    assert path == find_checkpoint(tmp_path / "moe")
    state = read_state(path)
    assert state["step"] == 0 and state["tokens"] == 0 and state["model_fingerprint"] == cfg.model_fingerprint()
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, _ = load_moe(path, cfg)(idx)
        theirs = dense(idx).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()


def test_without_top_k_normalisation_the_mlp_is_scaled_by_k_over_e(qwen3_dir, tmp_path):
    cfg = moe_config("model.qk_norm=per_head", "moe.normalize_top_k=false")
    model = load_moe(upcycle(qwen3_dir, cfg, tmp_path / "moe"), cfg)
    dense = dense_model("qwen3")
    x = torch.randn(5, D)
    with torch.no_grad():
        y, _ = model.layers[0].mlp(x)
        expected = dense.model.layers[0].mlp(x) * cfg.moe.top_k / cfg.moe.num_experts
    assert torch.allclose(y, expected, atol=1e-6)


def test_noise_touches_the_given_fraction_and_the_router_can_be_normal(qwen3_dir, tmp_path):
    cfg = moe_config("model.qk_norm=per_head")
    path = upcycle(qwen3_dir, cfg, tmp_path / "moe", noise_std=0.01, noise_fraction=0.25, router_init="normal", seed=7)
    weights = load_moe(path, cfg).state_dict()
    dense = dense_model("qwen3").state_dict()
    w1 = weights["layers.0.mlp.experts.mlp.w1"].view(4, FFN, D)
    gate = dense["model.layers.0.mlp.gate_proj.weight"]
    changed = (w1 != gate).float().mean(dim=(1, 2))
    assert torch.all((changed - 0.25).abs() < 0.03), changed
    assert not torch.equal(w1[0], w1[1])
    assert (w1 - gate).abs().max() < 0.01 * 6
    router = weights["layers.0.mlp.router.layer.weight"]
    assert router.std().item() == pytest.approx(cfg.model.init_std, rel=0.2)
    assert torch.equal(weights["layers.1.self_attn.q_proj.weight"], dense["model.layers.1.self_attn.q_proj.weight"])
    again = load_moe(
        upcycle(qwen3_dir, cfg, tmp_path / "again", noise_std=0.01, noise_fraction=0.25, router_init="normal", seed=7),
        cfg,
    ).state_dict()
    assert all(torch.equal(weights[k], again[k]) for k in weights)


def test_mismatches_are_refused_with_the_fix(qwen3_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"--set model.d_model=64.*--set moe.ffn_dim=96"):
        upcycle(
            qwen3_dir,
            load_config(None, MOE + ["model.d_model=128", "moe.ffn_dim=64", "model.qk_norm=per_head"]),
            tmp_path / "a",
        )
    with pytest.raises(ConfigError, match=r"--set model.qk_norm=per_head"):
        upcycle(qwen3_dir, moe_config("model.qk_norm=full"), tmp_path / "b")
    with pytest.raises(ConfigError, match=r"--set model.rope_theta=10000.0"):
        upcycle(qwen3_dir, moe_config("model.qk_norm=per_head", "model.rope_theta=500000.0"), tmp_path / "c")
    other = tmp_path / "olmo2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "olmo2"}))
    (other / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="model_type 'olmo2' is not supported"):
        upcycle(other, moe_config(), tmp_path / "d")
    with pytest.raises(CheckpointError, match="no config.json"):
        upcycle(tmp_path, moe_config(), tmp_path / "e")


def test_training_starts_from_an_upcycled_checkpoint(qwen3_dir, tmp_path, capsys):
    overrides = MOE + [
        "model.qk_norm=per_head",
        "peer.count=2",
        "peer.index=0",
        "train.device=cpu",
        "train.batch_size=2",
    ]
    code = cli_main(
        ["upcycle", "--dense", str(qwen3_dir), "--out", str(tmp_path / "moe"), "--noise-std", "0.001"]
        + [arg for o in overrides for arg in ("--set", o)]
    )
    assert code == 0 and "train.init_from=" in capsys.readouterr().out
    cfg = load_config(None, overrides + [f"train.init_from={tmp_path / 'moe'}", f"train.run_dir={tmp_path / 'run'}"])
    trainer = Trainer(cfg)
    upcycled = load_moe(find_checkpoint(tmp_path / "moe"), cfg).state_dict()
    assert trainer.step == 0 and trainer.model.local_experts == [0, 1]
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(value, upcycled[key]), key
    trainer.train_step()
    fresh = Trainer(load_config(None, overrides + [f"train.run_dir={tmp_path / 'run2'}"]))
    with pytest.raises(CheckpointError, match="initial weights only.*train.init_from"):
        fresh.resume(find_checkpoint(tmp_path / "moe"))
