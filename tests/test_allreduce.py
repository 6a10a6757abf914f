"""The group all-reduce on real hivemind DHTs in one process: exact means, identical copies, refusals."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from helpers import Dies, Peers
from hivemind.proto import averaging_pb2

from p2p_spes.averaging import allreduce
from p2p_spes.averaging.aggregation import build_aggregator
from p2p_spes.averaging.allreduce import HOLD, GroupAllReduce, weighted_mean
from p2p_spes.averaging.compression import Codec
from p2p_spes.averaging.matchmaking import ABORT_HOLD, DECISION_LAG
from p2p_spes.averaging.reducer import PartServer
from p2p_spes.averaging.transport import TransportError, TruncatedStream, parse_tensor, serialize_parts, tensor_digest

WINDOW = 2.0  # seconds a group stays open for members after the first one arrives (matchmaking_time)


@pytest.fixture(scope="module")
def dhts():
    peers = Peers()
    yield peers
    peers.close()


def run_group(
    peers, tensors, weights, compression, run_id, present=None, aggregate=None, kinds=None, timeouts=None, delays=None
):
    """Each present peer runs group "g" of round 0; ``delays`` (seconds, by index) hold a peer back first."""
    present = list(range(len(peers))) if present is None else present
    timeouts, delays = timeouts or {}, delays or {}
    dhts = peers.nodes
    kinds = kinds or {}

    async def main():
        reducers = []
        for i in present:
            p2p = peers.p2ps[i]
            reducer = kinds.get(i, GroupAllReduce)(
                dhts[i],
                p2p,
                dhts[i].peer_id.to_base58(),
                run_id,
                owner=peers.owners[i],
                compression=compression,
                matchmaking_time=WINDOW,
                timeout=10.0,
                aggregate=aggregate,
            )
            await reducer.start()
            reducers.append(reducer)
        expected = {dhts[i].peer_id.to_base58() for i in range(len(dhts))}

        async def member(r, i):
            await asyncio.sleep(delays.get(i, 0.0))
            return await r.run(0, "g", tensors[i], weights[i], expected, timeout=timeouts.get(i))

        return await asyncio.gather(*(member(r, i) for r, i in zip(reducers, present)))

    return peers.call(main())


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["none", "fp16", "int8", "int4", "topk"])
def test_members_end_bit_identical_with_the_weighted_mean(dhts, compression):
    torch.manual_seed(0)
    tensors = [torch.randn(10_001) for _ in range(len(dhts))]
    weights = [1.0, 2.0, 5.0]
    # a round can fail on a transport hiccup (under heavy load a libp2p stream sometimes closes
    # empty); it is then discarded by every member, as the swarm would, and the next round runs
    for attempt in range(3):
        results = run_group(dhts, tensors, weights, compression, run_id=f"t-{compression}-{attempt}")
        if all(r.ok for r in results):
            break
    assert all(r.ok for r in results), [r.error for r in results]
    assert all(len(r.members) == 3 for r in results)
    assert len({tensor_digest([r.tensor]) for r in results}) == 1, "copies differ after the round"
    expected = sum(w * t for w, t in zip(weights, tensors)) / sum(weights)
    if compression != "topk":  # top-k keeps 1/64 of the values: far from the mean, by design
        tolerance = {"none": 1e-6, "fp16": 2e-2, "int8": 0.1, "int4": 0.6}[compression]
        assert (results[0].tensor - expected).abs().max() < tolerance
    assert all(r.bytes_sent > 0 and r.bytes_received > 0 for r in results)
    # every member keeps the same encoded parts: they rebuild the result on their own
    codec = Codec(compression)
    assert all(torch.equal(codec.decode_parts(r.messages, 10_001), results[0].tensor) for r in results)
    if compression != "none":
        uncompressed = run_group(dhts, tensors, weights, "none", run_id=f"t-ref-{compression}")
        ratio = {"fp16": 0.6, "int8": 0.3, "int4": 0.2, "topk": 0.05}[compression]
        assert results[0].bytes_sent < uncompressed[0].bytes_sent * ratio


@pytest.mark.slow
def test_a_denser_result_carries_more_of_the_members_messages(dhts):
    """``swarm.topk_result_fraction``: the reducers encode the mean of three top-k messages (up to 3 x 4
    values per block) at 12 per block (k per member, the result's 16 at most), so the applied average
    carries all of them where the members' codec would keep 4; every member still applies the same
    bits, decoded with the result codec."""
    torch.manual_seed(1)
    tensors = [torch.randn(10_001) for _ in range(len(dhts))]
    codec = Codec("topk", 1 / 64, 4 / 64)
    for attempt in range(3):
        results = run_group(dhts, tensors, [1.0, 1.0, 1.0], codec, run_id=f"t-dense-{attempt}")
        if all(r.ok for r in results):
            break
    assert all(r.ok for r in results), [r.error for r in results]
    assert len({tensor_digest([r.tensor]) for r in results}) == 1, "copies differ after the round"
    assert all(torch.equal(codec.result.decode_parts(r.messages, 10_001), results[0].tensor) for r in results)
    # encoded at 12 a block: the codec of three contributions decodes every part (it refuses any other k)
    assert torch.equal(codec.result_for(3).decode_parts(results[0].messages, 10_001), results[0].tensor)
    topk = Codec("topk")  # each member encodes its tensor in one part per reducer
    sent = torch.stack(
        [torch.cat([topk.decode(topk.encode(c), len(c)) for c in torch.tensor_split(t, 3)]) for t in tensors]
    ).mean(0)
    # nothing of what the members sent is held back: the result is non-zero wherever the messages were
    # (a block whose mean holds fewer than 12 values is padded with others, at the codec's smallest level)
    assert bool((results[0].tensor[sent != 0] != 0).all())
    assert int((sent != 0).sum()) > 2 * topk.k * 3 * 13
    assert int((results[0].tensor != 0).sum()) <= codec.result_for(3).k * 3 * 14


class CutShort(PartServer):
    """A reducer whose streams end early, as hivemind's do when a connection closes: the first
    contribution it receives is cut after its first chunk, the second one is taken but its sender
    hears no OK (it sends again), and the first averaged part it serves stops after one chunk."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cuts = {"contribution": 1, "reply": 1, "part": 1}

    async def contribute(self, stream, context):
        messages = [m async for m in stream]
        if self.cuts["contribution"]:
            self.cuts["contribution"] -= 1
            messages = messages[:1]

        async def replay():
            for m in messages:
                yield m

        reply = await super().contribute(replay(), context)
        if self.cuts["reply"] and reply.code == averaging_pb2.AVERAGED_PART:
            self.cuts["reply"] -= 1
            raise ConnectionResetError("the reply was lost")
        return reply

    async def fetch(self, request, context):
        async for message in super().fetch(request, context):
            yield message
            if self.cuts["part"] and message.code == averaging_pb2.AVERAGED_PART:
                self.cuts["part"] -= 1
                return


@pytest.mark.slow
def test_a_stream_cut_short_is_sent_or_fetched_again(dhts):
    """Each stream the first member's reducer cuts costs a retry, not the round: every member ends
    with the exact mean and the same bits."""
    numel = 3 * 200_000  # each member's part is 800 kB: two stream chunks
    tensors = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(len(dhts))]
    cut: list[CutShort] = []

    def cut_short(*args, **kwargs) -> GroupAllReduce:
        reducer = GroupAllReduce(*args, **kwargs)
        reducer.server = CutShort(reducer.codec, reducer.aggregate, reducer.server.wait)
        cut.append(reducer.server)
        return reducer

    results = run_group(dhts, tensors, [1.0, 1.0, 2.0], "none", run_id="t-cut", kinds={0: cut_short})
    assert all(r.ok for r in results), [r.error for r in results]
    assert cut[0].cuts == {"contribution": 0, "reply": 0, "part": 0}, "a cut was not exercised"
    assert sum(r.retries for r in results) >= 3  # the cut contribution, the lost reply, the cut part
    assert len({tensor_digest([r.tensor]) for r in results}) == 1
    expected = (tensors[0] + tensors[1] + 2 * tensors[2]) / 4
    torch.testing.assert_close(results[0].tensor, expected)


@pytest.mark.slow
def test_absent_member_is_waited_for_only_until_the_window_closes(dhts):
    """The third expected member never comes: the two others wait out the 2 s join window (not the 10 s
    averaging timeout, nor matchmaking's own 12 s give-up) and then average between themselves."""
    tensors = [torch.ones(64) * i for i in range(3)]
    results = run_group(dhts, tensors, [1.0, 1.0, 1.0], "none", run_id="t-absent", present=[0, 1])
    assert all(r.ok for r in results)
    assert all(len(r.members) == 2 for r in results)
    torch.testing.assert_close(results[0].tensor, torch.full((64,), 0.5))
    seconds = [round(r.seconds, 2) for r in results]
    # the window opens at the first arrival; both arrive within a few DHT round-trips of each other
    assert max(seconds) >= WINDOW - 0.2, f"the absent member was not waited for: {seconds}"
    # window + the 0.5 s re-read that settles the member list + 1.5 s for DHT reads and a 64-float
    # all-reduce of two members on a loaded 2-core machine
    assert max(seconds) < WINDOW + 0.5 + 1.5, f"waited past the join window: {seconds}"


def test_non_finite_and_misshapen_tensors_are_refused():
    bad = torch.tensor([1.0, float("nan")])
    with pytest.raises(TransportError, match="NaN or infinite"):
        parse_tensor(serialize_parts(bad), (2,), torch.float32)
    with pytest.raises(TransportError, match=r"shape \(2,\) where \(3,\) was expected"):
        parse_tensor(serialize_parts(torch.ones(2)), (3,), torch.float32)
    with pytest.raises(TransportError, match="floating tensor"):
        parse_tensor(serialize_parts(torch.ones(2, dtype=torch.int64)), (2,), torch.float32)


def test_a_stream_that_ended_early_is_told_from_a_malformed_one():
    parts = serialize_parts(torch.ones(300_000))  # three chunks
    with pytest.raises(TruncatedStream, match="ended after 1048576 of its 1200000 bytes"):
        parse_tensor(parts[:2], (300_000,), torch.float32)
    with pytest.raises(TruncatedStream, match="empty"):
        parse_tensor([], (300_000,), torch.float32)
    assert torch.equal(parse_tensor(parts, (300_000,), torch.float32), torch.ones(300_000))


def test_weighted_mean():
    out = weighted_mean([torch.zeros(3), torch.ones(3)], [1.0, 3.0])
    torch.testing.assert_close(out, torch.full((3,), 0.75))


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["trimmed_mean", "centered_clip"])
def test_a_malicious_member_moves_robust_results_a_bounded_amount(dhts, rule):
    """Two honest peers and one sending its weights x1000 with a huge claimed token count: the mean
    is dragged away, the robust rules stay within the honest peers' spread."""
    torch.manual_seed(1)
    base = torch.randn(20_000)
    honest = [base + 0.01 * torch.randn_like(base) for _ in range(2)]
    honest_mean = (honest[0] + honest[1]) / 2
    spread = float((honest[0] - honest[1]).norm())
    tensors = honest + [1000 * honest[0]]
    weights = [1.0, 1.0, 1e6]
    outcome = {}
    for name, aggregate in (("mean", None), (rule, build_aggregator(rule))):
        for attempt in range(3):
            results = run_group(
                dhts, tensors, weights, "none", run_id=f"bad-{rule}-{name}-{attempt}", aggregate=aggregate
            )
            if all(r.ok for r in results):
                break
        assert all(r.ok for r in results), [r.error for r in results]
        assert len({tensor_digest([r.tensor]) for r in results}) == 1, "members must still agree bit for bit"
        outcome[name] = float((results[0].tensor - honest_mean).norm()) / spread
    assert outcome["mean"] > 1000, outcome  # plain averaging follows the attacker
    assert outcome[rule] < 1.0, outcome  # within the honest peers' own disagreement


class Hangs(PartServer):
    """The handlers of a SIGSTOPped process: nothing answers for longer than the group's deadline."""

    async def contribute(self, stream, context):
        await asyncio.sleep(15.0)
        return averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)

    async def fetch(self, request, context):
        await asyncio.sleep(15.0)
        yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)


class Freezes(Dies):
    """A member that joins and then stops answering: contributions to it and fetches from it hang
    (for longer than the group's deadline), as a SIGSTOPped process's would."""

    handlers = Hangs


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["dies", "freezes"])
def test_a_member_lost_mid_round_costs_the_others_a_retry_not_the_round(dhts, fault):
    """The third member joins and is then gone (refusing everyone at once) or frozen (answering nobody
    until after the 10 s deadline): the two others form the group again without it and end with
    their own weighted mean, bit-identical, reporting it lost."""
    tensors = [torch.randn(10_001, generator=torch.Generator().manual_seed(i)) for i in range(len(dhts))]
    lost = {"dies": Dies, "freezes": Freezes}[fault]
    results = run_group(dhts, tensors, [1.0, 3.0, 1.0], "none", run_id=f"t-lost-{fault}", kinds={2: lost})
    survivors, gone = results[:2], results[2]
    gone_id = dhts.nodes[2].peer_id.to_base58()
    assert not gone.ok and len(gone.members) == 3, "the lost member was not in the first attempt"
    assert all(r.ok for r in survivors), [r.error for r in survivors]
    assert all(r.attempts == 2 and r.lost == [gone_id] and len(r.members) == 2 for r in survivors), [
        (r.attempts, r.lost, r.members) for r in survivors
    ]
    assert len({tensor_digest([r.tensor]) for r in survivors}) == 1, "the survivors' copies differ"
    torch.testing.assert_close(survivors[0].tensor, (tensors[0] + 3 * tensors[1]) / 4)
    # the retry forms once the first attempt's 10 s deadline has passed for every member (counted from
    # up to DECISION_LAG after the window; a member that finished it would have said so by then; HOLD
    # more), then takes one more join window and its transfers
    limit = WINDOW + DECISION_LAG + 10.0 + HOLD + 2 * WINDOW + 3.0
    assert max(r.seconds for r in survivors) < limit, [round(r.seconds, 1) for r in survivors]


class KilledAfterJoining(GroupAllReduce):
    """A member whose process is gone (DHT, daemon and handlers) right after it wrote its arrival record:
    every dial to it then fails, as a SIGKILLed peer's would."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        node = self.dht

        class Dying:
            async def store(self, *args, **kwargs):
                await node.store(*args, **kwargs)
                await asyncio.get_running_loop().run_in_executor(None, node.shutdown)
                raise ConnectionAbortedError("killed after joining")

        self.dht = Dying()

    async def run(self, *args, **kwargs) -> allreduce.GroupResult:
        try:
            return await super().run(*args, **kwargs)
        except ConnectionAbortedError as exc:
            return allreduce.GroupResult(None, [], error=str(exc))


@pytest.mark.slow
def test_a_member_killed_before_the_transfers_costs_a_retry_that_does_not_wait_out_the_deadline():
    """Members 0 and 1 wait out the join window for a fourth peer that never comes; member 2 joins and
    its process is then gone. Their dials to it fail, so they know nobody can have finished the attempt:
    they form the retry ABORT_HOLD later, not after the 10 s deadline, and end with their own mean."""
    peers = Peers(4)
    try:
        tensors = [torch.randn(2_001, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        results = run_group(
            peers,
            tensors,
            [1.0, 3.0, 1.0],
            "none",
            run_id="t-killed",
            present=[0, 1, 2],
            kinds={2: KilledAfterJoining},
            delays={2: 0.3},
        )
        survivors = results[:2]
        assert all(r.ok and r.attempts == 2 and len(r.members) == 2 for r in survivors), [
            (r.ok, r.attempts, r.members, r.error) for r in survivors
        ]
        assert all(r.lost == [peers.nodes[2].peer_id.to_base58()] for r in survivors)
        assert tensor_digest([survivors[0].tensor]) == tensor_digest([survivors[1].tensor])
        torch.testing.assert_close(survivors[0].tensor, (tensors[0] + 3 * tensors[1]) / 4)
        # waiting out the attempt would take its window, DECISION_LAG, the 10 s deadline and HOLD (19 s):
        # here the window, the decision, ABORT_HOLD, the retry's own decision and transfers
        assert max(r.seconds for r in survivors) < WINDOW + ABORT_HOLD + 5.0, [round(r.seconds, 1) for r in survivors]
    finally:
        peers.close()


class SlowToTake(PartServer):
    """A reducer on a slow link: each contribution takes it 2.5 s before it reads it."""

    async def contribute(self, stream, context):
        await asyncio.sleep(2.5)
        return await super().contribute(stream, context)


def serving_with(handlers: type[PartServer]):
    """A GroupAllReduce whose reducer side is ``handlers`` (a member whose link or server misbehaves)."""

    def make(*args, **kwargs) -> GroupAllReduce:
        reducer = GroupAllReduce(*args, **kwargs)
        reducer.server = handlers(reducer.codec, reducer.aggregate, reducer.server.wait)
        return reducer

    return make


@pytest.mark.slow
def test_members_keep_the_longest_deadline_any_of_them_proposed(dhts):
    """Member 0 measured fast links and proposes a 1 s deadline; member 2's link takes 2.5 s per part.
    Going by its own deadline member 0 would fail the attempt (and retry it while the others were still
    inside it); the group keeps the longest deadline proposed, and every member completes the first
    attempt with the same mean."""
    tensors = [torch.randn(4_001, generator=torch.Generator().manual_seed(i)) for i in range(len(dhts))]
    results = run_group(
        dhts,
        tensors,
        [1.0, 1.0, 1.0],
        "none",
        run_id="t-deadline",
        kinds={2: serving_with(SlowToTake)},
        timeouts={0: 1.0, 1: 8.0, 2: 8.0},
    )
    assert all(r.ok and r.attempts == 1 and len(r.members) == 3 for r in results), [
        (r.ok, r.attempts, r.error) for r in results
    ]
    assert len({tensor_digest([r.tensor]) for r in results}) == 1
    torch.testing.assert_close(results[0].tensor, sum(tensors) / 3)


class RefusesFetches(PartServer):
    """A reducer that takes every contribution and serves its averaged part to nobody: the others fail
    their attempt, while its owner (which reads its own part locally) completes it."""

    async def fetch(self, request, context):
        yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)


@pytest.mark.slow
def test_members_do_not_form_again_when_one_of_them_applied_the_attempt(dhts):
    """Member 0 completes the attempt; 1 and 2 cannot fetch its part. Forming the group again among
    themselves would give them an average that differs from the one member 0 applied: they see that it
    did (its "done" record) and fail instead, leaving the round's adopt path to take its result."""
    tensors = [torch.randn(4_001, generator=torch.Generator().manual_seed(i)) for i in range(len(dhts))]
    results = run_group(
        dhts, tensors, [1.0, 1.0, 1.0], "none", run_id="t-done", kinds={0: serving_with(RefusesFetches)}
    )
    assert results[0].ok and len(results[0].members) == 3, results[0].error
    torch.testing.assert_close(results[0].tensor, sum(tensors) / 3)
    for r in results[1:]:
        assert not r.ok and r.attempts == 2, (r.attempts, r.error)
        assert "applied the earlier attempt" in r.error, r.error


@pytest.mark.slow
def test_no_retry_when_retries_are_off(dhts):
    tensors = [torch.ones(64) * i for i in range(3)]

    def no_retries(*args, **kwargs) -> GroupAllReduce:
        return GroupAllReduce(*args, **kwargs, retries=0)

    results = run_group(
        dhts, tensors, [1.0, 1.0, 1.0], "none", run_id="t-no-retry", kinds={0: no_retries, 1: no_retries, 2: Dies}
    )
    assert not any(r.ok for r in results)
    assert all(r.attempts == 1 for r in results[:2])
    assert all("refused our contribution" in r.error for r in results[:2]), [r.error for r in results[:2]]


@pytest.mark.slow
def test_a_late_peer_joins_the_retry_of_the_group_it_missed(dhts):
    """Members 0 and 1 form the group; member 2 comes after it closed. Member 1 is gone before the
    transfers, so the attempt fails and member 0 alone could not form it again (its result could differ
    from one a member applied). The late member computes the attempt's deadline from the decision and
    joins its retry: 0 and 2 end with their own weighted mean, bit-identical."""
    tensors = [torch.randn(5_001, generator=torch.Generator().manual_seed(i)) for i in range(len(dhts))]
    results = run_group(
        dhts, tensors, [1.0, 1.0, 3.0], "none", run_id="t-late-retry", kinds={1: Dies}, delays={2: WINDOW + 1.5}
    )
    first, late = results[0], results[2]
    assert first.ok and late.ok, [first.error, late.error]
    assert first.attempts == late.attempts == 2
    assert first.members == late.members and len(first.members) == 2
    assert tensor_digest([first.tensor]) == tensor_digest([late.tensor])
    torch.testing.assert_close(first.tensor, (tensors[0] + 3 * tensors[2]) / 4)
    assert late.lateness and max(late.lateness.values()) > WINDOW, "member 2 was not late for the first attempt"


@pytest.mark.slow
def test_the_retry_waits_for_a_member_that_read_the_decision_late(dhts, monkeypatch):
    """Members 0 and 1 form the group, member 2 comes late. Member 1 freezes, so member 0 fails at its
    deadline, which it counts from when it read the decision: 2.5 s after the others could have (a
    loaded machine). The late member knows only the decision's DHT times; the retry must still wait
    for member 0, and both end with their mean. When the retry formed one HOLD after the deadline the
    late member computed, member 0 came after it closed (12 of 17 peers of a 24-peer churn round)."""
    slow = dhts.nodes[0].peer_id.to_base58()
    joined_at = allreduce.join_group

    async def reads_late(dht, key, peer_id, *args, **kwargs):
        joined = await joined_at(dht, key, peer_id, *args, **kwargs)
        if peer_id == slow and not key.endswith("~2"):
            await asyncio.sleep(2.5)
        return joined

    monkeypatch.setattr(allreduce, "join_group", reads_late)
    tensors = [torch.randn(5_001, generator=torch.Generator().manual_seed(i)) for i in range(len(dhts))]
    results = run_group(
        dhts, tensors, [1.0, 1.0, 3.0], "none", run_id="t-late-decision", kinds={1: Freezes}, delays={2: WINDOW + 1.5}
    )
    first, late = results[0], results[2]
    assert first.ok and late.ok, [first.error, late.error]
    assert first.attempts == late.attempts == 2 and first.members == late.members and len(first.members) == 2
    assert tensor_digest([first.tensor]) == tensor_digest([late.tensor])
    torch.testing.assert_close(first.tensor, (tensors[0] + 3 * tensors[2]) / 4)


@pytest.mark.slow
@pytest.mark.parametrize("late_by", [WINDOW + 1.5, pytest.param(WINDOW + 10.0 + 30 + 3.0, marks=pytest.mark.long)])
def test_a_late_peer_of_a_group_that_succeeds_reports_it_without_forming_another(dhts, late_by):
    """Members 0 and 1 complete the group; member 2, late (also by more than the window, the 10 s
    deadline and 30 s: a peer a round behind), waits for the retry that never forms (they said they
    applied the attempt) and reports the group it missed, whose result it may adopt."""
    tensors = [torch.randn(5_001, generator=torch.Generator().manual_seed(i)) for i in range(len(dhts))]
    results = run_group(
        dhts, tensors, [1.0, 1.0, 1.0], "none", run_id=f"t-late-done-{late_by:.0f}", delays={2: late_by}
    )
    assert all(r.ok and len(r.members) == 2 for r in results[:2]), [r.error for r in results[:2]]
    late = results[2]
    late_id = dhts.nodes[2].peer_id.to_base58()
    assert not late.ok and late_id not in late.members and late.members == results[0].members, late.members
    assert "applied the earlier attempt" in late.error and late.attempts == 1, (late.attempts, late.error)
    # it stops once the members said so, long before the attempt's 10 s deadline would have passed
    assert late.seconds < 10.0, late.seconds


class DiesInTheRetry(GroupAllReduce):
    """A member that takes part in the first attempt and is gone in the second: it registers no part
    there, so contributions to it are not taken and the attempt fails at its deadline."""

    async def run(self, round_no, group, tensor, weight, expected, **kwargs):
        self.retries = 1
        return await super().run(round_no, group, tensor, weight, expected, **kwargs)

    async def form(self, attempt):
        if attempt.is_retry:

            def gone():
                raise RuntimeError("this member died inside the retry")

            attempt = dataclasses.replace(attempt, tensor=gone)
        return await super().form(attempt)


@pytest.mark.slow
def test_two_deaths_in_one_round_cost_a_second_retry_not_the_round():
    """Four members with ``retries=2``: member 3 is gone before the first attempt's transfers, member 2
    inside the retry. Members 0 and 1 form the group a third time and end with their own mean."""
    peers = Peers(4)
    try:
        tensors = [torch.randn(3_001, generator=torch.Generator().manual_seed(i)) for i in range(4)]

        def two_retries(*args, **kwargs) -> GroupAllReduce:
            return GroupAllReduce(*args, **{**kwargs, "retries": 2})

        results = run_group(
            peers,
            tensors,
            [1.0, 2.0, 1.0, 1.0],
            "none",
            run_id="t-two-deaths",
            kinds={0: two_retries, 1: two_retries, 2: DiesInTheRetry, 3: Dies},
        )
        survivors = results[:2]
        assert all(r.ok and r.attempts == 3 and len(r.members) == 2 for r in survivors), [
            (r.ok, r.attempts, r.error) for r in survivors
        ]
        assert not results[2].ok and results[2].attempts == 2
        assert tensor_digest([survivors[0].tensor]) == tensor_digest([survivors[1].tensor])
        torch.testing.assert_close(survivors[0].tensor, (tensors[0] + 2 * tensors[1]) / 3)
        assert sorted(survivors[0].lost) == sorted(p.peer_id.to_base58() for p in peers.nodes[2:])
    finally:
        peers.close()
