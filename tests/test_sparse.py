"""The ``sparse`` codec (p2p_spes/averaging/sparse.py): chunked top-k at 2 bits with bin means, the
bundle a reducer forwards (the mean over the senders of each value), its refusals, and the decaying
error feedback."""

from __future__ import annotations

import pytest
import torch
from test_compression import reseal

from p2p_spes.averaging.bitpack import pack12, unpack12
from p2p_spes.averaging.compression import BUNDLE, HEADER_BYTES, Codec
from p2p_spes.averaging.error_feedback import ErrorFeedback
from p2p_spes.averaging.sparse import CHUNK
from p2p_spes.averaging.transport import TransportError

SPARSE = Codec("sparse", 1 / 64)


def test_twelve_bit_positions_pack_two_in_three_bytes():
    values = torch.tensor([0, 4095, 17, 2048, 1, 4000, 7])
    packed = pack12(values)
    assert packed.numel() == 12 and torch.equal(unpack12(packed, 7), values)


@pytest.mark.parametrize("numel", [1, 63, CHUNK, CHUNK + 5, 3 * CHUNK + 1000])
def test_each_chunk_keeps_its_k_largest_decoded_through_its_bin_means(numel):
    torch.manual_seed(numel)
    x = torch.randn(numel) * 0.01
    k = SPARSE.k
    message = SPARSE.encode(x)
    assert message.numel() == SPARSE.wire_bytes(numel)
    y = SPARSE.decode(message, numel)
    for start in range(0, numel, CHUNK):
        chunk, got = x[start : start + CHUNK], y[start : start + CHUNK]
        largest = chunk.abs().topk(min(k, chunk.numel())).indices.sort().values
        assert torch.equal(got.nonzero().flatten(), largest), "a chunk kept other positions than its largest"
        kept = chunk[largest]
        # every kept value decodes to the mean of its bin: the same sign, four levels at most, and the
        # bins' means preserve the kept values' sum (each bin's sum is its mean times its count)
        assert (torch.sign(got[largest]) == torch.sign(kept)).all()
        assert got[largest].unique().numel() <= 4
        torch.testing.assert_close(got[largest].sum(), kept.sum(), rtol=1e-4, atol=1e-6)
        strong = kept.abs() >= kept.abs().mean()
        assert (got[largest][strong].abs().min() >= got[largest][~strong].abs().max()) if (~strong).any() else True


def test_a_message_costs_a_quarter_bit_a_value_and_a_bundle_of_p_is_p_messages():
    n = 1 << 20
    bits = 8 * SPARSE.wire_bytes(n) / n
    # per chunk of 4,096: 64 positions at 12 bits, 64 bins at 2 bits, four fp32 bin means
    assert bits == pytest.approx((64 * 14 + 4 * 32) / CHUNK, rel=0.01)
    assert 32 / bits > 120
    assert SPARSE.result.name == BUNDLE and SPARSE.forwards
    assert SPARSE.result.wire_bytes(n, 4) == HEADER_BYTES + 4 * (16 + SPARSE.wire_bytes(n))


def test_a_bundle_averages_each_value_over_the_members_that_sent_it():
    """Member 0 sends only position 5, member 1 positions 5 and 9 (one chunk, k large enough to hold
    what they sent, zeros elsewhere are not kept... so k is their count): position 9 comes from member 1
    alone and is not divided by two; position 5 is the weighted mean of both."""
    codec = Codec("sparse", 2 / CHUNK)  # k = 2 per chunk
    a, b = torch.zeros(CHUNK), torch.zeros(CHUNK)
    a[5], a[100] = 1.0, 0.5  # 2 kept: positions 5 and 100
    b[5], b[9] = 3.0, -2.0
    ma, mb = codec.encode(a), codec.encode(b)
    da, db = codec.decode(ma, CHUNK), codec.decode(mb, CHUNK)
    bundle = codec.result.bundle([ma, mb], [1.0, 3.0], CHUNK)
    y = codec.result.decode(bundle, CHUNK)
    torch.testing.assert_close(y[5], (1.0 * da[5] + 3.0 * db[5]) / 4.0)
    assert y[9] == db[9] and y[100] == da[100], "a value one member sent is that member's"
    assert int((y != 0).sum()) == 3
    # every member decodes the same bytes to the same bits
    assert torch.equal(y, codec.result.decode(bundle.clone(), CHUNK))
    assert torch.equal(Codec("sparse", 2 / CHUNK).result.decode(bundle, CHUNK), y)


def test_a_lone_holder_serves_a_bundle_of_its_own_message():
    x = torch.randn(5000)
    alone = SPARSE.alone(x)
    torch.testing.assert_close(SPARSE.result.decode(alone, 5000), SPARSE.decode(SPARSE.encode(x), 5000))
    with pytest.raises(ValueError, match="bundle"):
        SPARSE.result.encode(x)


def test_malformed_messages_and_bundles_are_refused():
    x = torch.randn(2 * CHUNK)
    message = SPARSE.encode(x)
    means = 16 * 2  # two chunks' bin means, then the packed positions
    swapped = message.clone()
    start = HEADER_BYTES + means
    swapped[start : start + 3] = pack12(torch.tensor([9, 3]))  # the first two positions, out of order
    with pytest.raises(TransportError, match="out of order"):
        SPARSE.decode(reseal(swapped), 2 * CHUNK)
    nan_mean = message.clone()
    nan_mean[HEADER_BYTES : HEADER_BYTES + 4] = torch.tensor([float("nan")]).view(torch.uint8)
    with pytest.raises(TransportError, match="bin means"):
        SPARSE.decode(reseal(nan_mean), 2 * CHUNK)
    short = SPARSE.encode(torch.randn(CHUNK + 100))  # the last chunk holds 100 values, keeps 64
    # its last two positions (the last three bytes of the positions, before 128 values' 2-bit bins):
    # 99 is above the 62nd of 64 positions among 100, and 150 is past the chunk's length
    end = HEADER_BYTES + 32 + 3 * 64
    short[end - 3 : end] = pack12(torch.tensor([99, 150]))
    with pytest.raises(TransportError, match="past the end"):
        SPARSE.decode(reseal(short), CHUNK + 100)
    with pytest.raises(TransportError, match="k="):
        Codec("sparse", 1 / 32).decode(message, 2 * CHUNK)  # another density: not this run's messages
    bundle = SPARSE.result.bundle([message, message], [1.0, 2.0], 2 * CHUNK)
    with pytest.raises(TransportError, match="truncated"):
        SPARSE.result.decode(bundle[:-1], 2 * CHUNK)
    negative = bundle.clone()
    negative[HEADER_BYTES : HEADER_BYTES + 8] = torch.tensor([-1.0], dtype=torch.float64).view(torch.uint8)
    with pytest.raises(TransportError, match="weight"):
        SPARSE.result.decode(reseal(negative), 2 * CHUNK)
    inner = bundle.clone()
    inner[-1] ^= 0x10  # the second message's last byte: its own checksum fails
    with pytest.raises(TransportError, match="checksum"):
        SPARSE.result.decode(reseal(inner), 2 * CHUNK)
    with pytest.raises(TransportError, match="compressed with sparse,"):
        SPARSE.result.decode(message, 2 * CHUNK)


def test_error_feedback_decays_what_it_carries():
    feedback = ErrorFeedback(SPARSE)
    assert feedback.decay == 0.95 and ErrorFeedback(Codec("topk")).decay == 1.0
    x = torch.randn(CHUNK)
    sent = feedback.compensate("g", x)
    assert torch.equal(sent, x)
    decoded = SPARSE.decode(SPARSE.encode(sent), CHUNK)
    feedback.settle("g", sent, decoded)
    torch.testing.assert_close(feedback.residual["g"], x - decoded)
    y = torch.randn(CHUNK)
    torch.testing.assert_close(feedback.compensate("g", y), y + 0.95 * (x - decoded))


def test_kept_zeros_decode_to_zero_and_are_no_vote_in_a_bundle():
    """A chunk with fewer than k non-zero values keeps zeros: they decode to 0 (not to the weak bin's
    mean), and a member whose chunk is all zeros does not halve the value another member sent."""
    x = torch.zeros(CHUNK)
    x[:5], x[5:10] = 1.0, 0.05
    y = SPARSE.decode(SPARSE.encode(x), CHUNK)
    assert int((y != 0).sum()) == 10 and torch.equal(y[:10], x[:10]), "a free bin holds the zeros"
    x[10:15], x[15:20] = -1.0, -0.05  # every bin used by a non-zero value: weak positives merge into strong
    y = SPARSE.decode(SPARSE.encode(x), CHUNK)
    assert int((y != 0).sum()) == 20 and torch.equal(y[10:20], x[10:20])
    torch.testing.assert_close(y[:10], torch.full((10,), 0.525))
    a, b = torch.zeros(CHUNK), torch.zeros(CHUNK)
    a[5] = 1.0
    ma, mb = SPARSE.encode(a), SPARSE.encode(b)
    bundle = SPARSE.result.bundle([ma, mb], [1.0, 1.0], CHUNK)
    assert SPARSE.result.decode(bundle, CHUNK)[5] == 1.0


def test_a_contribution_with_an_infinite_or_subnormal_weight_is_refused():
    message = SPARSE.encode(torch.randn(CHUNK))
    for weight in (float("inf"), 5e-324):
        with pytest.raises(TransportError, match="weight"):
            SPARSE.result.decode(SPARSE.result.bundle([message], [weight], CHUNK), CHUNK)
