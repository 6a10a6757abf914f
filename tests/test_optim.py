"""The optimizers: Muon's orthogonalized step on hidden matrices (batched over experts), AdamW on the
rest exactly as torch's, and what each keeps in memory, through checkpoints and expert takeovers."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import SMALL_MODEL

from p2p_spes import optim
from p2p_spes.checkpoint import load_optimizer_tensors, optimizer_tensors
from p2p_spes.config import load_config
from p2p_spes.errors import CheckpointError, ConfigError
from p2p_spes.healing import take_on_experts
from p2p_spes.memory import expected_memory, measure_memory
from p2p_spes.model import MoETransformer
from p2p_spes.optim import MuonAdamW, bf16_error, build_optimizer, orthogonalize, trainable_parameters


def _model(optimizer: str, local: list[int]):
    cfg = load_config(None, SMALL_MODEL + [f"train.optimizer={optimizer}"])
    model = MoETransformer(cfg.model, cfg.moe, local_experts=local)
    model.init_weights(0)
    return cfg, model


def _step(model, opt, seed: int = 0, keep_grads: bool = False) -> None:
    x = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(seed))
    model.loss(x, x).loss.backward()
    opt.step()
    if not keep_grads:
        opt.zero_grad()


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (3, 16, 48)])
def test_orthogonalize_brings_every_singular_value_near_one_per_matrix(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 5
    g[..., 0, :] *= 100  # one dominant direction: the step must not follow it alone
    s = torch.linalg.svdvals(orthogonalize(g))
    assert s.min() > 0.6 and s.max() < 1.3
    if len(shape) == 3:  # a stack of experts: each matrix on its own
        for i in range(shape[0]):
            assert torch.allclose(orthogonalize(g)[i], orthogonalize(g[i]), atol=1e-6)
    assert torch.allclose(orthogonalize(g.mT), orthogonalize(g).mT, atol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_adamw_groups_step_exactly_as_torch_adamw_at_the_scaled_lr(scale):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(6, 5))
    b = torch.nn.Parameter(a.detach().clone())
    ref = torch.optim.AdamW([a], lr=1e-2 * scale, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours = MuonAdamW([{"params": [b], "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, adamw_lr_scale=scale)
    for _ in range(4):
        g = torch.randn(6, 5)
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    assert torch.equal(a, b)
    assert set(ours.state[b]) == {"step", "exp_avg", "exp_avg_sq"}  # the names checkpoints and takeovers read


@pytest.mark.parametrize("update_rms", [0.2, 0.6])
def test_muon_group_steps_along_the_orthogonalized_nesterov_momentum(update_rms):
    w = torch.nn.Parameter(torch.randn(8, 32))
    start = w.detach().clone()
    opt = MuonAdamW(
        [{"params": [w], "weight_decay": 0.1, "muon": True}],
        lr=0.01,
        betas=(0.9, 0.95),
        eps=1e-8,
        update_rms=update_rms,
    )
    grads = [torch.randn(8, 32), torch.randn(8, 32)]
    expected, buf = start.clone(), torch.zeros(8, 32)
    for g in grads:
        w.grad = g.clone()
        opt.step()
        buf = 0.95 * buf + 0.05 * g
        expected = expected * (1 - 0.01 * 0.1) - 0.01 * update_rms * math.sqrt(32) * orthogonalize(
            0.05 * g + 0.95 * buf
        )
    assert torch.allclose(w, expected, atol=1e-6)
    assert set(opt.state[w]) == {"momentum_buffer"}


def test_muon_takes_attention_and_experts_and_leaves_embeddings_head_router_and_norms_to_adamw():
    cfg, model = _model("muon", [1, 2])
    opt = build_optimizer(model, cfg.train)
    names = {id(p): n for n, p in trainable_parameters(model)}
    muon = [names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]]
    adamw = [names[id(p)] for g in opt.param_groups if not g["muon"] for p in g["params"]]
    assert sorted(muon + adamw) == sorted(names.values())  # every trained parameter, once
    assert any("local_w1" in n for n in muon) and any("q_proj" in n for n in muon)
    assert not any(k in n for n in muon for k in ("embed_tokens", "lm_head", "router", "norm"))
    assert all(n.startswith(("embed", "lm_head")) or "router" in n or "norm" in n for n in adamw)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_computed_optimizer_memory_matches_what_a_step_allocates(optimizer):
    cfg, model = _model(optimizer, [1, 2])
    opt = build_optimizer(model, cfg.train)
    _step(model, opt, keep_grads=True)
    measured = measure_memory(model, opt)
    assert measured.to_dict() == expected_memory(model, cfg.train).to_dict()
    local = measured.parameters["local_experts"]
    assert measured.optimizer["local_experts"] == (local if optimizer == "muon" else 2 * local)


def test_a_muon_peer_taking_on_an_expert_keeps_the_momentum_of_the_experts_it_had():
    cfg, model = _model("muon", [1, 5])
    opt = build_optimizer(model, cfg.train)
    _step(model, opt)
    store = model.expert_modules()[0]
    before = opt.state[store.local_w1]["momentum_buffer"].clone()
    opt = take_on_experts(model, opt, [3], cfg.train)
    after = opt.state[store.local_w1]["momentum_buffer"]
    assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[1]) and not after[1].any()
    _step(model, opt, seed=1)
    assert opt.state[store.local_w1]["momentum_buffer"][1].any()  # the new expert trains under Muon too


def test_an_unknown_optimizer_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="train.optimizer: must be one of 'adamw', 'muon'"):
        load_config(None, ["train.optimizer=sgd"])
    with pytest.raises(ConfigError, match="train.muon_adamw_lr_scale must be positive"):
        load_config(None, ["train.muon_adamw_lr_scale=0"])


def test_train_muon_ns_steps_sets_the_iterations_each_muon_step_runs():
    """The knob reaches every Muon group, and a step with 3 iterations is the 3-iteration direction."""
    stepped = {}
    for steps in (3, 5):
        cfg = load_config(None, SMALL_MODEL + ["train.optimizer=muon", f"train.muon_ns_steps={steps}"])
        model = MoETransformer(cfg.model, cfg.moe, local_experts=[1, 2])
        model.init_weights(0)
        opt = build_optimizer(model, cfg.train)
        assert {g["ns_steps"] for g in opt.param_groups if g["muon"]} == {steps}
        q = model.layers[0].self_attn.q_proj.weight
        before = q.detach().clone()
        _step(model, opt, keep_grads=True)
        stepped[steps] = (before - q.detach(), q.grad.clone())
    (d3, g3), (d5, g5) = stepped[3], stepped[5]
    assert torch.equal(g3, g5)  # the same weights and batch: only the iteration count differs
    cos = torch.nn.functional.cosine_similarity
    assert cos(d3.flatten(), orthogonalize(g3, steps=3).flatten(), dim=0) > 0.99
    assert not torch.allclose(d3, d5)
    with pytest.raises(ConfigError, match=r"train.muon_ns_steps must be in \[1, 10\]"):
        load_config(None, ["train.muon_ns_steps=0"])


def test_a_checkpoint_of_another_optimizer_is_refused_naming_the_setting():
    cfg, model = _model("adamw", [1, 2])
    opt = build_optimizer(model, cfg.train)
    _step(model, opt)
    saved = optimizer_tensors(model, opt)
    muon_cfg, muon_model = _model("muon", [1, 2])
    with pytest.raises(CheckpointError, match="saved with another train.optimizer"):
        load_optimizer_tensors(muon_model, build_optimizer(muon_model, muon_cfg.train), saved)
    again = build_optimizer(model, cfg.train)
    load_optimizer_tensors(model, again, saved)  # the optimizer it was saved with takes it back
    assert all(torch.equal(again.state[p]["exp_avg"], opt.state[p]["exp_avg"]) for p in opt.state)


@pytest.mark.parametrize("shape", [(64, 64), (128, 64), (48, 32)])
def test_the_bf16_iteration_a_gpu_runs_stays_close_to_fp32(shape):
    # what MuonAdamW.self_check measures on each GPU at start-up, here on the CPU's bf16 matmuls
    assert 0 < bf16_error(shape, torch.device("cpu")) < 0.1


def test_a_gpu_whose_bf16_iteration_disagrees_falls_back_to_fp32(monkeypatch):
    cfg, model = _model("muon", [1, 2])
    opt = build_optimizer(model, cfg.train)
    assert opt.self_check() == []  # off a GPU there is nothing to check: the iteration runs in fp32
    # a GPU whose bf16 matmuls are wrong: the check names the device and shape and refuses bf16 there
    monkeypatch.setattr(optim, "bf16_error", lambda shape, device: float("nan"))
    monkeypatch.setattr(optim, "_BF16_REFUSED", set())
    monkeypatch.setattr(opt, "matrix_shapes", lambda: {(32, 32): torch.device("cuda:0")})
    findings = opt.self_check()
    assert findings and all("cuda:0" in f and "using fp32" in f for f in findings)
    assert ("cuda:0", (32, 32)) in optim._BF16_REFUSED
