"""The local-steps benchmark's compressed averaging: the swarm's two encodings, modelled in one process."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from benchmarks import local_steps
from benchmarks.lab import results
from p2p_spes.averaging.compression import BLOCK, Codec
from p2p_spes.config import load_config
from p2p_spes.model import MoETransformer
from p2p_spes.optim import trainable_parameters
from p2p_spes.swarm.outer import flatten, split_like

TINY = [
    "model.d_model=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.vocab_size=64",
    "model.max_seq_len=16",
    "moe.num_experts=2",
    "moe.top_k=1",
    "moe.ffn_dim=32",
]


def replicas(n: int, seed: int = 0) -> list[MoETransformer]:
    """``n`` copies of one initialisation, each then moved by its own random step."""
    cfg = load_config(None, TINY)
    models = [MoETransformer(cfg.model, cfg.moe, local_experts=[0, 1]) for _ in range(n)]
    models[0].init_weights(seed)
    torch.manual_seed(seed)
    with torch.no_grad():
        for m in models[1:]:
            m.load_state_dict(models[0].state_dict())
    return models


def step_apart(models: list[MoETransformer]) -> list[torch.Tensor]:
    with torch.no_grad():
        for m in models:
            for _, p in trainable_parameters(m):
                p.add_(torch.randn_like(p) * 0.01)
    return [flatten(p for _, p in trainable_parameters(m)) for m in models]


def weights(m: MoETransformer) -> torch.Tensor:
    return flatten(p for _, p in trainable_parameters(m))


def test_lossless_codec_gives_the_plain_mean():
    models = replicas(3)
    avg = local_steps.CompressedAverage(local_steps.Probe(3, 10, codec="none"), models[0])
    after = step_apart(models)
    avg.average(models)
    for m in models:
        torch.testing.assert_close(weights(m), torch.stack(after).mean(0), atol=1e-6, rtol=0)
    assert all(r.abs().max() == 0 for r in avg.residuals)


def test_one_stage_applies_the_mean_of_the_messages_and_keeps_what_they_dropped():
    models = replicas(3)
    anchor = weights(models[0])
    probe = local_steps.Probe(3, 10, codec="topk", restage=False)
    avg = local_steps.CompressedAverage(probe, models[0])
    after = step_apart(models)
    avg.average(models)
    codec = Codec("topk")
    decoded = [codec.decode(codec.encode(anchor - a), a.numel()) for a in after]
    torch.testing.assert_close(weights(models[1]), anchor - torch.stack(decoded).mean(0), atol=1e-6, rtol=0)
    for r, a, d in zip(avg.residuals, after, decoded):
        torch.testing.assert_close(r, (anchor - a) - d, atol=1e-6, rtol=0)


def test_two_stages_apply_at_most_k_values_per_block_and_the_reducer_keeps_the_rest():
    models = replicas(4)
    anchor = weights(models[0])
    avg = local_steps.CompressedAverage(local_steps.Probe(4, 10, codec="topk"), models[0])
    step_apart(models)
    avg.average(models)
    moved = anchor - weights(models[2])
    blocks = torch.nn.functional.pad(moved, (0, (-moved.numel()) % BLOCK)).view(-1, BLOCK)
    assert int((blocks != 0).sum(dim=1).max()) <= Codec("topk").k
    assert avg.reducer_residual.abs().sum() > 0


def test_sparse_averages_each_value_over_the_replicas_that_sent_it_with_decayed_feedback():
    """The swarm's forwarding codec: no mean re-encoded, each value the mean over its senders (a value
    one replica of three sent is not divided by three), and the residual decayed by the codec's 0.95."""
    models = replicas(3)
    anchor = weights(models[0])
    avg = local_steps.CompressedAverage(local_steps.Probe(3, 10, codec="sparse"), models[0])
    assert avg.decay == Codec("sparse").feedback_decay < 1
    after = step_apart(models)
    avg.average(models)
    codec = Codec("sparse")
    decoded = torch.stack([codec.decode(codec.encode(anchor - a), a.numel()) for a in after])
    senders = (decoded != 0).sum(0)
    expected = decoded.sum(0) / senders.clamp(min=1)
    torch.testing.assert_close(anchor - weights(models[1]), expected, atol=1e-6, rtol=1e-5)
    assert int((senders == 1).sum()) > 0  # some values came from one replica only, and were not divided
    torch.testing.assert_close(weights(models[0]), weights(models[2]), atol=0, rtol=0)
    assert avg.reducer_residual.abs().sum() == 0  # nothing re-encoded, so no reducer residual
    held = [r.clone() for r in avg.residuals]
    avg.average(models)  # no training in between: each replica sends its decayed residual
    for r, h in zip(avg.residuals, held):
        sent = avg.decay * h
        torch.testing.assert_close(r, sent - codec.decode(codec.encode(sent), h.numel()), atol=1e-7, rtol=0)


def test_random_k_moves_every_replica_on_the_same_k_positions_a_block_drawn_anew_each_round():
    models = replicas(4)
    anchor = weights(models[0])
    avg = local_steps.RandomK(local_steps.Probe(4, 10, codec="randk", random_k=20), models[0])
    step_apart(models)
    avg.average(models)
    first = avg.positions.clone()
    moved = anchor - weights(models[2])
    blocks = torch.nn.functional.pad(moved, (0, (-moved.numel()) % BLOCK)).view(-1, BLOCK)
    off = torch.ones_like(blocks, dtype=torch.bool).scatter_(1, first, False)
    assert not blocks[off].any()  # the mean and its re-encoding stay on the round's positions
    assert int((blocks != 0).sum(dim=1).max()) == 20
    for r in avg.residuals:  # each replica keeps everything off the positions, and a little on them
        r_blocks = torch.nn.functional.pad(r, (0, (-r.numel()) % BLOCK)).view(-1, BLOCK)
        assert r_blocks[off].abs().sum() > 0
    torch.testing.assert_close(weights(models[0]), weights(models[3]), atol=0, rtol=0)
    step_apart(models)
    avg.average(models)
    assert not torch.equal(avg.positions, first)


def test_decayed_feedback_scales_the_residual_it_adds():
    models = replicas(2)
    avg = local_steps.CompressedAverage(
        local_steps.Probe(2, 10, codec="topk", restage=False, feedback_decay=0.5), models[0]
    )
    step_apart(models)
    avg.average(models)
    held = [r.clone() for r in avg.residuals]
    anchor = avg.anchor.clone()
    # no training between two averages: what each replica sends is half of what it held back
    codec = Codec("topk")
    avg.average(models)
    for r, h in zip(avg.residuals, held):
        torch.testing.assert_close(r, 0.5 * h - codec.decode(codec.encode(0.5 * h), h.numel()), atol=1e-7, rtol=0)
    assert not torch.equal(avg.anchor, anchor)


def frozen_step(grad: torch.Tensor, frozen_v: torch.Tensor, floor: float) -> torch.Tensor:
    """The change one step of the probe's AdamW makes from zero state, its denominator frozen at ``frozen_v``."""
    p = torch.nn.Parameter(torch.zeros_like(grad))
    opt = local_steps.PooledNoiseAdamW([p], lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, floor=floor)
    p.grad = grad.clone()
    opt.step()  # creates the state; this first step is plain AdamW
    opt.state[p]["frozen_v"] = frozen_v.clone()
    before = p.detach().clone()
    p.grad = grad.clone()
    opt.step()
    return p.detach() - before


def test_a_frozen_denominator_makes_the_step_linear_in_the_gradient():
    """Two replicas stepping from the same state on their own gradients move, on average, as one replica
    on their mean gradient: what freezing the denominator is for."""
    torch.manual_seed(0)
    g1, g2, v = torch.randn(50), torch.randn(50), torch.rand(50) + 0.1
    mean_of_steps = (frozen_step(g1, v, 0.0) + frozen_step(g2, v, 0.0)) / 2
    assert torch.allclose(mean_of_steps, frozen_step((g1 + g2) / 2, v, 0.0), atol=1e-6)


def test_the_floor_caps_a_coordinate_whose_frozen_denominator_is_too_small():
    """Where the frozen second moment is near zero the step would be huge; the floor divides by
    ``floor`` x the replica's own second moment instead, elsewhere the frozen value stands."""
    g = torch.tensor([1.0, 1.0])
    frozen = torch.tensor([1e-12, 4.0])
    step = frozen_step(g, frozen, 0.25)
    # after two steps of the same gradient from zero state, m_hat = g and v_hat = g^2
    expected = -0.1 * g / torch.tensor([(0.25 * 1.0) ** 0.5, 4.0**0.5])
    assert torch.allclose(step, expected, atol=1e-6)
    assert frozen_step(g, frozen, 0.0)[0].abs() > 1e3  # no floor: the step the probes without one took


def test_spread_is_the_replicas_distance_from_their_mean_over_the_means_step():
    models = replicas(2)
    last = weights(models[0])
    direction = torch.randn_like(last)
    direction /= direction.norm()
    with torch.no_grad():  # both moved by 3 x direction, then apart by +-1 along another axis
        apart = torch.randn_like(last)
        apart -= (apart @ direction) * direction
        apart /= apart.norm()
        for m, sign in zip(models, (1.0, -1.0)):
            params = [p for _, p in trainable_parameters(m)]
            target = last + 3 * direction + sign * apart
            for p, v in zip(params, split_like(target, params)):
                p.copy_(v)
    distance, ratio = local_steps.replica_spread(models, last)
    assert abs(distance - 1) < 1e-4 and abs(ratio - 1 / 3) < 1e-4
    same = replicas(3)
    step_apart(same[:1])
    for m in same[1:]:
        m.load_state_dict(same[0].state_dict())
    assert max(local_steps.replica_spread(same, last)) < 1e-5  # the same steps: no spread, up to rounding in the mean


def test_each_arm_is_held_to_the_centralized_run_of_its_settings_and_the_default_batch():
    ran = {
        name: {0: 1.0}
        for name in (
            "centralized",
            "centralized-muon",
            "centralized-muon-4x",
            "centralized-muon-4x-b2",
            "centralized-sgd",
        )
    }
    assert local_steps.baseline("h50", ran) == "centralized"
    assert local_steps.baseline("h50-muon-4x", ran) == "centralized-muon-4x"
    assert local_steps.baseline("h50-muon-m98", ran) == "centralized-muon"  # its own centralized run did not run
    assert local_steps.baseline("h50-sgd", ran) == "centralized-sgd"
    # a larger batch for fewer steps is compared with the default batch on the same tokens
    assert local_steps.baseline("h25-muon-4x-b2", ran) == "centralized-muon-4x"
    assert local_steps.baseline("centralized-muon-4x-b2", ran) == "centralized-muon-4x"
    assert local_steps.baseline("h25-b2", ran) == "centralized"


def test_a_batch_multiple_reads_the_same_tokens_in_fewer_steps():
    for name, mult in (("h25-b2", 2), ("h12-muon-4x-b4", 4), ("centralized-b2", 2)):
        probe = local_steps.PROBES[name]
        assert probe.batch_mult == mult
        replicas_batch = local_steps.replica_batch(8, probe) * probe.replicas
        assert replicas_batch == 8 * local_steps.PEERS * mult  # per step; the run has steps / mult of them
    half = local_steps.PROBES["h100-muon-4x-b05"]
    assert (
        local_steps.replica_batch(8, half) == 4
        and local_steps.baseline("h100-muon-4x-b05", {"centralized-muon-4x": {0: 1.0}}) == "centralized-muon-4x"
    )
    assert local_steps.replica_batch(8, local_steps.PROBES["h50"]) == 8
    assert local_steps.replica_batch(8, local_steps.PROBES["centralized"]) == 8 * local_steps.PEERS


def test_a_batch_multiple_runs_for_as_many_times_fewer_steps_and_set_still_wins_otherwise():
    common = [*local_steps.convergence.schedule(400), "train.warmup_steps=7"]  # as main builds it, then a --set
    half = local_steps.probe_config(common, 400, local_steps.PROBES["h25-muon-4x-b2"], seed=3)
    assert (half.train.max_steps, half.train.warmup_steps, half.train.seed) == (200, 10, 3)
    double = local_steps.probe_config(common, 400, local_steps.PROBES["h100-muon-4x-b05"], seed=0)
    assert double.train.max_steps == 800
    plain = local_steps.probe_config(common, 400, local_steps.PROBES["h50"], seed=0)
    assert (plain.train.max_steps, plain.train.warmup_steps) == (400, 7)


def test_add_merges_only_this_scripts_own_runs_of_the_same_setup(tmp_path):
    args = argparse.Namespace(variant="main", steps=400, batch=8, extra=[])
    assert local_steps.previous_finals(args, base=tmp_path) == ({}, {}, [])  # nothing stored: nothing merged
    stored = {
        "steps": 400,
        "batch": 8,
        "overrides": [],
        "arms": {"h50": {"finals": {"0": 4.5}, "spread": {"0": [1, 2]}}},
    }
    results.write("local_steps", "main", stored, [0], argv=["--arms", "h50"], base=tmp_path)
    finals, spreads, merged = local_steps.previous_finals(args, base=tmp_path)
    assert finals == {"h50": {0: 4.5}} and spreads == {"h50": {0: [1, 2]}}
    assert [m.provenance["argv"][-2:] for m in merged] == [["--arms", "h50"]]
    with pytest.raises(SystemExit, match="400 steps of batch 8"):
        local_steps.previous_finals(argparse.Namespace(variant="main", steps=400, batch=16, extra=[]), base=tmp_path)
    # a file without provenance (merged from /tmp by hand, as the legacy main.json was) is refused
    (tmp_path / "local_steps" / "old.json").write_text(json.dumps(stored))
    with pytest.raises(SystemExit, match="no provenance"):
        local_steps.previous_finals(argparse.Namespace(variant="old", steps=400, batch=8, extra=[]), base=tmp_path)
