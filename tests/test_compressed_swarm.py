"""Compressed pseudo-gradient rounds on a loopback swarm: identical weights, delta refreshes, run-wide codec."""

from __future__ import annotations

import pytest
from helpers import SMALL, assert_identical_after_rounds, join_once, rounds, run_local_swarm

from p2p_spes.averaging.compression import Codec
from p2p_spes.averaging.transport import tensor_digest
from p2p_spes.checkpoint import find_checkpoint, load_checkpoint
from p2p_spes.config import load_config
from p2p_spes.local_swarm import LocalSwarm
from p2p_spes.model import MoETransformer

LONE = 5 / 256  # swarm.topk_lone_fraction of the "-lone" case


def checkpoint_digests(run_dir, local: list[int]) -> dict[str, str]:
    """The digest of every expert in a peer's newest checkpoint (its own ones and its frozen copies),
    and of its shared parameters (``shared``)."""
    cfg = load_config(None, SMALL)
    model = MoETransformer(cfg.model, cfg.moe, local_experts=local)
    load_checkpoint(find_checkpoint(run_dir), model)
    digests = {str(e): tensor_digest(model.expert_tensors(e)) for e in range(cfg.moe.num_experts)}
    return {**digests, "shared": tensor_digest([p.detach() for _, p in model.shared_parameters()])}


def expert_bytes() -> int:
    """fp32 bytes of one expert of the SMALL config (all layers)."""
    cfg = load_config(None, SMALL)
    model = MoETransformer(cfg.model, cfg.moe, local_experts=[0], device="meta")
    return sum(t.numel() for t in model.expert_tensors(0)) * 4


# the lone share's own path (k between the members' and the result's) is also in test_compression and
# test_delta_refresh: its swarm runs with the long tests, to keep the default suite near 15 minutes
LONE_SHARE = pytest.param("topk-lone", marks=pytest.mark.long)


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["topk", "int8", "topk-keep", "topk-dense", LONE_SHARE, "topk-int4", "sparse"])
def test_compressed_rounds_end_bit_identical_and_refresh_frozen_experts_by_delta(tmp_path, compression):
    # "-keep": swarm.keep_local_progress, each member's weights keep what its messages have not carried;
    # "-dense": swarm.topk_result_fraction 4/64, the groups' averaged parts (and updates served) denser;
    # "-lone": the same, with the lone holders' updates at swarm.topk_lone_fraction 5/256;
    # "-int4": the same, with the lone holders' updates in int4 (swarm.lone_compression);
    # sparse: reducers forward the members' messages (bundles), each value averaged over its senders
    lone = {"topk-lone": {"lone_fraction": LONE}, "topk-int4": {"lone_compression": "int4"}}.get(compression)
    dense = ["swarm.topk_result_fraction=0.0625"] if lone or compression.endswith("-dense") else []
    dense += [f"swarm.topk_lone_fraction={LONE}"] if compression == "topk-lone" else []
    dense += ["swarm.lone_compression=int4"] if compression == "topk-int4" else []
    compression = compression.removesuffix("-dense").removesuffix("-lone").removesuffix("-int4")
    compression, keep = compression.removesuffix("-keep"), compression.endswith("-keep")
    # warm-up merges at steps 20, 40 and 60: every peer merges the values all of them hold, and a lone
    # holder keeps its lead over them. Each peer trains its 3 of the 6 experts and no more: on a loaded
    # machine a peer whose record came late at two boundaries looked gone, and the other took over
    # one of its experts (then 2 holders averaged it, and the test's premise no longer held). 70 steps give
    # 7 boundaries: a peer that starts late under CI load still joins at least 4 rounds
    overrides = [
        "train.max_steps=70",
        "swarm.merge_interval=20",
        "swarm.max_experts_per_peer=3",
        f"swarm.compression={compression}",
        f"swarm.keep_local_progress={keep}",
        *dense,
    ]
    swarm = run_local_swarm(tmp_path, SMALL + overrides, peers=2)
    dirs = [tmp_path / f"peer{i}" for i in range(2)]
    # every member applies the same decoded average to the same anchor: bit-identical, checked by SHA-256
    # (what each publishes and serves: with keep_local_progress its weights run ahead of that anchor)
    assert_identical_after_rounds(dirs, min_common=3)
    summaries = swarm.summaries()
    for s, d in zip(summaries, dirs):
        assert s["rounds_joined"] >= 4 and s["updates_refused"] == 0
        # top-k sends 1/64 of the shared pseudo-gradient per round (the rest follows through error
        # feedback): in 4-7 rounds it has averaged less of the peers' progress than int8
        assert s["final_val_loss"] < s["first_train_loss"] - {"topk": 0.2, "sparse": 0.2, "int8": 0.5}[compression]
        # each peer holds the other's 3 experts frozen. Once both have averaged together once, their copies
        # are the groups' anchors and every refresh comes as an encoded average (before, a joiner's experts
        # may have moved while their copies here were still at the seeded values: those come whole, once)
        records = sorted(rounds(d).items())
        first = min(n for n, r in records if r["outcome"] == "averaged")
        later = [r for n, r in records if n > first]
        assert later and all(r["refreshed_by_delta"] == r["refreshed"] == 3 for r in later), [
            (r["refreshed"], r["refreshed_by_delta"]) for r in later
        ]
        assert s["delta_refreshes"] >= 3 * len(later)
        # anchors (shared + 3 own experts) and the residual of what our shared messages dropped, on the
        # CPU; the experts each peer holds alone keep none: their anchors trail the weights instead
        memory = s["sync_memory"]
        assert memory["device"] == "cpu" and memory["anchors"] > 3 * expert_bytes()
        # keeping its progress, a member carries what its shared messages dropped in its weights instead
        assert memory["residuals"] == (0 if keep else memory["anchors"] - 3 * expert_bytes())
    # a lone holder trains on its own weights, never on what the codec carried of them: its checkpoint
    # holds experts ahead of the copies the other peer follows, which are the version it published
    last = [rounds(d)[max(rounds(d))] for d in dirs]
    held = [checkpoint_digests(d, s["local_experts"]) for d, s in zip(dirs, summaries)]
    # the shared parameters: one published anchor; with keep_local_progress, two sets of weights
    assert last[0]["shared_digest"] == last[1]["shared_digest"]
    assert (held[0]["shared"] != held[1]["shared"]) == keep
    for me, other in ((0, 1), (1, 0)):
        for e in map(str, summaries[me]["local_experts"]):
            assert held[other][e] == last[me]["expert_digests"][e] == last[other]["expert_digests"][e]
            assert held[me][e] != held[other][e], f"expert {e}: the holder's weights are not ahead of its anchor"
        # a lone holder's update is a group of one's result: 4 of 256 values a block under topk (0.007 of
        # fp32, and the framing), 16 with topk_result_fraction 4/64 (0.022); under sparse a bundle of its
        # one message, 64 of 4,096 values a chunk (0.008)
        topk = 0.14 if lone and "lone_compression" in lone else 0.03 if dense else 0.012  # int4: 0.127
        limit = {"topk": topk, "sparse": 0.012, "int8": 0.3}[compression] * 3 * expert_bytes()
        downloaded = [r["traffic"]["downloading"][1] for r in later]
        assert all(d < limit for d in downloaded), (
            f"refreshes downloaded {downloaded} bytes, 3 whole experts are {3 * expert_bytes()}"
        )
        if lone:  # 3 updates in the lone codec (5 values a block, or int4), each with hivemind's framing:
            # under 256 bytes a message (~200 measured), far less than the 16 values a block of the result's
            codec, numel = Codec("topk", 1 / 64, 0.0625, **lone), expert_bytes() // 4
            update = codec.lone.wire_bytes(numel)
            assert all(3 * update <= d < 3 * (1.02 * update + 256) for d in downloaded), (downloaded, update)


@pytest.mark.slow
def test_a_peer_with_another_codec_is_refused_before_sending_anything(tmp_path):
    swarm = LocalSwarm(None, SMALL + ["train.max_steps=200", "swarm.compression=topk"], peers=1, run_dir=tmp_path)
    try:
        swarm.start()
        maddrs = swarm.wait_for_maddrs(0)
        proc = join_once(tmp_path / "other", maddrs, SMALL + ["swarm.compression=int8"])
    finally:
        swarm.stop()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "encodes its sync rounds differently" in proc.stderr, proc.stderr[-2000:]
    assert "compression topk (topk_fraction 0.015625) there, compression int8 here" in proc.stderr
    assert "run-wide" in proc.stderr
    assert (
        not (tmp_path / "other" / "metrics.jsonl").exists()
        or "sync_round" not in (tmp_path / "other" / "metrics.jsonl").read_text()
    )


@pytest.mark.slow
@pytest.mark.parametrize("compression", [pytest.param("none", marks=pytest.mark.long), "sparse"])
def test_experts_averaged_every_third_round_refresh_copies_only_then(tmp_path, compression):
    # swarm.expert_sync_rounds=3 over 7 rounds: the experts are averaged (and every frozen copy refreshed)
    # in rounds 3 and 6 and in the run's last, 7; the shared weights in every round
    overrides = [
        "train.max_steps=70",
        "swarm.merge_interval=20",
        "swarm.max_experts_per_peer=3",
        f"swarm.compression={compression}",
        "swarm.expert_sync_rounds=3",
    ]
    swarm = run_local_swarm(tmp_path, SMALL + overrides, peers=2)
    dirs = [tmp_path / f"peer{i}" for i in range(2)]
    assert_identical_after_rounds(dirs, min_common=3)
    summaries = swarm.summaries()
    for s, d in zip(summaries, dirs):
        records = rounds(d)
        assert max(records) == 7 and s["updates_refused"] == 0
        own = [str(e) for e in s["local_experts"]]
        for n, r in sorted(records.items()):
            synced = n in (3, 6, 7)
            assert r["experts_synced"] == synced, (n, r["experts_synced"])
            assert any(g.startswith("expert") for g in r["groups"]) == synced, (n, sorted(r["groups"]))
            if not synced and r["outcome"] == "averaged":
                # no expert moved for anyone: nothing to refresh or download, and what we publish for
                # our own experts is the value of the last round that averaged them (or merged them:
                # warm-up merges at rounds 2 and 4 move every peer's values alike)
                assert r["refreshed"] == 0 and r["traffic"].get("downloading", [0, 0])[1] == 0, n
                if n - 1 in records and r["merge_alpha"] is None:
                    previous = records[n - 1]["expert_digests"]
                    assert all(r["expert_digests"][e] == previous[e] for e in own), n
        # once both peers have averaged together, each refresh of the other's 3 experts comes as its
        # holder's encoded update, covering the rounds since the last
        first = min(n for n, r in records.items() if r["outcome"] == "averaged")
        later = [r for n, r in records.items() if n > first and r["experts_synced"]]
        assert later and all(r["refreshed"] == 3 for r in later), [r["refreshed"] for r in later]
        if compression == "sparse":
            assert all(r["refreshed_by_delta"] == 3 for r in later)
    # the last round averaged the experts: uncompressed, every copy is its holder's weights as trained
    last = [rounds(d)[7] for d in dirs]
    held = [checkpoint_digests(d, s["local_experts"]) for d, s in zip(dirs, summaries)]
    for me, other in ((0, 1), (1, 0)):
        for e in map(str, summaries[me]["local_experts"]):
            assert held[other][e] == last[me]["expert_digests"][e]
            assert (held[me][e] == held[other][e]) == (compression == "none"), e


def test_experts_due_every_kth_round_and_the_last():
    from p2p_spes.swarm.sync_round import experts_due

    assert [n for n in range(1, 11) if experts_due(3, n, last=n == 10)] == [3, 6, 9, 10]
    assert all(experts_due(1, n, last=False) for n in range(1, 5))


def test_expert_rounds_weigh_the_training_since_the_last_applied_group_and_keep_failures_flagged():
    """Every 3 rounds of 10 tokens: a holder's expert group is weighted by the 30 tokens its
    pseudo-gradient carries; an expert whose group failed carries its tokens on and stays flagged in
    the rounds that skip the experts (its holder serves a stale anchor there), until a group applies."""
    from p2p_spes.swarm.sync_round import ExpertCycle, experts_due

    cycle, weights, flagged = ExpertCycle(), [], []
    for n in range(1, 10):
        local = [0, 1] if n < 5 else [0, 1, 2]  # expert 2 taken over at round 5
        cycle.trained(local, 10.0)
        if experts_due(3, n, last=False):
            weights.append({e: cycle.weight(e) for e in local})
            cycle.averaged(local, failed={1} if n == 3 else ())
        flagged.append(sorted(cycle.failed))
    assert weights == [{0: 30.0, 1: 30.0}, {0: 30.0, 1: 60.0, 2: 20.0}, {0: 30.0, 1: 30.0, 2: 30.0}]
    assert flagged == [[]] * 2 + [[1]] * 3 + [[]] * 4
    cycle.trained([0], 10.0)  # experts 1 and 2 handed over: forgotten
    assert cycle.tokens == {0: 10.0} and cycle.weight(2) == 1e-6
