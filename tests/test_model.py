"""The MoE model: the torch backend against a naive computation, expert subsets, losses, shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import SMALL_MODEL

from p2p_spes.config import load_config
from p2p_spes.errors import BackendError
from p2p_spes.memory import measure_memory
from p2p_spes.model import MoETransformer, auxiliary_losses
from p2p_spes.moe import TorchMoE, megablocks_available
from p2p_spes.optim import build_optimizer


def small_config(*extra: str):
    return load_config(None, SMALL_MODEL + list(extra))


def naive_moe(moe: TorchMoE, x: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Every token through every selected expert, one at a time, from the stacked weights."""
    w1, v1, w2 = (moe.expert_weights.stacked(n) for n in ("w1", "v1", "w2"))
    router = moe.router.layer.weight
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = (x[t] @ router.T).float().softmax(-1)
        weights, experts = probs.topk(moe.top_k)
        if normalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, experts):
            h = F.silu(x[t] @ w1[e].T) * (x[t] @ v1[e].T)
            out[t] += w * (h @ w2[e])
    return out


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("local", [None, [1, 6], [0, 1, 2, 3]])
def test_torch_moe_matches_naive(kernel, normalize, local):
    cfg = small_config(f"moe.torch_kernel={kernel}", f"moe.normalize_top_k={str(normalize).lower()}")
    torch.manual_seed(0)
    moe = TorchMoE(cfg.moe, cfg.model.d_model, local_experts=local)
    moe.router.layer.weight.data.normal_(0, 0.5)
    moe.expert_weights.reset_parameters(0.1, 0.1)
    x = torch.randn(2, 7, cfg.model.d_model)
    y, stats = moe(x)
    expected = naive_moe(moe, x.reshape(-1, x.shape[-1]), normalize).reshape(x.shape)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert stats.tokens_per_expert.sum() == 14 * cfg.moe.top_k


def test_local_experts_get_gradients_frozen_do_not_but_pass_them_through():
    cfg = small_config()
    moe = TorchMoE(cfg.moe, cfg.model.d_model, local_experts=[2, 5])
    moe.expert_weights.reset_parameters(0.1, 0.1)
    x = torch.randn(64, cfg.model.d_model, requires_grad=True)
    y, _ = moe(x)
    y.pow(2).sum().backward()
    names = {n for n, p in moe.named_parameters()}
    assert {"experts.mlp.local_w1", "experts.mlp.local_v1", "experts.mlp.local_w2"} <= names
    assert not any("frozen" in n for n in names)
    assert moe.expert_weights.local_w1.grad.shape == (2, cfg.moe.ffn_dim, cfg.model.d_model)
    assert moe.expert_weights.frozen_w1.grad is None
    # tokens that went to frozen experts still backpropagate into the input and the router
    assert x.grad.abs().sum() > 0 and moe.router.layer.weight.grad.abs().sum() > 0


def test_state_dict_has_megablocks_layout_and_loads_across_splits():
    cfg = small_config()
    a = MoETransformer(cfg.model, cfg.moe, local_experts=[0, 1])
    a.init_weights(3)
    sd = a.state_dict()
    e, f, h = cfg.moe.num_experts, cfg.moe.ffn_dim, cfg.model.d_model
    for name in ("w1", "v1", "w2"):
        assert sd[f"layers.0.mlp.experts.mlp.{name}"].shape == (e * f, h)
    assert sd["layers.1.mlp.router.layer.weight"].shape == (e, h)
    assert not any("local_" in k or "frozen_" in k for k in sd)
    b = MoETransformer(cfg.model, cfg.moe, local_experts=[3, 7])
    assert not b.load_state_dict(sd).missing_keys
    idx = torch.randint(0, cfg.model.vocab_size, (2, 16))
    torch.testing.assert_close(a(idx)[0], b(idx)[0], rtol=0, atol=0)
    b.set_local_experts([5])
    torch.testing.assert_close(a(idx)[0], b(idx)[0], rtol=0, atol=0)
    for k, v in sd.items():
        assert torch.equal(b.state_dict()[k], v), k


def test_init_does_not_depend_on_local_experts():
    cfg = small_config()
    a = MoETransformer(cfg.model, cfg.moe, local_experts=[0, 1])
    b = MoETransformer(cfg.model, cfg.moe, local_experts=[4, 5, 6])
    a.init_weights(11)
    b.init_weights(11)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), k


def test_bad_state_dict_shape_is_reported():
    cfg = small_config()
    model = MoETransformer(cfg.model, cfg.moe)
    sd = model.state_dict()
    sd["layers.0.mlp.experts.mlp.w1"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match="size mismatch for layers.0.mlp.experts.mlp.w1"):
        model.load_state_dict(sd)


def test_frozen_experts_stay_bit_identical_through_adamw_with_weight_decay():
    cfg = small_config("train.weight_decay=0.5", "train.lr=0.05")
    model = MoETransformer(cfg.model, cfg.moe, local_experts=[0, 1])
    model.init_weights(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = build_optimizer(model, cfg.train)
    for _ in range(5):
        idx = torch.randint(0, cfg.model.vocab_size, (4, 16))
        model.loss(idx, idx.roll(-1, 1)).loss.backward()
        opt.step()
        opt.zero_grad()
    e, f, h = cfg.moe.num_experts, cfg.moe.ffn_dim, cfg.model.d_model
    for layer in range(cfg.model.num_layers):
        for name in ("w1", "v1", "w2"):
            key = f"layers.{layer}.mlp.experts.mlp.{name}"
            old, new = before[key].view(e, f, h), model.state_dict()[key].view(e, f, h)
            assert torch.equal(old[2:], new[2:]), f"frozen experts of {key} changed"
            assert not torch.equal(old[:2], new[:2]), f"local experts of {key} did not train"
    assert not torch.equal(
        before["layers.0.self_attn.q_proj.weight"], model.state_dict()["layers.0.self_attn.q_proj.weight"]
    )


def _train_one_step(local):
    cfg = small_config()
    model = MoETransformer(cfg.model, cfg.moe, local_experts=local)
    model.init_weights(0)
    opt = build_optimizer(model, cfg.train)
    idx = torch.randint(0, cfg.model.vocab_size, (2, 16))
    model.loss(idx, idx).loss.backward()
    opt.step()
    return cfg, measure_memory(model, opt)


def test_gradient_and_optimizer_bytes_scale_with_local_experts():
    cfg, full = _train_one_step(None)
    _, quarter = _train_one_step([0, 1])
    e, f, h, layers = cfg.moe.num_experts, cfg.moe.ffn_dim, cfg.model.d_model, cfg.model.num_layers
    per_expert = 3 * f * h * layers * 4  # fp32 bytes of one expert across layers
    moments = {"muon": 1, "adamw": 2}[cfg.train.optimizer]  # Muon's momentum, or AdamW's two moments
    assert full.gradients["local_experts"] == e * per_expert
    assert full.optimizer["local_experts"] == moments * e * per_expert
    assert quarter.gradients["local_experts"] == 2 * per_expert
    assert quarter.optimizer["local_experts"] == moments * 2 * per_expert
    assert quarter.optimizer["local_experts"] / full.optimizer["local_experts"] == 2 / e
    assert quarter.gradients["frozen_experts"] == quarter.optimizer["frozen_experts"] == 0
    assert quarter.parameters["frozen_experts"] == 6 * per_expert
    assert quarter.optimizer["shared"] == full.optimizer["shared"] > 0
    assert quarter.parameters["shared"] + quarter.parameters["local_experts"] + quarter.parameters[
        "frozen_experts"
    ] == (full.parameters["shared"] + full.parameters["local_experts"])


def test_auxiliary_losses_follow_the_megablocks_formulas():
    cfg = small_config()
    model = MoETransformer(cfg.model, cfg.moe)
    model.init_weights(1)
    idx = torch.randint(0, cfg.model.vocab_size, (3, 16))
    with torch.no_grad():
        _, stats = model(idx)
    tokens, e, k, layers = 48, cfg.moe.num_experts, cfg.moe.top_k, cfg.model.num_layers
    lb, rz = auxiliary_losses(stats, cfg.moe)
    expected_lb = 0.0
    for s in stats:
        assert s.tokens_per_expert.sum() == tokens * k
        expected_lb += float((s.tokens_per_expert * s.mean_probs).sum())
    assert float(lb) == pytest.approx(cfg.moe.lb_loss_weight * e / (layers * tokens * k) * expected_lb, rel=1e-6)
    assert float(rz) == pytest.approx(cfg.moe.router_z_loss_weight * sum(float(s.router_z) for s in stats), rel=1e-6)
    # perfectly balanced routing with uniform probabilities gives exactly the weight
    uniform = [type(s)(torch.full((e,), tokens * k / e), torch.full((e,), 1 / e), s.router_z, tokens) for s in stats]
    assert float(auxiliary_losses(uniform, cfg.moe)[0]) == pytest.approx(cfg.moe.lb_loss_weight)
    # the decayed-LB option scales the counts of chosen experts
    scale = torch.ones(e)
    scale[:2] = 0.7
    scaled = auxiliary_losses(stats, cfg.moe, scale)[0]
    expected = sum(float((s.tokens_per_expert * scale * s.mean_probs).sum()) for s in stats)
    assert float(scaled) == pytest.approx(cfg.moe.lb_loss_weight * e / (layers * tokens * k) * expected, rel=1e-6)


def test_loss_parts_add_up_and_are_finite():
    cfg = small_config()
    model = MoETransformer(cfg.model, cfg.moe)
    model.init_weights(0)
    idx = torch.randint(0, cfg.model.vocab_size, (2, 16))
    out = model.loss(idx, idx)
    parts = out.as_floats()
    assert parts["loss"] == pytest.approx(
        parts["ce"] + parts["z_loss"] + parts["lb_loss"] + parts["router_z_loss"], rel=1e-6
    )
    assert parts["ce"] == pytest.approx(float(torch.log(torch.tensor(97.0))), rel=0.05)


@pytest.mark.parametrize("name,expected", [("spes-1b", 1.17e9), ("spes-7b", 7.33e9)])
def test_published_configs_have_published_parameter_counts(name, expected):
    cfg = load_config(name)
    model = MoETransformer(cfg.model, cfg.moe, cfg.local_experts(), device="meta")
    total = sum(p.numel() for p in model.parameters())
    total += sum(b.numel() for n, b in model.named_buffers() if "frozen_" in n)
    assert total == pytest.approx(expected, rel=0.005)
    trainable = sum(p.numel() for p in model.parameters())
    assert trainable < total  # 4 peers: each trains a quarter of the experts


def test_per_head_qk_norm_and_no_qk_norm_run():
    for mode in ("per_head", "none"):
        cfg = small_config(f"model.qk_norm={mode}")
        model = MoETransformer(cfg.model, cfg.moe)
        model.init_weights(0)
        assert torch.isfinite(model(torch.randint(0, 97, (1, 8)))[0]).all()


def test_megablocks_without_megablocks_is_a_clear_error():
    if megablocks_available() and torch.cuda.is_available():
        pytest.skip("MegaBlocks and CUDA are present; the GPU tests cover this backend")
    cfg = small_config("moe.impl=megablocks")
    with pytest.raises(BackendError, match="moe.impl=megablocks|moe.impl=torch"):
        MoETransformer(cfg.model, cfg.moe)


def test_sequence_longer_than_max_is_refused():
    cfg = small_config()
    model = MoETransformer(cfg.model, cfg.moe)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))
