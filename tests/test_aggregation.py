"""Robust aggregation rules: what one bad contribution can do to each of them."""

from __future__ import annotations

import pytest
import torch

from p2p_spes.averaging.aggregation import build_aggregator, centered_clip, trimmed_mean, weighted_mean
from p2p_spes.config import load_config
from p2p_spes.errors import ConfigError
from p2p_spes.swarm.outer import UpdateGuard


def honest_and_bad(n_honest: int, scale: float, seed: int = 0):
    torch.manual_seed(seed)
    base = torch.randn(5_000)
    honest = [base + 0.05 * torch.randn_like(base) for _ in range(n_honest)]
    return honest, torch.stack(honest).mean(0), [honest[0] * scale]


@pytest.mark.parametrize("scale", [10.0, 1e3, 1e6])
def test_one_bad_peer_moves_robust_rules_a_bounded_amount_and_the_mean_without_bound(scale):
    honest, truth, bad = honest_and_bad(4, scale)
    spread = max(float((h - truth).norm()) for h in honest)
    tensors = honest + bad
    mean_error = float((weighted_mean(tensors, [1.0] * 5) - truth).norm())
    assert mean_error > 0.1 * (scale - 1) * float(truth.norm())  # grows with the attack
    for result in (trimmed_mean(tensors, 0.2), centered_clip(tensors, 1.0, 5)):
        # the same bound whatever the scale: within the honest peers' own spread
        assert float((result - truth).norm()) < spread


def test_random_noise_peer_is_bounded_too():
    honest, truth, _ = honest_and_bad(3, 1.0)
    noise = [torch.randn_like(truth) * 1e4]
    spread = max(float((h - truth).norm()) for h in honest)
    for result in (trimmed_mean(honest + noise, 0.2), centered_clip(honest + noise)):
        assert float((result - truth).norm()) < spread


def test_robust_rules_agree_with_the_mean_when_everyone_is_honest_and_equal():
    same = [torch.arange(10.0)] * 4
    for rule in ("trimmed_mean", "centered_clip"):
        torch.testing.assert_close(build_aggregator(rule)(same, [1.0] * 4), torch.arange(10.0))


def test_trimmed_mean_of_three_is_the_median_and_small_groups_use_the_weighted_mean():
    a, b, c = torch.tensor([1.0, 5.0]), torch.tensor([2.0, -1.0]), torch.tensor([100.0, 0.0])
    torch.testing.assert_close(trimmed_mean([a, b, c]), torch.tensor([2.0, 0.0]))
    two = build_aggregator("trimmed_mean")([a, b], [1.0, 3.0])
    torch.testing.assert_close(two, weighted_mean([a, b], [1.0, 3.0]))


def test_aggregation_config_is_validated():
    assert load_config(None, ["swarm.aggregation=centered_clip"]).swarm.aggregation == "centered_clip"
    with pytest.raises(ConfigError, match="aggregation"):
        load_config(None, ["swarm.aggregation=median"])
    with pytest.raises(ConfigError, match="trim_fraction"):
        load_config(None, ["swarm.trim_fraction=0.5"])


def test_a_result_far_outside_the_recent_moves_or_not_finite_is_refused():
    guard = UpdateGuard(max_update_ratio=20.0)
    local = torch.ones(1000)
    for move in (0.01, 0.012, 0.009, 0.011):  # a run's ordinary rounds
        assert guard.implausible("shared", local, local * (1 + move)) is None
    assert guard.implausible("shared", local, local * 1.05) is None  # 5x: unusual, still accepted
    reason = guard.implausible("shared", local, local * 1000)
    assert reason and "recent median" in reason
    assert "not finite" in guard.implausible("expert", local, torch.full_like(local, float("nan")))
    assert guard.implausible("shared", local, local * 1.011) is None, "a refused move does not become typical"
    assert "recent median" in guard.implausible("shared", local, local * 1000)
    off = UpdateGuard(max_update_ratio=0.0)
    for move in (0.01, 0.012, 0.009):
        off.implausible("shared", local, local * (1 + move))
    assert off.implausible("shared", local, local * 1000) is None


def test_moves_that_grow_with_the_learning_rate_are_taken_when_our_own_training_moved_as_much():
    """Over a warm-up the rounds' moves grow many times; judged against the accepted moves alone, a peer
    refused every honest result once they outgrew 20x its first ones, and never took one again."""
    torch.manual_seed(0)
    anchor = torch.randn(1000)

    def honest_round(step: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Our weights after training from the anchor, and the group's average (ours among 4 members)."""
        deltas = [step * torch.randn(1000) for _ in range(4)]
        return anchor - deltas[0], anchor - torch.stack(deltas).mean(0)

    alone, guarded = UpdateGuard(max_update_ratio=20.0), UpdateGuard(max_update_ratio=20.0)
    for step in (1e-5, 1.2e-5, 0.9e-5):  # the first rounds, at the warm-up's tiny learning rate
        local, averaged = honest_round(step)
        assert alone.implausible("shared", local, averaged) is None
        assert guarded.implausible("shared", local, averaged, anchor) is None
    for step in (1e-3, 1.1e-3, 0.9e-3, 1e-3):  # the learning rate at its peak: 100x the first moves
        local, averaged = honest_round(step)
        assert "recent median" in alone.implausible("shared", local, averaged)  # refused, round after round
        assert guarded.implausible("shared", local, averaged, anchor) is None
    local, _ = honest_round(1e-3)
    reason = guarded.implausible("shared", local, local * 3, anchor)  # a poisoned result still is refused
    assert reason and "our own training's move" in reason
