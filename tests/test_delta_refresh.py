"""Frozen experts refresh from their group's encoded average (swarm/agreement.py), in one process.

A holder's group moved expert 1 from the anchor A to the value V by the decoded average D:
V = A - D. A peer whose frozen copy is A downloads only the encoded D; one whose copy is anything
else, or who receives a corrupt update, downloads V whole.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import SMALL_MODEL

from dht.records import PeerRecord, VersionRecord
from p2p_spes.averaging.compression import Codec
from p2p_spes.averaging.transport import TransportError, tensor_digest
from p2p_spes.config import load_config
from p2p_spes.model import MoETransformer
from p2p_spes.swarm.agreement import Refresher
from p2p_spes.swarm.counters import SwarmCounters
from p2p_spes.swarm.outer import OuterOptimizer, flatten, split_like

EXPERT = 1


class FakeDownloader:
    """Serves what the holder's StateServer would: the encoded update and the whole expert."""

    def __init__(self, update: tuple[dict, list[torch.Tensor]], whole: list[torch.Tensor]) -> None:
        self.update_entry, self.whole, self.calls = update, whole, Counter()

    def update(self, peer, uid, digest, wire_bytes):
        self.calls["update"] += 1
        self.expected_bytes = wire_bytes
        assert uid == f"expert:{EXPERT}" and digest == self.update_entry[0]["digest"]
        return self.update_entry

    def download(self, peer, uid, like, attempts=4):
        self.calls["whole"] += 1
        assert uid.startswith(f"expert:{EXPERT}@")
        return {"digest": tensor_digest(self.whole)}, [t.clone() for t in self.whole]


def setup(codec: Codec, outer_optimizer: str = "average", lone: bool = False):
    """``lone``: the holder trains expert 1 alone, its update one message in ``codec.lone``."""
    cfg = load_config(None, SMALL_MODEL + [f"swarm.outer_optimizer={outer_optimizer}"])
    torch.manual_seed(0)
    model = MoETransformer(cfg.model, cfg.moe, local_experts=[0])  # expert 1 is frozen here
    anchor = flatten(model.expert_tensors(EXPERT))
    average = torch.randn(anchor.numel()) * 1e-3
    messages = [codec.encode(c) for c in torch.tensor_split(average, 3)]  # three reducers' parts
    if lone:
        messages = [codec.alone(average)]
    decoded = codec.lone.decode(messages[0], anchor.numel()) if lone else codec.decode_parts(messages, anchor.numel())
    holder = OuterOptimizer(cfg.swarm)
    holder.set_anchor(f"expert:{EXPERT}", anchor.clone(), 3)
    value = holder.step(f"expert:{EXPERT}", decoded, 4)
    tensors = [t.clone() for t in split_like(value, model.expert_tensors(EXPERT))]
    digest = tensor_digest(tensors)
    update = ({"digest": digest, "base": tensor_digest([anchor]), "parts": len(messages)}, messages)
    peers = {"holder": PeerRecord("holder", [EXPERT], 40, 4, "fp", [])}
    versions = {"holder": VersionRecord("holder", True, "s", {EXPERT: digest}, {})}
    return cfg, model, FakeDownloader(update, tensors), peers, versions, digest


@pytest.mark.parametrize("name", ["int8", "topk"])
def test_a_copy_at_the_anchor_takes_the_encoded_average_only(name):
    codec = Codec(name)
    cfg, model, downloader, peers, versions, digest = setup(codec)
    stats = SwarmCounters()
    refresher = Refresher("me", downloader, stats, OuterOptimizer(cfg.swarm), codec)
    fetched, missed = refresher.refresh(model, peers, [EXPERT], versions, versions)
    assert (fetched, missed) == (1, 0)
    assert downloader.calls == Counter(update=1), "the whole expert was downloaded"
    assert tensor_digest(model.expert_tensors(EXPERT)) == digest, "not bit-identical to the holder's value"
    assert stats.delta_refreshes == 1
    # the update is a small fraction of the expert it rebuilds
    update_bytes = sum(len(m) for m in downloader.update_entry[1])
    assert update_bytes < {"int8": 0.3, "topk": 0.05}[name] * 4 * flatten(model.expert_tensors(EXPERT)).numel()
    # already at the agreed version: nothing to fetch at all
    assert refresher.refresh(model, peers, [EXPERT], versions, versions) == (0, 0)
    assert downloader.calls == Counter(update=1)


@pytest.mark.parametrize("lone", [{"lone_compression": "int4"}, {"lone_fraction": 5 / 256}, {}])
def test_a_lone_holders_update_in_its_own_codec_is_taken_by_delta_and_given_time_for_its_size(lone):
    """A lone holder's update comes as one message in the lone codec (``swarm.lone_compression`` or
    ``topk_lone_fraction``): the copy decodes it with the run's result codec and asks for it with a time
    limit counted for at least its size, not for the (smaller) top-k result's."""
    codec = Codec("topk", 1 / 64, 4 / 64, **lone)
    cfg, model, downloader, peers, versions, digest = setup(codec, lone=True)
    refresher = Refresher("me", downloader, SwarmCounters(), OuterOptimizer(cfg.swarm), codec.result)
    assert refresher.refresh(model, peers, [EXPERT], versions, versions) == (1, 0)
    assert downloader.calls == Counter(update=1), "the whole expert was downloaded"
    assert tensor_digest(model.expert_tensors(EXPERT)) == digest
    message = downloader.update_entry[1][0]
    assert downloader.expected_bytes >= message.numel()
    numel = flatten(model.expert_tensors(EXPERT)).numel()
    assert (message.numel() > codec.result.wire_bytes(numel)) == ("lone_compression" in lone)


def test_a_copy_off_the_anchor_downloads_the_whole_expert_once():
    codec = Codec("topk")
    cfg, model, downloader, peers, versions, digest = setup(codec)
    with torch.no_grad():
        model.expert_tensors(EXPERT)[0].add_(1e-3)  # not the group's anchor any more
    stats = SwarmCounters()
    refresher = Refresher("me", downloader, stats, OuterOptimizer(cfg.swarm), codec)
    assert refresher.refresh(model, peers, [EXPERT], versions, versions) == (1, 0)
    assert downloader.calls == Counter(update=1, whole=1)
    assert tensor_digest(model.expert_tensors(EXPERT)) == digest
    assert stats.delta_refreshes == 0


def test_a_corrupt_update_is_refused_and_the_expert_downloaded_whole():
    codec = Codec("int8")
    cfg, model, downloader, peers, versions, digest = setup(codec)
    meta, messages = downloader.update_entry
    bad = messages[1].clone()
    bad[-1] ^= 0x01
    downloader.update_entry = (meta, [messages[0], bad, messages[2]])
    sizes = [len(c) for c in torch.tensor_split(flatten(model.expert_tensors(EXPERT)), 3)]
    with pytest.raises(TransportError, match="checksum"):
        codec.decode(bad, sizes[1])
    refresher = Refresher("me", downloader, SwarmCounters(), OuterOptimizer(cfg.swarm), codec)
    assert refresher.refresh(model, peers, [EXPERT], versions, versions) == (1, 0)
    assert downloader.calls["whole"] == 1, "the corrupt update was applied instead of refused"
    assert tensor_digest(model.expert_tensors(EXPERT)) == digest


def test_nesterov_needs_the_momentum_before_a_delta_refresh():
    """The Nesterov step of a frozen copy needs the holders' momentum: without it the expert comes whole."""
    codec = Codec("int8")
    cfg, model, downloader, peers, versions, _ = setup(codec, "nesterov")
    refresher = Refresher("me", downloader, SwarmCounters(), OuterOptimizer(cfg.swarm), codec)
    refresher.outer.fetch_momentum = lambda *args: None  # the holder serves no momentum here
    assert refresher.refresh(model, peers, [EXPERT], versions, versions) == (1, 0)
    assert downloader.calls["whole"] == 1


def test_a_copy_follows_the_holder_whose_group_succeeded():
    """The chaos run's second case: expert 1's holders are A, whose group failed (it kept values nobody
    agreed on), and B, whose group succeeded alone. A's digest is the larger, which a 1-1 tie would
    pick; every frozen copy must follow B's, the version its group agreed on."""
    codec = Codec("none")
    _, model, downloader, _, _, digest = setup(codec)
    failed_digest = "f" * 64  # larger than any hex digest of B's
    peers = {p: PeerRecord(p, [EXPERT], 40, 4, "fp", []) for p in ("A", "B")}
    versions = {
        "A": VersionRecord("A", True, "s", {EXPERT: failed_digest}, failed=frozenset({EXPERT})),
        "B": VersionRecord("B", True, "s", {EXPERT: digest}),
    }
    asked = []
    download = downloader.download
    downloader.download = lambda peer, uid, like, attempts=4: asked.append((peer, uid)) or download(peer, uid, like)
    assert Refresher("me", downloader, SwarmCounters()).refresh(model, peers, [EXPERT], versions, versions) == (1, 0)
    assert asked == [("B", f"expert:{EXPERT}@{digest}")], "the copy followed the holder whose group failed"
    assert tensor_digest(model.expert_tensors(EXPERT)) == digest
