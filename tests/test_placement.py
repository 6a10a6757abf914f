"""Placement rules: SPES blocks for any number of peers, free data partitions, least-covered choice."""

from __future__ import annotations

from collections import Counter

import pytest

from p2p_spes.config import load_config
from p2p_spes.placement import free_partition, least_covered, spes_block


@pytest.mark.parametrize("peers,experts", [(1, 8), (2, 8), (3, 8), (4, 16), (5, 16), (8, 8), (4, 32), (7, 64)])
def test_spes_blocks_partition_the_experts(peers, experts):
    blocks = [spes_block(p, peers, experts) for p in range(peers)]
    assert sorted(e for b in blocks for e in b) == list(range(experts)), "every expert in exactly one block"
    sizes = [len(b) for b in blocks]
    assert max(sizes) - min(sizes) <= 1 and sizes[0] == min(sizes)
    for b in blocks:
        assert b == list(range(b[0], b[-1] + 1)), "blocks are contiguous"


def test_spes_block_is_the_papers_rule_when_peers_divide_experts():
    assert [spes_block(p, 4, 16) for p in range(4)] == [list(range(4 * p, 4 * p + 4)) for p in range(4)]


def test_more_peers_than_experts_replicate_every_expert():
    holders = Counter(e for p in range(16) for e in spes_block(p, 16, 8))
    assert holders == Counter({e: 2 for e in range(8)})


def test_three_local_peers_share_eight_experts():
    cfg = load_config("tiny", ["peer.count=3"])  # was refused: "peer.count (3) to divide moe.num_experts (8)"
    assert [cfg.experts_per_partition(p) for p in range(3)] == [2, 3, 3]
    assert sorted(e for p in range(3) for e in cfg.local_experts(p)) == list(range(8))
    cfg = load_config("tiny", ["peer.count=16"])
    assert [cfg.experts_per_partition(p) for p in range(16)] == [1] * 16


def test_replicas_raise_each_peers_share_to_that_many_holders_per_expert():
    shares = {
        (count, replicas): [
            load_config("tiny", [f"peer.count={count}", f"swarm.replicas={replicas}"]).experts_per_partition(p)
            for p in range(count)
        ]
        for count, replicas in ((4, 2), (3, 2), (2, 4), (16, 2), (16, 4))
    }
    assert shares[(4, 2)] == [4] * 4  # 16 expert copies over 4 peers
    assert shares[(3, 2)] == [6] * 3  # ceil(16 / 3)
    assert shares[(2, 4)] == [8] * 2  # at most every expert
    assert shares[(16, 2)] == [1] * 16  # 16 peers already give every expert 2 holders
    assert shares[(16, 4)] == [2] * 16


def test_spes_configs_give_each_partition_its_own_block():
    for name in ("spes-1b", "spes-7b"):
        cfg = load_config(name)
        assert cfg.experts.placement == "spes"
        blocks = [cfg.local_experts(p) for p in range(cfg.peer.count)]
        assert sorted(e for b in blocks for e in b) == list(range(cfg.moe.num_experts)), name


def test_free_partition():
    assert free_partition({}, 4) == 0
    assert free_partition({0: 1, 1: 1}, 4) == 2
    assert free_partition({0: 1}, 4, preferred=3) == 3
    assert free_partition({0: 1, 3: 1}, 4, preferred=3) == 1, "a taken preferred partition is not kept"
    assert free_partition({0: 2, 1: 1, 2: 1}, 3) == 1, "all taken: the least-read one"


def test_least_covered_spreads_racing_peers():
    picks = [least_covered({}, 8, 2, f"peer{i}") for i in range(4)]
    assert len({e for p in picks for e in p}) > 2, "ties are broken per peer, not all on experts 0-1"
    assert least_covered({0: 1, 1: 1, 2: 1}, 4, 1, "x") == [3]
