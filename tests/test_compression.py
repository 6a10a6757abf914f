"""Codecs for pseudo-gradients (p2p_spes/averaging/compression.py): round trips, refusals, error feedback."""

from __future__ import annotations

import hashlib

import pytest
import torch

from p2p_spes.averaging.compression import BLOCK, CODECS, HEADER_BYTES, Codec
from p2p_spes.averaging.error_feedback import ErrorFeedback
from p2p_spes.averaging.transport import TransportError
from p2p_spes.swarm.compat import describe_sync, sync_settings

SIZES = [1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17, 20_000]


def reseal(message: torch.Tensor) -> torch.Tensor:
    """``message`` with its checksum recomputed: a well-formed envelope around a body we tampered with."""
    raw = bytearray(message.numpy().tobytes())
    raw[24:HEADER_BYTES] = hashlib.blake2b(bytes(raw[:24]) + bytes(raw[HEADER_BYTES:]), digest_size=8).digest()
    return torch.frombuffer(raw, dtype=torch.uint8)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("numel", SIZES)
def test_round_trip_size_and_error(name, numel):
    torch.manual_seed(numel)
    x = torch.randn(numel) * 0.02
    codec = Codec(name)
    message = codec.encode(x)
    assert message.dtype == torch.uint8 and len(message) == codec.wire_bytes(numel)
    y = codec.decode(message, numel)
    assert y.shape == x.shape and y.dtype == torch.float32
    rows = torch.nn.functional.pad(x, (0, (-numel) % BLOCK)).view(-1, BLOCK)
    absmax = rows.abs().amax(dim=1).repeat_interleave(BLOCK)[:numel]
    if name == "none":
        assert torch.equal(x, y)
    elif name == "fp16":
        torch.testing.assert_close(y, x.half().float())
    elif name == "sparse":  # its chunks, bins and bundles: tests/test_sparse.py
        assert int((y != 0).sum()) <= codec.k * -(-numel // 4096)
    elif name in ("int8", "int4"):
        levels = 127 if name == "int8" else 7
        # half a quantization step, plus the fp16 rounding of the block's scale
        assert ((x - y).abs() <= absmax / levels * 0.5 * 1.01 + 1e-7).all()
    else:
        k = codec.k
        for b, row in enumerate(rows):
            length = min(BLOCK, numel - b * BLOCK)
            kept = y[b * BLOCK : b * BLOCK + length].nonzero().flatten()
            largest = row[:length].abs().topk(min(k, length)).indices.sort().values
            assert torch.equal(kept, largest), f"block {b} kept other positions than its {k} largest"
            scale = row[:length].abs().max()
            # each kept value lands on the nearest of +-1/3, +-1 x scale: within a third of the scale
            assert ((y[b * BLOCK + kept] - row[kept]).abs() <= scale / 3 * 1.01 + 1e-7).all()


def test_top_k_sends_the_advertised_share():
    codec = Codec("topk", topk_fraction=1 / 64)
    assert codec.k == 4
    bits = 8 * codec.wire_bytes(1 << 20) / (1 << 20)
    # 4 positions (1 byte each), 4 values at 2 bits and a 2-byte scale per 256 values: 0.22 bits a value
    assert bits == pytest.approx((4 * 8 + 4 * 2 + 16) / 256, rel=0.01)
    assert 32 / bits > 140, "at least 140x fewer bits than fp32"


@pytest.mark.parametrize("name", CODECS)
def test_corrupt_truncated_or_foreign_messages_are_refused(name):
    codec = Codec(name)
    x = torch.randn(1000)
    message = codec.encode(x)
    flipped = message.clone()
    flipped[-1] ^= 0x40
    with pytest.raises(TransportError, match="checksum"):
        codec.decode(flipped, 1000)
    with pytest.raises(TransportError, match="truncated"):
        codec.decode(message[:-3], 1000)
    with pytest.raises(TransportError, match="shorter than its header"):
        codec.decode(message[:10], 1000)
    with pytest.raises(TransportError, match="values"):
        codec.decode(message, 999)
    bad_magic = message.clone()
    bad_magic[0] = ord("X")
    with pytest.raises(TransportError, match="magic"):
        codec.decode(bad_magic, 1000)
    other = Codec("int8" if name != "int8" else "int4")
    with pytest.raises(TransportError, match=f"compressed with {name}"):
        other.decode(message, 1000)
    with pytest.raises(TransportError, match="uint8"):
        codec.decode(message.view(torch.int8), 1000)


def test_well_sealed_but_invalid_bodies_are_refused():
    """A sender that computes the checksum over a bad body still gets refused by the body checks."""
    x = torch.randn(2 * BLOCK)
    topk = Codec("topk")
    message = topk.encode(x)
    scales = 2 * 2  # two fp16 scales, then the positions
    swapped = message.clone()
    start = HEADER_BYTES + scales
    swapped[start], swapped[start + 1] = message[start + 1], message[start]
    with pytest.raises(TransportError, match="out of order or repeated"):
        topk.decode(reseal(swapped), 2 * BLOCK)
    inf_scale = message.clone()
    inf_scale[HEADER_BYTES : HEADER_BYTES + 2] = torch.tensor([float("inf")], dtype=torch.float16).view(torch.uint8)
    with pytest.raises(TransportError, match="scales"):
        topk.decode(reseal(inf_scale), 2 * BLOCK)
    int8 = Codec("int8")
    message = int8.encode(x)
    message[HEADER_BYTES + scales] = 0x80  # -128: outside the symmetric range the encoder uses
    with pytest.raises(TransportError, match="-128"):
        int8.decode(reseal(message), 2 * BLOCK)
    short = Codec("topk").encode(torch.randn(BLOCK + 2))  # the last block holds 2 values
    last = HEADER_BYTES + 2 * 2 + topk.k  # the first position of the last block
    short[last + 1] = 5  # in order, but past its length
    with pytest.raises(TransportError, match="past the end"):
        topk.decode(reseal(short), BLOCK + 2)


def test_parts_decode_in_tensor_split_order():
    codec = Codec("int8")
    x = torch.randn(1001)
    messages = [codec.encode(c) for c in torch.tensor_split(x, 3)]
    torch.testing.assert_close(
        codec.decode_parts(messages, 1001),
        torch.cat([codec.decode(m, len(c)) for m, c in zip(messages, torch.tensor_split(x, 3))]),
    )


@pytest.mark.parametrize("name", ["int4", "topk"])
def test_error_feedback_carries_exactly_what_was_dropped(name):
    """Over rounds, what was received plus what is still held back equals everything that was sent."""
    codec = Codec(name)
    feedback = ErrorFeedback(codec)
    torch.manual_seed(1)
    total_in = torch.zeros(3000, dtype=torch.float64)
    total_out = torch.zeros(3000, dtype=torch.float64)
    for _ in range(12):
        g = torch.randn(3000) * 0.01
        sent = feedback.compensate("shared", g)
        decoded = codec.decode(codec.encode(sent), 3000)
        feedback.settle("shared", sent, decoded)
        assert torch.equal(feedback.residual["shared"], sent - decoded), "the residual is what the message dropped"
        total_in += g.double()
        total_out += decoded.double()
    torch.testing.assert_close(total_out + feedback.residual["shared"].double(), total_in, atol=1e-5, rtol=0)
    if name == "topk":  # top-k of the compensated values: everything drips through within a few dozen rounds
        assert (total_out != 0).float().mean() > 0.15
    feedback.drop("shared")
    assert "shared" not in feedback.residual


def test_lossless_codec_keeps_no_residual():
    feedback = ErrorFeedback(Codec("none"))
    x = torch.randn(10)
    feedback.settle("shared", x, x)
    assert feedback.residual == {} and feedback.nbytes() == 0


def test_unknown_codec_and_bad_fraction_are_refused():
    with pytest.raises(ValueError, match="choose one of"):
        Codec("uint8")
    with pytest.raises(ValueError, match="topk_fraction"):
        Codec("topk", topk_fraction=0)


def test_a_denser_result_codec_is_topk_only_and_refused_by_the_members_codec():
    """``result_fraction``: a group's averaged parts keep more per block than a member's message; the
    two are told apart by the header's k, so a part decoded with the wrong one is refused."""
    codec = Codec("topk", 1 / 64, 4 / 64)
    assert (codec.k, codec.result.k) == (4, 16) and codec.result.result == codec.result
    assert Codec("topk").result == Codec("topk") and Codec("int8", result_fraction=0.5).result == Codec(
        "int8", result_fraction=0.5
    )
    torch.manual_seed(3)
    x = torch.randn(1000)
    message = codec.result.encode(x)
    kept = codec.result.decode(message, 1000)
    assert int((kept != 0).sum()) == 3 * 16 + min(16, 1000 - 3 * BLOCK)
    with pytest.raises(TransportError, match="k=16"):
        codec.decode(message, 1000)
    with pytest.raises(ValueError, match="topk_result_fraction"):
        Codec("topk", 1 / 64, 0.0)


def test_a_group_encodes_its_mean_at_k_per_member_up_to_the_result_share():
    """The mean of n top-k messages holds at most n x k values per block: a group of n encodes it at
    that, never past the result's k, and the result codec decodes every k from the members' to its
    own; other k, and other codecs, are refused as before."""
    codec = Codec("topk", 1 / 64, 4 / 64)
    assert [codec.result_for(n).k for n in (0, 1, 2, 3, 4, 16)] == [4, 4, 8, 12, 16, 16]
    assert Codec("topk").result_for(1) == Codec("topk") and Codec("int8").result_for(3) == Codec("int8")
    assert Codec("topk", 4 / 64, 1 / 64).result_for(1).k == 4  # a sparser result share: never above it
    torch.manual_seed(4)
    x = torch.randn(1000)
    for n in (1, 2, 3, 4):
        message = codec.result_for(n).encode(x)
        assert torch.equal(codec.result.decode(message, 1000), codec.result_for(n).decode(message, 1000))
        assert int((codec.result.decode(message, 1000) != 0).sum()) == 3 * 4 * n + min(4 * n, 1000 - 3 * BLOCK)
    with pytest.raises(TransportError, match=r"k=4\.\.16"):
        codec.result.decode(Codec("topk", 2 / 256).encode(x), 1000)  # sparser than any member sends
    with pytest.raises(TransportError, match=r"k=4\.\.16"):
        codec.result.decode(Codec("topk", 32 / 256).encode(x), 1000)  # denser than the result
    with pytest.raises(TransportError, match=r"1001 \(k=4\.\.16\)"):
        codec.result.decode(codec.result_for(2).encode(x), 1000 + 1)
    with pytest.raises(TransportError, match="k=4\\)"):
        codec.decode(codec.result_for(2).encode(x), 1000)  # members' contributions stay at k
    with pytest.raises(TransportError, match="int8"):
        codec.result.decode(Codec("int8").encode(x), 1000)


def test_a_lone_holders_update_keeps_its_own_share_which_the_result_codec_decodes():
    """``lone_fraction``: a group of one (a lone holder's update, what its frozen copies download) keeps
    that share of each block, between the members' k and the result's, and the result codec decodes it
    as it decodes any group's part; without it, the result's share as before."""
    codec = Codec("topk", 1 / 64, 4 / 64, lone_fraction=5 / 256)
    assert (codec.k, codec.lone.k, codec.result.k) == (4, 5, 16)
    assert Codec("topk", 1 / 64, 4 / 64).lone == Codec("topk", 1 / 64, 4 / 64).result
    assert Codec("sparse", lone_fraction=0.5).lone == Codec("sparse").result  # a bundle of one message
    torch.manual_seed(5)
    x = torch.randn(1000)
    message = codec.alone(x)
    assert message.numel() == codec.lone.wire_bytes(1000) < codec.result.wire_bytes(1000)
    decoded = codec.result.decode(message, 1000)
    assert int((decoded != 0).sum()) == 3 * 5 + min(5, 1000 - 3 * BLOCK)
    assert torch.equal(decoded, codec.lone.decode(message, 1000))
    # the 5 kept are the largest of each block
    for b in range(3):
        block, kept = x[b * BLOCK : (b + 1) * BLOCK], decoded[b * BLOCK : (b + 1) * BLOCK] != 0
        assert set(kept.nonzero().flatten().tolist()) == set(block.abs().topk(5).indices.tolist())
    for bad in (2 / 256, 32 / 256, 0.063):  # below the members' share, above the result's (0.063: k 16, still above)
        with pytest.raises(ValueError, match="topk_lone_fraction"):
            Codec("topk", 1 / 64, 4 / 64, lone_fraction=bad)


@pytest.mark.parametrize("dense", ["int4", "int8", "fp16", "none"])
def test_a_lone_holders_update_in_a_dense_codec_which_the_result_codec_decodes(dense):
    """``lone_compression``: a group of one's result goes in that dense codec. Only a frozen copy's read
    of an update (``decode_update``) takes it, by its header; a reducer's or a member's read of a part
    refuses it (else a member could send values no top-k scale can carry), as does a run without it."""
    codec = Codec("topk", 1 / 64, 4 / 64, lone_compression=dense)
    assert codec.lone == Codec(dense) and codec.result.lone == Codec(dense)
    torch.manual_seed(6)
    x = torch.randn(1000)
    message = codec.alone(x)
    assert message.numel() == Codec(dense).wire_bytes(1000)
    expected = Codec(dense).decode(Codec(dense).encode(x), 1000)
    assert int((expected != 0).sum()) > 500  # dense (int4 rounds the smallest to 0), not top-k's 63
    assert torch.equal(codec.result.decode_update([message], 1000), expected)
    assert torch.equal(codec.lone.decode(message, 1000), expected)  # what the holder applies (a group of one)
    for reader in (codec, codec.result):  # members' contributions, a reducer's averaged parts
        with pytest.raises(TransportError, match=f"compressed with {dense}, this run uses topk"):
            reader.decode(message, 1000)
        with pytest.raises(TransportError, match=f"compressed with {dense}, this run uses topk"):
            reader.decode_parts([message], 1000)
    with pytest.raises(TransportError, match=f"compressed with {dense}, this run uses topk"):
        Codec("topk", 1 / 64, 4 / 64).result.decode_update([message], 1000)
    with pytest.raises(TransportError, match=f"compressed with {dense}"):  # one of several parts: a group's
        codec.result.decode_update([message, message], 2000)
    other = "int8" if dense != "int8" else "int4"
    with pytest.raises(TransportError, match=f"compressed with {other}"):
        codec.result.decode_update([Codec(other).encode(x)], 1000)
    with pytest.raises(TransportError, match="1001"):
        codec.result.decode_update([message], 1001)
    corrupt = message.clone()
    corrupt[-1] ^= 1
    with pytest.raises(TransportError, match="checksum"):
        codec.result.decode_update([corrupt], 1000)
    # a group's parts still decode as before
    parts = [codec.result.encode(x[:500]), codec.result.encode(x[500:])]
    assert torch.equal(codec.result.decode_update(parts, 1000), codec.result.decode_parts(parts, 1000))


def test_a_lone_codec_is_dense_and_only_under_topk():
    for bad in (
        {"name": "int8", "lone_compression": "int4"},  # not topk
        {"name": "topk", "lone_compression": "topk"},  # not dense
        {"name": "topk", "lone_compression": "sparse"},
        {"name": "topk", "result_fraction": 4 / 64, "lone_compression": "int4", "lone_fraction": 5 / 256},
    ):
        with pytest.raises(ValueError, match="lone_compression"):
            Codec(**bad)


def test_the_lone_codec_is_run_wide_but_absent_from_runs_that_leave_it_unset():
    from p2p_spes.errors import SwarmError
    from p2p_spes.swarm.compat import Ours, RunView, check_run

    plain = sync_settings("topk", 1 / 64, 0.0625)
    assert sync_settings("topk", 1 / 64, 0.0625, 1, 100, None, None) == plain
    assert sync_settings("topk", 1 / 64, 0.0625, 1, 100, None, "int4") != plain
    assert sync_settings("int8", 1 / 64, None, 1, 100, None, "int4") == sync_settings("int8", 1 / 64)
    assert describe_sync(sync_settings("topk", 1 / 64, 0.0625, 1, 100, None, "int4")) == (
        "compression topk (topk_fraction 0.015625) (topk_result_fraction 0.0625) (lone_compression int4)"
    )
    swarm = {"compression": "topk", "topk_fraction": 1 / 64, "topk_result_fraction": 0.0625}
    theirs = {"config": {"swarm": {**swarm, "lone_compression": "int4"}}, "hash": "h", "fingerprint": "fp"}
    ours = Ours("fp", {"moe": {}}, plain, "h")
    with pytest.raises(SwarmError, match=r"\(lone_compression int4\) there.*lone_compression"):
        check_run("r", "me", RunView({}, {"them": theirs}), ours)


def test_the_lone_share_is_run_wide_but_absent_from_runs_that_leave_it_unset():
    assert sync_settings("topk", 1 / 64, 0.0625, 1, 100, None) == sync_settings("topk", 1 / 64, 0.0625)
    assert sync_settings("topk", 1 / 64, 0.0625, 1, 100, 5 / 256) != sync_settings("topk", 1 / 64, 0.0625)
    assert describe_sync(sync_settings("topk", 1 / 64, 0.0625, 1, 100, 0.02)) == (
        "compression topk (topk_fraction 0.015625) (topk_result_fraction 0.0625) (topk_lone_fraction 0.02)"
    )
    from p2p_spes.errors import SwarmError
    from p2p_spes.swarm.compat import Ours, RunView, check_run

    swarm = {"compression": "topk", "topk_fraction": 1 / 64, "topk_result_fraction": 0.0625}
    theirs = {"config": {"swarm": {**swarm, "topk_lone_fraction": 0.02}}, "hash": "h", "fingerprint": "fp"}
    ours = Ours("fp", {"moe": {}}, sync_settings("topk", 1 / 64, 0.0625, 1, 100, None), "h")
    with pytest.raises(SwarmError, match=r"\(topk_lone_fraction 0.02\) there.*topk_lone_fraction"):
        check_run("r", "me", RunView({}, {"them": theirs}), ours)


def test_the_result_share_is_run_wide_but_absent_from_runs_that_leave_it_unset():
    """Peers compare ``sync_settings`` before averaging: a different result share is refused, and a run
    that does not set it publishes what peers which predate the setting publish."""
    assert sync_settings("topk", 1 / 64, None) == sync_settings("topk", 1 / 64)
    assert sync_settings("topk", 1 / 64, 0.0625) != sync_settings("topk", 1 / 64)
    assert sync_settings("int8", 1 / 64, 0.0625) == sync_settings("int8", 1 / 64)
    assert (
        describe_sync(sync_settings("topk", 1 / 64, 0.0625))
        == "compression topk (topk_fraction 0.015625) (topk_result_fraction 0.0625)"
    )


def test_the_experts_cadence_is_run_wide_but_absent_at_every_round():
    """Every K > 1 rounds, the run's last step is compared too (its round averages the experts whatever
    its number); every round, neither is, so peers that predate the setting still match."""
    assert sync_settings("sparse", 1 / 64, None, 1, 100) == sync_settings("sparse", 1 / 64)
    assert sync_settings("sparse", 1 / 64, None, None) == sync_settings("sparse", 1 / 64)
    assert sync_settings("none", 1 / 64, None, 4, 100) != sync_settings("none", 1 / 64)
    assert sync_settings("none", 1 / 64, None, 4, 100) != sync_settings("none", 1 / 64, None, 4, 90)
    assert (
        describe_sync(sync_settings("none", 1 / 64, None, 4, 100))
        == "compression none (expert_sync_rounds 4) (max_steps 100)"
    )


def test_a_peer_with_another_last_step_is_refused_when_experts_skip_rounds():
    """A peer that thinks another round is the run's last would open expert groups nobody else opens."""
    from p2p_spes.errors import SwarmError
    from p2p_spes.swarm.compat import Ours, RunView, check_run

    def ours(max_steps: int) -> Ours:
        return Ours("fp", {"moe": {}}, sync_settings("none", 1 / 64, None, 4, max_steps), "hash")

    def run_config(max_steps: int) -> dict:
        published = {"swarm": {"compression": "none", "expert_sync_rounds": 4}, "train": {"max_steps": max_steps}}
        return {"config": published, "hash": "hash", "fingerprint": "fp"}

    check_run("r", "me", RunView({}, {"them": run_config(100)}), ours(100))
    with pytest.raises(SwarmError, match=r"\(max_steps 90\) there, .*\(max_steps 100\) here\..*train\.max_steps"):
        check_run("r", "me", RunView({}, {"them": run_config(90)}), ours(100))


@pytest.mark.parametrize("k_share", [1 / 64, 4 / 64])
def test_a_sparse_last_block_names_only_its_own_positions(k_share):
    """A last block with fewer non-zero values than k (a mean of sparse messages, an expert no token
    reached) still decodes: the padding past its end is never among the positions sent."""
    codec = Codec("topk", k_share)
    for rest in (3, 40, 200):
        x = torch.zeros(2 * BLOCK + rest)
        x[:BLOCK] = torch.randn(BLOCK)
        x[2 * BLOCK + rest - 1] = 0.5  # one non-zero value in the last block
        out = codec.decode(codec.encode(x), x.numel())
        assert out[2 * BLOCK + rest - 1] == pytest.approx(0.5, rel=1e-3)
        zeros = codec.decode(codec.encode(torch.zeros(rest)), rest)  # nothing to send: the smallest scale
        assert zeros.abs().max() <= 2.0**-14


def test_a_set_feedback_decay_replaces_the_codecs_and_is_checked():
    """``swarm.feedback_decay``: the residual sent again is multiplied by it, under any lossy codec."""
    from p2p_spes.config import load_config
    from p2p_spes.errors import ConfigError

    x, sent, decoded = torch.ones(4), torch.full((4,), 2.0), torch.full((4,), 1.0)
    for codec, decay, expected in (
        (Codec("topk"), None, 2.0),
        (Codec("topk"), 0.5, 1.5),
        (Codec("sparse"), None, 1.95),
    ):
        feedback = ErrorFeedback(codec, decay)
        feedback.settle("u", sent, decoded)  # residual 1
        assert torch.allclose(feedback.compensate("u", x), torch.full((4,), expected))
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(ConfigError, match="swarm.feedback_decay must be in"):
            load_config(None, [f"swarm.feedback_decay={bad}"])
    assert load_config(None, ["swarm.feedback_decay=0.95"]).swarm.feedback_decay == 0.95
