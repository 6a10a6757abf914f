"""Warm-up expert merging against a direct computation of the SPES rule."""

from __future__ import annotations

import pytest
import torch

from p2p_spes.config import load_config
from p2p_spes.merging import merge_alpha, merge_experts, neighbours
from p2p_spes.model import MoETransformer


def test_alpha_decays_linearly_to_zero():
    assert merge_alpha(0, 0.05, 1000) == pytest.approx(0.05)
    assert merge_alpha(500, 0.05, 1000) == pytest.approx(0.025)
    assert merge_alpha(1000, 0.05, 1000) == 0.0
    assert merge_alpha(5000, 0.05, 1000) == 0.0


def test_merge_matches_the_rule_per_matrix_kind_and_ignores_the_split():
    cfg = load_config(
        None, ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "moe.ffn_dim=16", "model.vocab_size=50"]
    )
    a = MoETransformer(cfg.model, cfg.moe, local_experts=[0, 1])
    a.init_weights(5)
    b = MoETransformer(cfg.model, cfg.moe, local_experts=[6])
    b.load_state_dict(a.state_dict())
    before = {k: v.clone() for k, v in a.state_dict().items()}
    alpha = 0.3
    merge_experts(a, alpha)
    merge_experts(b, alpha)
    e, f, h = cfg.moe.num_experts, cfg.moe.ffn_dim, cfg.model.d_model
    for layer in range(cfg.model.num_layers):
        key = f"layers.{layer}.mlp.experts.mlp."
        w1 = before[key + "w1"].view(e, f * h)
        cos = torch.nn.functional.cosine_similarity(w1.unsqueeze(1), w1.unsqueeze(0), dim=-1)
        for name in ("w1", "v1", "w2"):
            old = before[key + name].view(e, f, h)
            new = a.state_dict()[key + name].view(e, f, h)
            for i in range(e):
                others = [j for j in range(e) if j != i]
                top = sorted(others, key=lambda j: -float(cos[i, j]))[:4]
                expected = (1 - alpha) * old[i] + alpha * old[top].mean(0)
                torch.testing.assert_close(new[i], expected, rtol=1e-5, atol=1e-6)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), f"{k}: merge depends on which experts are local"


def test_neighbours_exclude_self_and_cap_at_e_minus_one():
    w1 = torch.randn(3, 4, 5)
    idx = neighbours(w1)
    assert idx.shape == (3, 2)
    for i in range(3):
        assert i not in idx[i].tolist()
