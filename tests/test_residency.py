"""Partial expert residency: the skip rule, storage of non-resident experts, checkpoints, config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import SMALL_MODEL

from p2p_spes.config import load_config
from p2p_spes.errors import ConfigError, ResidencyError
from p2p_spes.model import MoETransformer
from p2p_spes.moe import resident_weights

LOCAL = [1, 4, 6]


def models(normalize: bool):
    cfg = load_config(None, SMALL_MODEL + [f"moe.normalize_top_k={str(normalize).lower()}"])
    full = MoETransformer(cfg.model, cfg.moe, local_experts=LOCAL)
    full.init_weights(3)
    part = MoETransformer(cfg.model, cfg.moe, local_experts=LOCAL, resident_only=True)
    part.init_weights(3)
    return full, part


def naive_partial(full_moe, x: torch.Tensor, resident: set[int], normalize: bool) -> tuple[torch.Tensor, float]:
    """Token by token from the full model's weights, dropping non-resident experts by the documented rule."""
    w1, v1, w2 = (full_moe.expert_weights.stacked(n) for n in ("w1", "v1", "w2"))
    x = x.detach()
    out, skipped = torch.zeros_like(x), 0
    for t in range(x.shape[0]):
        probs = (x[t] @ full_moe.router.layer.weight.detach().T).float().softmax(-1)
        weights, experts = probs.topk(full_moe.top_k)
        if normalize:
            weights = weights / weights.sum()
        mass = float(weights.sum())
        keep = [(float(w), int(e)) for w, e in zip(weights, experts) if int(e) in resident]
        skipped += full_moe.top_k - len(keep)
        kept_mass = sum(w for w, _ in keep)
        for w, e in keep:
            h = F.silu(x[t] @ w1[e].T) * (x[t] @ v1[e].T)
            out[t] += w * mass / kept_mass * (h @ w2[e])
    return out, skipped / (x.shape[0] * full_moe.top_k)


def test_skip_rule_keeps_the_top_k_mass_and_zeroes_tokens_with_no_resident_expert():
    top_w = torch.tensor([[0.5, 0.2], [0.3, 0.1], [0.6, 0.4]])
    resident = torch.tensor([[True, False], [False, False], [True, True]])
    out = resident_weights(top_w, resident)
    torch.testing.assert_close(out, torch.tensor([[0.7, 0.0], [0.0, 0.0], [0.6, 0.4]]))


@pytest.mark.parametrize("normalize", [False, True])
def test_partial_moe_matches_the_naive_skip_rule(normalize):
    full, part = models(normalize)
    x = torch.randn(40, 32)
    ours, stats = part.layers[0].mlp(x)
    expected, skip = naive_partial(full.layers[0].mlp, x, set(LOCAL), normalize)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    assert stats.skip_rate == pytest.approx(skip)
    assert 0 < skip < 1


def test_non_resident_experts_have_no_storage_and_the_router_sees_all_experts():
    full, part = models(False)

    def expert_bytes(m):
        tensors = [*m.named_parameters(), *m.named_buffers()]
        return sum(t.numel() for n, t in tensors if ".experts." in n and "slot_of_expert" not in n)

    per_expert = 3 * 48 * 32 * len(full.layers)
    assert expert_bytes(full) == 8 * per_expert
    assert expert_bytes(part) == len(LOCAL) * per_expert
    store = part.expert_modules()[0]
    assert store.resident_ids == LOCAL and store.absent_ids == [0, 2, 3, 5, 7] and store.frozen_w1.shape[0] == 0
    x = torch.randint(0, 97, (2, 16))
    out = part.loss(x, x)
    out.loss.backward()
    router_grad = part.layers[0].mlp.router.layer.weight.grad
    assert router_grad is not None and (router_grad.abs().sum(dim=1) > 0).all()  # every expert's logit trains
    assert len(part.skip_rates) == 2 and all(0 <= r <= 1 for r in part.skip_rates)


def test_partial_checkpoint_holds_its_experts_only_and_loads_into_a_full_model():
    full, part = models(False)
    with torch.no_grad():
        part.expert_modules()[0].local_w1.add_(1.0)
    state = part.state_dict()
    assert state["layers.0.mlp.experts.mlp.w1"].shape == (len(LOCAL) * 48, 32)
    assert state["layers.0.mlp.experts.mlp.resident_experts"].tolist() == LOCAL
    before = full.expert_modules()[0].stacked("w1")
    full.load_state_dict(state)
    after = full.expert_modules()[0].stacked("w1")
    torch.testing.assert_close(after[LOCAL], before[LOCAL] + 1.0)
    others = [e for e in range(8) if e not in LOCAL]
    assert torch.equal(after[others], before[others])  # experts not in the file are left alone
    with pytest.raises(ResidencyError, match="not resident"):
        part.expert_modules()[0].stacked("w1")


def test_partial_peer_taking_on_an_expert_keeps_its_weights_and_starts_the_new_one_empty():
    _, part = models(False)
    store = part.expert_modules()[0]
    w6 = store.local_w1[LOCAL.index(6)].detach().clone()
    part.set_local_experts([2, 6])
    assert store.resident_ids == [2, 6]
    assert torch.equal(store.local_w1[1], w6) and not store.local_w1[0].any()


def test_partial_residency_config_is_validated():
    assert load_config(None, ["swarm.residency=partial", "swarm.merge_interval=0"]).swarm.residency == "partial"
    with pytest.raises(ConfigError, match="merge_interval"):
        load_config(None, ["swarm.residency=partial"])
    with pytest.raises(ConfigError, match="residency"):
        load_config(None, ["swarm.residency=half"])
