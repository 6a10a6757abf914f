"""Self-healing coverage: the takeover plan and growing a peer's trained experts without losing state."""

from __future__ import annotations

import torch
from helpers import SMALL_MODEL

from p2p_spes.config import load_config
from p2p_spes.healing import plan_takeover, take_on_experts
from p2p_spes.model import MoETransformer
from p2p_spes.optim import build_optimizer


def test_plan_covers_every_lost_expert_once_on_peers_with_spare_capacity():
    held = {"a": [0, 1, 2], "b": [3, 4], "c": [5]}  # experts 6 and 7 lost their holder
    plan = plan_takeover(held, {"a": 3, "b": 4, "c": 4}, num_experts=8, replicas=1)
    taken = sorted(e for es in plan.values() for e in es)
    assert taken == [6, 7]
    assert "a" not in plan  # a is full
    assert sorted(plan.get("b", []) + plan.get("c", [])) == [6, 7] and len(plan["c"]) >= 1  # c has more room
    # every peer computes the same plan from the same records, whatever the order it sees them in
    assert plan_takeover(dict(reversed(list(held.items()))), {"c": 4, "b": 4, "a": 3}, 8, 1) == plan


def test_plan_tops_up_replicas_and_never_gives_a_peer_an_expert_it_holds():
    held = {"a": [0, 1], "b": [0, 1], "c": [2, 3]}
    plan = plan_takeover(held, {"a": 8, "b": 8, "c": 8}, num_experts=4, replicas=2)
    assert sorted(plan) == ["a", "b"] and set(plan["a"]) | set(plan["b"]) == {2, 3}
    assert not set(plan["a"]) & {0, 1}
    assert plan_takeover(held, {}, 4, 2) == {}  # nobody published spare capacity: nothing moves
    assert plan_takeover({"a": [0, 1], "b": [2, 3]}, {"a": 8, "b": 8}, 4, 1) == {}  # covered: nothing moves


def _stepped(resident_only: bool):
    # AdamW's moments here; a Muon peer's momentum: tests/test_optim.py
    cfg = load_config(
        None,
        SMALL_MODEL
        + ["train.optimizer=adamw"]
        + (["swarm.residency=partial", "swarm.merge_interval=0"] if resident_only else []),
    )
    model = MoETransformer(cfg.model, cfg.moe, local_experts=[1, 5], resident_only=resident_only)
    model.init_weights(0)
    opt = build_optimizer(model, cfg.train)
    x = torch.randint(0, 97, (4, 16))
    model.loss(x, x).loss.backward()
    opt.step()
    opt.zero_grad()
    return cfg, model, opt, x


def test_taking_on_an_expert_keeps_weights_and_adam_moments_of_everything_else():
    cfg, model, opt, x = _stepped(False)
    store = model.expert_modules()[0]
    before = store.stacked("w1")
    m_before = opt.state[store.local_w1]["exp_avg"].clone()
    shared = model.layers[0].self_attn.q_proj.weight
    shared_m = opt.state[shared]["exp_avg"].clone()
    opt = take_on_experts(model, opt, [3], cfg.train)
    assert model.local_experts == [1, 3, 5]
    assert torch.equal(store.stacked("w1"), before)  # the frozen copy becomes the trained one
    m_after = opt.state[store.local_w1]["exp_avg"]
    assert torch.equal(m_after[0], m_before[0]) and torch.equal(m_after[2], m_before[1]) and not m_after[1].any()
    assert torch.equal(opt.state[shared]["exp_avg"], shared_m)
    assert any(p is store.local_w1 for p in opt.param_groups[0]["params"])  # the new parameters are the optimizer's
    model.loss(x, x).loss.backward()
    opt.step()
    assert opt.state[store.local_w1]["exp_avg"].shape == (3, 48, 32)
    assert int(opt.state[store.local_w1]["step"]) == 2


def test_partial_peer_grows_storage_only_for_the_expert_it_takes():
    cfg, model, opt, _ = _stepped(True)
    store = model.expert_modules()[0]
    opt = take_on_experts(model, opt, [2], cfg.train)
    assert store.resident_ids == [1, 2, 5] and store.local_w1.shape[0] == 3 and store.frozen_w1.shape[0] == 0
    assert len(opt.param_groups[0]["params"]) == len([p for p in model.parameters() if p.ndim >= 2])
