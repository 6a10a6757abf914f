"""Export to Hugging Face OLMoE: same logits, generate() works, every expert exported, refusals clear."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from p2p_spes.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from p2p_spes.cli import main as cli_main
from p2p_spes.config import load_config
from p2p_spes.errors import ConfigError
from p2p_spes.export import HF_INDEX, export_hf
from p2p_spes.model import MoETransformer
from p2p_spes.train import Trainer

transformers = pytest.importorskip("transformers")

TINY = [
    "model.d_model=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.max_seq_len=32",
    "moe.num_experts=4",
    "moe.ffn_dim=48",
]
TRAIN = [
    "train.batch_size=2",
    "train.max_steps=2",
    "train.warmup_steps=1",
    "train.eval_interval=2",
    "train.eval_batches=1",
    "train.checkpoint_interval=2",
    "train.device=cpu",
    # a peer that trains experts 2 and 3 only; the checkpoint still holds all four
    "peer.count=2",
    "peer.index=1",
]


def init_checkpoint(run_dir: Path, *overrides: str) -> tuple[Path, MoETransformer]:
    """An untrained model written as a checkpoint (fast; for configuration-level checks)."""
    cfg = load_config(None, TINY + list(overrides))
    model = MoETransformer(cfg.model, cfg.moe)
    model.init_weights(3)
    state = {"config": cfg.to_dict(), "model_fingerprint": cfg.model_fingerprint(), "tokens": 0}
    return save_checkpoint(run_dir, 0, model, None, state), model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two training steps of a peer owning experts [2, 3], exported once for the module."""
    run_dir = tmp_path_factory.mktemp("export-run")
    cfg = load_config(None, TINY + TRAIN + [f"train.run_dir={run_dir}"])
    trainer = Trainer(cfg)
    trainer.run(progress=False)
    model = MoETransformer(cfg.model, cfg.moe)
    load_checkpoint(find_checkpoint(run_dir), model)
    model.eval()
    hf_dir = export_hf(run_dir, run_dir / "hf")
    return {"cfg": cfg, "run_dir": run_dir, "model": model, "hf_dir": hf_dir}


def load_hf(hf_dir: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_dir), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"], info
    return model.eval()


def tokens(vocab: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (3, length), generator=torch.Generator().manual_seed(seed))


def test_exported_model_has_the_same_logits(trained):
    hf = load_hf(trained["hf_dir"])
    assert type(hf).__name__ == "OlmoeForCausalLM"
    idx = tokens(trained["cfg"].model.vocab_size, trained["cfg"].model.max_seq_len)
    with torch.no_grad():
        ours, _ = trained["model"](idx)
        theirs = hf(idx).logits
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()


def test_exported_config_and_tokenizer_are_consistent(trained):
    cfg = trained["cfg"]
    config = json.loads((trained["hf_dir"] / "config.json").read_text())
    assert config["model_type"] == "olmoe" and config["architectures"] == ["OlmoeForCausalLM"]
    assert config["num_experts"] == 4 and config["num_experts_per_tok"] == 2 and config["norm_topk_prob"] is False
    assert config["rms_norm_eps"] == cfg.model.norm_eps and config["max_position_embeddings"] == 32
    assert config["rope_parameters"]["rope_theta"] == cfg.model.rope_theta
    assert config["tie_word_embeddings"] is False and config["clip_qkv"] is None and config["attention_bias"] is False
    tok = transformers.AutoTokenizer.from_pretrained(str(trained["hf_dir"]))
    assert tok.eos_token == "<|endoftext|>" and config["eos_token_id"] == tok.eos_token_id
    generation = json.loads((trained["hf_dir"] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.eos_token_id and generation["pad_token_id"] is not None


def test_generate_produces_tokens(trained):
    hf = load_hf(trained["hf_dir"])
    tok = transformers.AutoTokenizer.from_pretrained(str(trained["hf_dir"]))
    inputs = tok("def parse(text):", return_tensors="pt")
    out = hf.generate(**inputs, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 6
    assert isinstance(tok.decode(out[0]), str)


def test_peer_checkpoint_exports_every_expert(trained):
    """The peer trained experts 2 and 3; all four are in the checkpoint and in the export."""
    ckpt = load_file(str(find_checkpoint(trained["run_dir"]) / "model.safetensors"))
    init = MoETransformer(trained["cfg"].model, trained["cfg"].moe)
    init.init_weights(trained["cfg"].train.seed)
    init_w1 = init.state_dict()["layers.0.mlp.experts.mlp.w1"].view(4, 48, 64)
    with safe_open(str(trained["hf_dir"] / "model.safetensors"), framework="pt") as f:
        for layer in range(2):
            prefix = f"layers.{layer}.mlp.experts.mlp"
            w1, v1, w2 = (ckpt[f"{prefix}.{name}"].view(4, 48, 64) for name in ("w1", "v1", "w2"))
            for e in range(4):
                hf = f"model.layers.{layer}.mlp.experts.{e}"
                assert torch.equal(f.get_tensor(f"{hf}.gate_proj.weight"), w1[e])
                assert torch.equal(f.get_tensor(f"{hf}.up_proj.weight"), v1[e])
                assert torch.equal(f.get_tensor(f"{hf}.down_proj.weight"), w2[e].t())
    trained_w1 = ckpt["layers.0.mlp.experts.mlp.w1"].view(4, 48, 64)
    assert torch.equal(trained_w1[:2], init_w1[:2]) and not torch.equal(trained_w1[2:], init_w1[2:])


@pytest.mark.parametrize("kind", ["per_head", "none"])
def test_qk_norm_olmoe_cannot_express_is_refused(tmp_path, kind):
    init_checkpoint(tmp_path / "run", f"model.qk_norm={kind}")
    with pytest.raises(ConfigError, match=rf"model.qk_norm='{kind}' cannot be exported.*model.qk_norm=full"):
        export_hf(tmp_path / "run", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_normalized_top_k_maps_to_norm_topk_prob_and_sharding_loads(tmp_path):
    _, model = init_checkpoint(tmp_path / "run", "moe.normalize_top_k=true")
    hf_dir = export_hf(tmp_path / "run", tmp_path / "hf", shard_bytes=200_000)
    assert json.loads((hf_dir / "config.json").read_text())["norm_topk_prob"] is True
    assert (hf_dir / HF_INDEX).is_file() and len(list(hf_dir.glob("model-*-of-*.safetensors"))) > 1
    idx = tokens(8192, 32, seed=1)
    with torch.no_grad():
        assert torch.allclose(model.eval()(idx)[0], load_hf(hf_dir)(idx).logits, atol=1e-4, rtol=0)


def test_cli_export_and_its_errors(tmp_path, capsys):
    init_checkpoint(tmp_path / "run")
    assert cli_main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    assert "exported OlmoeForCausalLM" in capsys.readouterr().out
    assert cli_main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    (tmp_path / "empty").mkdir()
    assert cli_main(["export", "--checkpoint", str(tmp_path / "empty"), "--out", str(tmp_path / "x")]) == 2
    assert "no checkpoint found" in capsys.readouterr().err
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "notes.txt").write_text("keep me")
    assert cli_main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "occupied")]) == 2
    assert "not a p2p-spes export" in capsys.readouterr().err
    assert (tmp_path / "occupied" / "notes.txt").exists()
