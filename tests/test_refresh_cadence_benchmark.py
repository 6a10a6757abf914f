"""The refresh-cadence benchmark: its policies, what they refresh, the bytes they would save, one short run."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import comms, refresh_cadence
from benchmarks.lab import results
from p2p_spes.averaging.compression import Codec
from p2p_spes.config import load_config


def test_policies_parse_and_a_bad_name_says_what_is_accepted():
    assert refresh_cadence.Policy.parse("every") == refresh_cadence.Policy(1, False)
    assert refresh_cadence.Policy.parse("every-4") == refresh_cadence.Policy(4, False)
    assert refresh_cadence.Policy.parse("tokens-2") == refresh_cadence.Policy(2, True)
    assert refresh_cadence.Policy.parse("topk-5") == refresh_cadence.Policy(lone=5)
    assert refresh_cadence.Policy.parse("lone-8") == refresh_cadence.Policy(lone=8, synced=True)
    for bad in ("every-0", "sometimes-2", "tokens", "every-x", "topk-0", "topk-257", "lone-0", "lone"):
        with pytest.raises(ValueError, match="every, every-K or tokens-K"):
            refresh_cadence.Policy.parse(bad)


def test_topk_k_moves_every_copy_every_round_by_a_top_k_update_and_the_holder_keeps_the_rest():
    peers, experts = 2, 2
    refreshes = refresh_cadence.Refreshes(refresh_cadence.Policy(lone=2), experts, peers, even_share=10.0)
    models = [Copies(experts) for _ in range(peers)]
    for m in models:
        m.weights = [torch.zeros(512) for _ in range(experts)]
    lead = torch.linspace(-1, 1, 512)
    models[0].weights[0] = lead.clone()  # peer 0 trained expert 0; peer 1's copy starts where both began
    refreshes.apply(models)
    copy = models[1].weights[0]
    assert models[1].written == [0] and models[0].written == [1]  # each copy, never the holder
    assert int((copy != 0).sum()) == 2 * 2  # 2 values in each of the 2 blocks: the largest magnitudes
    assert set(torch.nonzero(copy).flatten().tolist()) == {0, 1, 510, 511}
    refreshes.apply(models)  # the holder did not move: the copy takes the next largest of what it lags
    assert int((models[1].weights[0] != 0).sum()) == 8
    assert refreshes.share == 1.0


def test_lone_k_moves_the_holder_with_its_copies_and_keeps_what_the_update_dropped():
    peers, experts = 2, 2
    refreshes = refresh_cadence.Refreshes(refresh_cadence.Policy(lone=2, synced=True), experts, peers, 10.0)
    models = [Copies(experts) for _ in range(peers)]
    for m in models:
        m.weights = [torch.zeros(512) for _ in range(experts)]
    lead = torch.linspace(-1, 1, 512)
    models[0].weights[0] = lead.clone()
    refreshes.apply(models)
    holder, copy = models[0].weights[0], models[1].weights[0]
    assert torch.equal(holder, copy)  # the holder takes the value its copies take
    assert set(torch.nonzero(copy).flatten().tolist()) == {0, 1, 510, 511}
    assert torch.equal(refreshes.residual[0] + copy, lead)  # nothing lost: the rest waits in the residual
    assert refreshes.share == 1.0 and models[1].written.count(0) == 1  # the holder is not counted a copy
    refreshes.apply(models)  # the holder trained no further: the residual's next largest values arrive
    assert torch.equal(models[0].weights[0], models[1].weights[0])
    assert int((models[1].weights[0] != 0).sum()) == 8
    assert torch.equal(refreshes.residual[0] + models[1].weights[0], lead)


class Copies:
    """A stand-in for a peer's model: which expert was written from where."""

    def __init__(self, experts: int) -> None:
        self.weights = [torch.full((2,), float(e)) for e in range(experts)]
        self.written: list[int] = []

    def expert_tensors(self, e: int) -> list[torch.Tensor]:
        return [self.weights[e]]

    def write_expert(self, e: int, tensors) -> None:
        self.weights[e] = tensors[0].clone()
        self.written.append(e)


def test_every_k_refreshes_every_frozen_copy_on_every_kth_round_and_nothing_between():
    peers, experts = 2, 4
    refreshes = refresh_cadence.Refreshes(refresh_cadence.Policy(2), experts, peers, even_share=10.0)
    models = [Copies(experts) for _ in range(peers)]
    models[0].weights[2] += 100  # expert 2 is peer 0's: its copy on peer 1 must follow it
    refreshes.apply(models)
    assert models[1].written == [] and models[0].written == []
    refreshes.apply(models)
    assert models[0].written == [1, 3] and models[1].written == [0, 2]  # the frozen ones, holders never
    assert torch.equal(models[1].weights[2], models[0].weights[2])
    assert refreshes.share == pytest.approx(0.5)


def test_tokens_k_refreshes_a_copy_once_its_router_sent_it_k_even_shares_and_starts_counting_again():
    peers, experts = 2, 4
    refreshes = refresh_cadence.Refreshes(refresh_cadence.Policy(2, tokens=True), experts, peers, even_share=10.0)
    models = [Copies(experts) for _ in range(peers)]
    refreshes.routed[1] = torch.tensor([25.0, 0.0, 19.0, 0.0])  # peer 1 used expert 0 a lot, expert 2 less
    refreshes.apply(models)
    assert models[1].written == [0] and models[0].written == []
    assert refreshes.routed[1].tolist() == [0.0, 0.0, 19.0, 0.0]
    refreshes.routed[1, 2] += 1.0
    refreshes.apply(models)
    assert models[1].written == [0, 2]
    assert refreshes.share == pytest.approx(2 / 8)  # 2 of 2 x 2 frozen copies x 2 rounds


def test_the_bytes_scale_only_the_copies_share_and_the_floor_follows():
    shared, expert, experts, peers = 1_000_000, 200_000, 8, 4
    codec = Codec("sparse")
    full = comms.ours(codec, shared, expert, experts, peers)
    half = comms.ours(codec, shared, expert, experts, peers, refreshed=0.5)
    copies = full["served"] + full["downloaded"]
    assert copies > 0 and half["total"] == pytest.approx(full["total"] - copies / 2)
    assert half["client_sent"] == full["client_sent"] and half["reducer_out"] == full["reducer_out"]
    floor, none_refreshed = (comms.serverless_floor(codec, shared, expert, experts, peers, r) for r in (1.0, 0.0))
    per_value = codec.body_bytes(256 * 256) / (256 * 256)
    assert floor - none_refreshed == pytest.approx(per_value * 2 * (peers - 1) / peers * experts * expert)
    projected = refresh_cadence.projection({"every": 1.0, "every-4": 0.25}, peer_counts=(4,))["4"]
    assert all(projected["every-4"][arm]["less"] > projected["every"][arm]["less"] for arm in refresh_cadence.CODECS)


def test_peers_start_alike_each_training_its_own_experts_and_the_run_model_takes_each_from_its_holder():
    cfg = load_config(None, refresh_cadence.common(10))
    models = refresh_cadence.build_peers(cfg, 4, seed=0)
    assert [m.local_experts for m in models] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert all(torch.equal(a, b) for a, b in zip(models[0].expert_tensors(5), models[1].expert_tensors(5)))
    with torch.no_grad():
        models[1].expert_tensors(5)[0].add_(1.0)  # peer 1 trains expert 5; peer 0's copy is stale
    run_model = refresh_cadence.assemble(cfg, models)
    assert torch.equal(run_model.expert_tensors(5)[0], models[1].expert_tensors(5)[0])
    assert not torch.equal(run_model.expert_tensors(5)[0], models[0].expert_tensors(5)[0])
    as_copies = refresh_cadence.assemble(cfg, models, copies=True)  # expert 5 as peer 2's copy holds it
    assert torch.equal(as_copies.expert_tensors(5)[0], models[2].expert_tensors(5)[0])
    assert not torch.equal(as_copies.expert_tensors(5)[0], models[1].expert_tensors(5)[0])


@pytest.mark.long  # three policies, two rounds each, twice: about a minute on 2 cores
def test_a_short_run_writes_curves_and_shares_merge(tmp_path, monkeypatch):
    monkeypatch.setenv(results.ROOT_ENV, str(tmp_path))
    common = ["--policies", "every", "every-2", "tokens-2", "--sync", "2", "--rounds", "2", "--eval-rounds", "1"]
    common += ["--val-windows", "32"]
    refresh_cadence.main([*common, "--seeds", "0", "--variant", "s0"])
    refresh_cadence.main([*common, "--seeds", "1", "--variant", "s1"])
    refresh_cadence.main(["--merge", "s0", "s1", "--variant", "both"])
    payload = json.loads(results.path("refresh_cadence", "both", base=tmp_path).read_text())
    assert payload["seeds"] == [0, 1] and payload["provenance"]["merged"]
    summary = payload["summary"]
    assert summary["every"]["refreshed_share"] == 1.0 and summary["every-2"]["refreshed_share"] == 0.5
    # the router's counts reach the policy: after two rounds some copies got two even shares, none did after one
    assert 0 < summary["tokens-2"]["refreshed_share"] <= 0.5
    assert sorted(summary["every-2"]["gaps"]) == ["0", "1"] and sorted(payload["runs"]["every"]["0"]["curve"]) == [
        "1",
        "2",
    ]
    # round 1 of every-2 trained against stale copies: its model is not every's
    assert payload["runs"]["every-2"]["0"]["curve"]["2"] != payload["runs"]["every"]["0"]["curve"]["2"]
    assert payload["spes_1b"]["4"]["every-2"]["sparse"]["less"] > payload["spes_1b"]["4"]["every"]["sparse"]["less"]


def _trained_peers(peers: int = 4) -> list:
    cfg = load_config(None, refresh_cadence.common(10))
    models = refresh_cadence.build_peers(cfg, peers, seed=0)
    with torch.no_grad():
        for i, m in enumerate(models):  # each peer's local steps moved its shared weights its own way
            gen = torch.Generator().manual_seed(i)
            for _, p in m.shared_parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=gen))
    return models


def _shared(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for _, p in model.shared_parameters()])


def test_shared_weights_through_a_codec_end_alike_and_exact_kinds_take_the_plain_mean():
    models = _trained_peers()
    mean = torch.stack([_shared(m) for m in models]).mean(0)
    embeddings = torch.cat(
        [torch.full((p.numel(),), refresh_cadence.kind_of(n) == "embeddings") for n, p in models[0].shared_parameters()]
    )
    assert 0 < embeddings.sum() < embeddings.numel()
    average = refresh_cadence.SharedAverage(Codec("topk", result_fraction=1 / 16), models, exact=("embeddings",))
    average(models)
    after = [_shared(m) for m in models]
    assert all(torch.equal(after[0], a) for a in after[1:])  # one result for every peer
    assert torch.allclose(after[0][embeddings], mean[embeddings], atol=1e-6)  # exact: the mean
    rest = ~embeddings
    assert not torch.allclose(after[0][rest], mean[rest], atol=1e-4)  # through topk: not the mean
    # what the codec dropped is kept, for the kinds it carried only
    assert all(r[embeddings].abs().max() == 0 and r[rest].abs().max() > 0 for r in average.residuals)


def test_shared_weights_with_every_kind_exact_are_the_plain_average():
    models, reference = _trained_peers(), _trained_peers()
    refresh_cadence.SharedAverage(Codec("topk", result_fraction=1 / 16), models, exact=refresh_cadence.KINDS)(models)
    refresh_cadence.average_shared(reference)
    assert torch.allclose(_shared(models[0]), _shared(reference[0]), atol=1e-6)


def test_exact_kinds_without_a_shared_codec_are_refused(capsys):
    with pytest.raises(SystemExit):
        refresh_cadence.main(["--exact", "embeddings", "--rounds", "1"])
    assert "--shared" in capsys.readouterr().err


def test_a_result_share_without_a_shared_codec_or_outside_the_members_is_refused(capsys):
    for argv, says in (
        (["--result", "8"], "--shared"),
        (["--shared", "topk-dense", "--result", "2"], "between the members' 4 and 256"),
        (["--shared", "topk-dense", "--result", "8", "--policies", "every", "lone-16"], "policy lone-16"),
    ):
        with pytest.raises(SystemExit):
            refresh_cadence.main([*argv, "--rounds", "1"])
        assert says in capsys.readouterr().err


def test_the_backlog_each_kind_holds_is_reported_by_kind():
    models = _trained_peers()
    average = refresh_cadence.SharedAverage(Codec("topk", result_fraction=1 / 16), models, exact=("rest",))
    average(models)
    assert set(average.backlog) == set(refresh_cadence.KINDS)
    embeddings, rest = average.backlog["embeddings"], average.backlog["rest"]
    assert embeddings["member_residual"] > 0 and embeddings["round_mean"] > 0
    assert rest["member_residual"] == 0 and rest["reducer_residual"] == 0 and rest["round_mean"] > 0


def test_by_rows_keeps_the_largest_rows_whole_at_two_bits():
    x = torch.zeros(8, 4)
    x[2] = torch.tensor([1.0, -0.5, 0.2, -1.0])
    x[5] = torch.tensor([3.0, 3.0, -3.0, 0.9])
    x[7] = 0.01
    out = refresh_cadence.by_rows(x.reshape(-1), 4, share=0.25).reshape(8, 4)
    assert torch.equal(torch.nonzero(out.abs().sum(1)).flatten(), torch.tensor([2, 5]))  # 2 of 8 rows, whole
    assert torch.allclose(out[2], torch.tensor([1.0, -1 / 3, 1 / 3, -1.0]))  # each value on a level x its row's max
    assert torch.allclose(out[5], torch.tensor([3.0, 3.0, -3.0, 1.0]))


def test_rank_one_carries_a_rank_one_matrix_whole_and_a_random_one_in_part():
    u, v = torch.randn(32), torch.randn(8)
    flat = torch.outer(u, v).reshape(-1)
    assert torch.allclose(refresh_cadence.rank_one(flat, 8), flat, atol=1e-5)
    noise = torch.randn(32 * 8, generator=torch.Generator().manual_seed(0))
    approx = refresh_cadence.rank_one(noise, 8)
    assert 0 < float((noise - approx).norm()) < float(noise.norm())


def test_structured_shared_weights_end_alike_with_the_head_near_its_rank_one_mean():
    models = _trained_peers()
    cfg = load_config(None, refresh_cadence.common(10))
    vocab, width = cfg.model.vocab_size, cfg.model.d_model
    direction = torch.randn(width, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():  # a head update that is rank one, as a softmax pushes every logit
        for i, m in enumerate(models):
            m.lm_head.weight.add_(torch.outer(torch.full((vocab,), 0.1 * (i + 1)), direction))
    before = _shared(models[0]).clone()
    average = refresh_cadence.SharedAverage(Codec("topk", result_fraction=1 / 16), models, structured=True)
    mean_head = torch.stack([m.lm_head.weight.detach().clone() for m in models]).mean(0)
    average(models)
    after = [_shared(m) for m in models]
    assert all(torch.equal(after[0], a) for a in after[1:]) and not torch.equal(after[0], before)
    # the head's rank-one mean moved whole, what the small random parts left is top-k's
    assert float((models[0].lm_head.weight - mean_head).norm()) < 0.1 * float(mean_head.norm())


def test_the_projection_has_no_bytes_where_a_policy_does_not_apply_and_structured_costs_about_topk_dense():
    projected = refresh_cadence.projection({"every": 1.0, "topk-5": 1.0}, peer_counts=(16,))["16"]
    assert projected["topk-5"]["int8"] is None and projected["topk-5"]["sparse"] is None
    lone, every = projected["topk-5"]["topk-dense"]["less"], projected["every"]["topk-dense"]["less"]
    assert lone > 50 > every  # the lone share is what takes topk-dense past 50x at 16 peers
    assert abs(projected["topk-5"]["structured"]["less"] / lone - 1) < 0.1
    # a smaller result share: fewer bytes for the shared weights, and every's copies at that share too
    fewer = refresh_cadence.projection({"every": 1.0, "lone-8": 1.0}, peer_counts=(16,), result=8)["16"]
    assert fewer["every"]["topk-dense"]["less"] == fewer["lone-8"]["topk-dense"]["less"] > every
    assert lone > fewer["lone-8"]["topk-dense"]["less"] > 50
