"""Members nobody can dial (``reachable=False``, behind a NAT) still average: they send their parts to the
reducers and fetch every part, and nobody opens a stream to them (issue 43).

Loopback cannot make a peer undialable, so a client's handlers here record (and refuse) every call, and its
streams are counted by the wire meter: nothing may reach them, and its "reducing" traffic stays zero.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import Dies, Forgot, Peers
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.proto import averaging_pb2

from dht.keys import group_key
from p2p_spes.averaging.allreduce import GroupAllReduce
from p2p_spes.averaging.compression import Codec, message_numel
from p2p_spes.averaging.flat_allreduce import FlatGroup, exchange_bytes
from p2p_spes.averaging.grid import make_grid
from p2p_spes.averaging.membership import Joined, adopted, decide, decision
from p2p_spes.averaging.reducer import PartServer, PartSpec, describe, described, group_id
from p2p_spes.averaging.roles import MAX_NAMED, choose_outsider, flat_group, named_outsiders, outsider_candidates
from p2p_spes.averaging.transport import TransportError, pack, tensor_digest
from p2p_spes.averaging.wire_meter import MeteredP2P, WireMeter

WINDOW = 2.0


class Undialable(PartServer):
    """A client's handlers: on the internet nobody could reach them; here every call is recorded and refused."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    async def contribute(self, stream, context):
        self.calls.append(f"contribute from {context.remote_id}")
        return averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)

    async def fetch(self, request, context):
        self.calls.append(f"fetch from {context.remote_id}")
        yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)

    async def column(self, request, context):
        self.calls.append(f"column from {context.remote_id}")
        yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)


class DiesAsClient(Dies):
    """A client that joins the group and is gone before sending anything."""

    handlers = Undialable


@pytest.fixture(scope="module")
def four():
    peers = Peers(4)
    yield peers
    peers.close()


def run_members(
    peers,
    present,
    tensors,
    weights,
    run_id,
    clients=(),
    bandwidths=None,
    helpers=(),
    kinds=None,
    timeout=10.0,
    group_size=0,
):
    """Each present peer runs group "g" of round 0 (every peer of ``peers`` serves, the absent ones as
    possible outsiders; ``helpers``: the outsiders every member knows, or by member); returns the results
    of the present ones, their meters and the clients' servers."""
    ids = [node.peer_id.to_base58() for node in peers.nodes]
    bandwidths, kinds = bandwidths or {}, kinds or {}
    meters = [WireMeter() for _ in peers.nodes]

    async def main():
        reducers = []
        for i, node in enumerate(peers.nodes):
            reducer = kinds.get(i, GroupAllReduce)(
                node,
                MeteredP2P(peers.p2ps[i], meters[i]),
                ids[i],
                run_id,
                owner=peers.owners[i],
                compression="none",
                matchmaking_time=WINDOW,
                timeout=timeout,
                reachable=i not in clients,
                bandwidth=bandwidths.get(i),
                helpers=lambda i=i: [ids[h] for h in (helpers.get(i, ()) if isinstance(helpers, dict) else helpers)],
                group_size=group_size,
            )
            if i in clients and not isinstance(reducer.server, Undialable):
                reducer.server = Undialable(reducer.codec, reducer.aggregate, reducer.server.wait)
            await reducer.start()
            reducers.append(reducer)
        expected = {ids[i] for i in present}
        return await asyncio.gather(
            *(reducers[i].run(0, "g", tensors[i], weights[i], expected, bounded=group_size > 0) for i in present)
        ), reducers

    results, reducers = peers.call(main())
    return results, meters, reducers


def weighted(tensors, weights, who):
    w = torch.tensor([weights[i] for i in who], dtype=torch.float64)
    return ((torch.stack([tensors[i].double() for i in who]) * w[:, None]).sum(0) / w.sum()).float()


def assert_untouched(reducers, meters, clients):
    """Nobody opened a stream to a client: its handlers saw no call, its meter no reducing traffic."""
    for i in clients:
        assert reducers[i].server.calls == [], reducers[i].server.calls
        assert meters[i].by_purpose["reducing"].sent == meters[i].by_purpose["reducing"].received == 0
        assert meters[i].by_purpose["averaging"].sent > 0 and meters[i].by_purpose["averaging"].received > 0


# The split and the decision (no network) -------------------------------------------------------------
def test_the_split_covers_the_vector_among_reducers_only():
    members = ("a", "b", "c", "d")
    equal = FlatGroup(members, {}, 1.0, 0.0, reducers=("a", "c"))
    assert equal.sizes(10_001) == [5001, 5000]
    balanced = FlatGroup(members, {}, 1.0, 0.0, reducers=("a", "c"), bandwidths=(100.0, 50.0))
    assert balanced.sizes(10_001) == list(load_balance_peers(10_001, [100.0, 50.0, 0.0, 0.0])[:2])
    assert sum(balanced.sizes(10_001)) == 10_001 and balanced.sizes(10_001)[0] > balanced.sizes(10_001)[1]
    undeclared = FlatGroup(members, {}, 1.0, 0.0, reducers=("a", "c"), bandwidths=(100.0, 0.0))
    assert sum(undeclared.sizes(10_001)) == 10_001  # the one not declared counts as the mean of the others
    # every member reducing in equal parts: today's group id and split, exactly
    plain = FlatGroup(members, {}, 1.0, 0.0)
    assert plain.gid == group_id(list(members))
    assert plain.sizes(10) == [3, 3, 2, 2]
    assert len({plain.gid, equal.gid, balanced.gid, undeclared.gid}) == 4  # another split, another id


def test_parts_of_any_sizes_decode_from_their_headers():
    """A frozen copy rebuilds a group's result from its encoded parts, whatever the split was."""
    codec = Codec("int8")
    x = torch.randn(1001)
    chunks = torch.split(x, [700, 0, 301])
    messages = [codec.encode(c) for c in chunks]
    assert [message_numel(m) for m in messages] == [700, 0, 301]
    decoded = torch.cat([codec.decode(m, len(c)) for m, c in zip(messages, chunks)])
    assert torch.equal(codec.decode_parts(messages, 1001), decoded)
    with pytest.raises(TransportError, match="1001 values where 1002"):
        codec.decode_parts(messages, 1002)


def test_a_client_moves_one_tensor_each_way_and_fewer_reducers_carry_more():
    codec = Codec("int8")
    contribution, result = codec.wire_bytes(10_000), codec.result.wire_bytes(10_000)
    assert exchange_bytes(codec, 10_000, 4, 2, reducing=False) == (contribution, result)
    everyone = exchange_bytes(codec, 10_000, 4, 4, reducing=True)  # today's group: 3/4 of each, each way
    assert all(abs(n - 0.75 * (contribution + result)) <= 1 for n in everyone)
    half = exchange_bytes(codec, 10_000, 4, 2, reducing=True)  # two reducers serve three members each
    assert half[0] > everyone[0] and half[1] > everyone[1]


def test_members_derive_the_same_reducers_from_the_records_and_the_decision_carries_them():
    records = {
        "a": {"t": 10.0, "m": 2.0, "bw": 80.0},
        "b": {"t": 10.5, "m": 2.0, "c": True},
        "c": {"t": 11.0, "m": 2.0},
    }
    joined = decide(records, 3.0)
    assert joined.members == ["a", "b", "c"] and joined.clients == {"b"} and joined.reducers == ["a", "c"]
    assert joined.bandwidths == {"a": 80.0}
    group = flat_group(joined, 5.0, 0.0)
    assert group.reducers == ("a", "c") and group.bandwidths == (80.0, 0.0)
    again = adopted(decision(joined, "a", 10.0), Joined(["x"]))
    assert again.clients == {"b"} and again.bandwidths == {"a": 80.0} and again.reducers == ["a", "c"]
    # a group of reachable members that declared nothing is today's group
    plain = decide({p: {"t": 10.0 + i, "m": 2.0} for i, p in enumerate("abc")}, 3.0)
    assert flat_group(plain, 5.0, 0.0) == FlatGroup(("a", "b", "c"), {}, 5.0, 0.0)
    assert "c" not in decision(plain, "a", 10.0) and "bw" not in decision(plain, "a", 10.0)


def test_a_group_of_clients_picks_the_same_outsider_and_the_decision_names_it():
    helpers = ["h3", "h1", "h2", "a"]
    pick = choose_outsider("run/0/g", helpers, ["a", "b"])
    assert pick == choose_outsider("run/0/g", list(reversed(helpers)), ["b", "a"]) and pick[0] in {"h1", "h2", "h3"}
    assert choose_outsider("run/0/g", ["a"], ["a", "b"]) == []
    picks = {choose_outsider(f"run/0/g~{n}", helpers, ["a", "b"])[0] for n in range(2, 12)}
    assert len(picks) > 1  # a retry (another key) may pick another one
    joined = Joined(["a", "b"], window=2.0, clients={"a", "b"}, outsiders=pick)
    assert joined.reducers == pick
    assert adopted(decision(joined, "a", 1.0), Joined(["a"])).reducers == pick


def test_a_retry_avoids_an_outsider_that_failed_unless_it_is_the_only_one():
    assert outsider_candidates(lambda: ["h1", "h2", "me"], {"h1"}, "me") == ["h2"]
    # one public peer: without it the retry of a group of clients would fail for sure
    assert outsider_candidates(lambda: ["h1", "me"], {"h1"}, "me") == ["h1"]
    assert outsider_candidates(lambda: ["me"], set(), "me") == []
    assert outsider_candidates(None, set(), "me") == []


def test_clients_hold_no_columns_and_rows_short_of_reducers_stay_flat():
    members = [f"p{i}" for i in range(6)]
    grid = make_grid(members, 2, {"p0", "p4"})
    assert grid is not None and len(grid.rows) == 3
    assert all(grid.reducers(k) for k in range(3))
    assert list(grid.columns_of("p0")) == [] and list(grid.columns_of("p4")) == []
    for c in range(2):
        assert all(h not in {"p0", "p4"} for h in grid.holders(c))
    assert sorted(p for row in grid.rows for p in row) == members
    assert make_grid(members, 2, {"p0", "p1", "p2", "p3"}) is None  # 2 reachable for 3 rows: flat
    assert make_grid(members, 2, set()) == make_grid(members, 2)


def test_an_outsider_takes_a_part_only_when_its_description_checks_out():
    """The description must name us as the reducer and hash to its group id; every contributor must
    describe the same part."""

    async def main():
        from p2p_spes.averaging.aggregation import weighted_mean

        server = PartServer(Codec("none"), weighted_mean, wait=30.0)
        server.peer_id = "h"
        members, reducers = ("a", "b"), ("h",)
        gid = group_id(list(members), list(reducers))
        key = pack([0, "g", gid, 0])
        spec = PartSpec(members, reducers, (), gid, 0, 100, 0, 5.0, "g")
        assert described(describe(key, spec)) == (key, spec)
        forged = PartSpec(("a", "b", "z"), reducers, (), gid, 0, 100, 0, 5.0, "g")
        assert server.adopt(key, forged, "a") is None  # the hash does not match
        assert server.adopt(key, spec, "z") is None  # not a contributor
        other = PartServer(Codec("none"), weighted_mean, wait=30.0)
        other.peer_id = "x"
        assert other.adopt(key, spec, "a") is None  # not named as the reducer
        part = server.adopt(key, spec, "a")
        assert part is not None and part.members == ["a", "b"] and part.shape == (100,)
        assert server.adopt(key, spec, "b") is part
        assert server.adopt(key, PartSpec(members, reducers, (), gid, 0, 99, 0, 5.0, "g"), "b") is None
        # its contributors publish their digests only after it: the outsider waits for them until its
        # deadline, or until both were streamed their result
        assert server.adopted_until(1) == 0.0 and server.adopted_until(0) == part.deadline
        part.served("a")
        assert server.adopted_until(0) == part.deadline
        part.served("b")
        assert server.adopted_until(0) == 0.0

    asyncio.run(main())


# On real DHTs and streams (loopback) ---------------------------------------------------------------
@pytest.mark.slow
def test_a_client_averages_bit_identical_and_nobody_dials_it(four):
    """Members 0 and 1 reduce (member 0 declared 100, member 1 80 (Mbit/s, say)), member 2 cannot be dialled:
    all three end bit-identical with the weighted mean, the parts cover the vector between the two
    reducers as hivemind's load balance cuts it, and no stream reached the client."""
    tensors = [torch.randn(10_001, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    weights = [1.0, 2.0, 3.0]
    for attempt in range(2):  # a transport hiccup under load fails a round for everyone; the next runs
        results, meters, reducers = run_members(
            four, [0, 1, 2], tensors, weights, f"t-client-{attempt}", clients={2}, bandwidths={0: 100.0, 1: 80.0}
        )
        if all(r.ok for r in results):
            break
    assert all(r.ok for r in results), [r.error for r in results]
    assert len({tensor_digest([r.tensor]) for r in results}) == 1, "copies differ after the round"
    torch.testing.assert_close(results[0].tensor, weighted(tensors, weights, [0, 1, 2]))
    sizes = [message_numel(m) for m in results[0].messages]  # in the reducers' (sorted ids') order
    declared = {four.nodes[0].peer_id.to_base58(): 100.0, four.nodes[1].peer_id.to_base58(): 80.0}
    balanced = load_balance_peers(10_001, [declared[p] for p in sorted(declared)] + [0.0])
    assert sizes == list(balanced[:2]) and sum(sizes) == 10_001 and min(sizes) > 0
    assert all(torch.equal(Codec("none").decode_parts(r.messages, 10_001), results[0].tensor) for r in results)
    assert_untouched(reducers, meters, {2})
    # a client sends one part to each reducer and fetches every part; a reducer also serves
    assert meters[0].by_purpose["reducing"].sent > 0 and meters[1].by_purpose["reducing"].sent > 0


@pytest.mark.slow
def test_a_group_of_clients_averages_through_a_reachable_outsider(four):
    """Members 0-2 cannot be dialled; peer 3 is not in the group but reachable and named as a helper: it
    reduces the whole tensor for them (adding nothing of its own), and they end bit-identical."""
    tensors = [torch.randn(4_001, generator=torch.Generator().manual_seed(20 + i)) for i in range(3)]
    weights = [1.0, 1.0, 2.0]
    for attempt in range(2):
        results, meters, reducers = run_members(
            four, [0, 1, 2], tensors, weights, f"t-outsider-{attempt}", clients={0, 1, 2}, helpers=[3]
        )
        if all(r.ok for r in results):
            break
    assert all(r.ok for r in results), [r.error for r in results]
    assert len({tensor_digest([r.tensor]) for r in results}) == 1, "copies differ after the round"
    torch.testing.assert_close(results[0].tensor, weighted(tensors, weights, [0, 1, 2]))
    assert all(len(r.messages) == 1 and len(r.members) == 3 for r in results)
    assert_untouched(reducers, meters, {0, 1, 2})
    assert meters[3].by_purpose["reducing"].received > 0 and meters[3].by_purpose["averaging"].sent == 0


@pytest.mark.slow
def test_a_group_of_clients_finds_its_outsider_when_only_one_member_knows_it(four):
    """A NATed peer's DHT can lose the public peers for a while, and the group's first arrival may be
    such a peer (lab: 1 public + 3 NATed, groups of two NATed holders failed with no outsider). The
    clients' arrival records name the reachable peers they know: here only member 2 knows peer 3, and
    whoever arrives first names it."""
    tensors = [torch.randn(2_001, generator=torch.Generator().manual_seed(40 + i)) for i in range(3)]
    results, meters, _ = run_members(
        four, [0, 1, 2], tensors, [1.0, 1.0, 1.0], "t-named", clients={0, 1, 2}, helpers={2: [3]}
    )
    assert all(r.ok for r in results), [r.error for r in results]
    assert len({tensor_digest([r.tensor]) for r in results}) == 1, "copies differ after the round"
    assert meters[3].by_purpose["reducing"].received > 0


def test_the_outsiders_clients_name_are_read_from_their_records_and_malformed_ones_dropped():
    records = {
        "a": {"t": 1.0},
        "b": {"t": 2.0, "o": ["h2", "h1"]},
        "c": {"t": 3.0, "o": ["h1", 7, "", None]},
        "d": {"t": 4.0, "o": "h9"},
        "e": {"t": 5.0, "o": [f"x{i}" for i in range(20)]},
    }
    named = named_outsiders(records)
    assert {"h1", "h2"} <= set(named) and "h9" not in named and all(isinstance(p, str) and p for p in named)
    assert sum(p.startswith("x") for p in named) == MAX_NAMED  # a record names a bounded number
    assert choose_outsider("run/0/g", named, ["a", "b", "c"]) != []


@pytest.mark.slow
def test_a_client_lost_mid_round_costs_a_retry_not_the_round(four):
    """Member 2 (a client) joins and is gone before sending: the reducers' parts miss its contribution, so
    the attempt fails for everyone at its deadline (nobody waits for it forever) and the retry among
    members 0 and 1 succeeds without it, reporting it lost."""
    tensors = [torch.randn(2_001, generator=torch.Generator().manual_seed(30 + i)) for i in range(3)]
    weights = [1.0, 3.0, 1.0]
    ids = [node.peer_id.to_base58() for node in four.nodes]
    results, _, reducers = run_members(
        four, [0, 1, 2], tensors, weights, "t-client-lost", clients={2}, kinds={2: DiesAsClient}, timeout=5.0
    )
    survivors = results[:2]
    assert not results[2].ok
    assert all(r.ok and r.attempts == 2 and r.lost == [ids[2]] for r in survivors), [
        (r.ok, r.attempts, r.lost, r.error) for r in survivors
    ]
    assert tensor_digest([survivors[0].tensor]) == tensor_digest([survivors[1].tensor])
    torch.testing.assert_close(survivors[0].tensor, weighted(tensors, weights, [0, 1]))
    assert reducers[2].server.calls == []


@pytest.mark.slow
def test_a_client_in_a_grid_holds_no_column_and_every_member_ends_bit_identical():
    """Five members in rows of at most two (three rows), one of them a client: its row's columns go to
    its reachable row-mate (or its row is all reachable), it sends its parts and fetches every column,
    nobody dials it, and all five end with the exact weighted mean."""
    peers = Peers(5)
    try:
        ids = [node.peer_id.to_base58() for node in peers.nodes]
        client = ids.index(min(ids))  # dealt last: it shares a row with a reachable member
        assert make_grid(ids, 2, {ids[client]}) is not None
        tensors = [torch.randn(6_001, generator=torch.Generator().manual_seed(40 + i)) for i in range(5)]
        weights = [1.0, 2.0, 3.0, 1.0, 2.0]
        results, meters, reducers = run_members(
            peers, list(range(5)), tensors, weights, "t-grid-client", clients={client}, timeout=8.0, group_size=2
        )
        assert all(r.ok for r in results), [r.error for r in results]
        assert all(r.rows == 3 and len(r.members) == 5 for r in results)
        assert len({tensor_digest([r.tensor]) for r in results}) == 1, "members' copies differ"
        torch.testing.assert_close(results[0].tensor, weighted(tensors, weights, range(5)), rtol=1e-5, atol=1e-6)
        assert all(r.sent is not None for r in results), "a member's contribution missed a column"
        assert_untouched(reducers, meters, {client})
    finally:
        peers.close()


class Refuses(GroupAllReduce):
    """A reachable peer whose handlers refuse every call (it restarted and forgot, or will not reduce)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.server = Forgot(self.codec, self.aggregate, self.server.wait)


@pytest.mark.slow
def test_an_outsider_that_refuses_costs_a_retry_through_another(four):
    """Members 0 and 1 cannot be dialled; of the two helpers, the one the first attempt picks refuses: the
    attempt fails for both at once, and the retry avoids it and averages through the other helper."""
    ids = [node.peer_id.to_base58() for node in four.nodes]
    run_id = next(
        r
        for r in (f"t-refusing-{n}" for n in range(100))
        if choose_outsider(group_key(r, 0, "g"), [ids[2], ids[3]], ids[:2]) == [ids[2]]
    )
    tensors = [torch.randn(3_001, generator=torch.Generator().manual_seed(50 + i)) for i in range(2)]
    weights = [1.0, 3.0]
    results, meters, reducers = run_members(
        four, [0, 1], tensors, weights, run_id, clients={0, 1}, helpers=[2, 3], kinds={2: Refuses}
    )
    assert all(r.ok and r.attempts == 2 and r.lost == [] for r in results), [(r.attempts, r.error) for r in results]
    assert tensor_digest([results[0].tensor]) == tensor_digest([results[1].tensor])
    torch.testing.assert_close(results[0].tensor, weighted(tensors, weights, [0, 1]))
    assert meters[3].by_purpose["reducing"].received > 0
    assert_untouched(reducers, meters, {0, 1})


def test_a_group_with_few_reducers_may_run_longer_than_the_configured_deadline():
    """The configured deadline is for every member reducing; one reducer for three members carries every
    client's contribution and result, so the cap grows by members / reducers, and only with clients."""
    everyone = Joined(["a", "b", "c"], timeout=80.0)
    assert everyone.deadline(30.0) == 30.0
    one_reducer = Joined(["a", "b", "c"], timeout=80.0, clients={"b", "c"})
    assert one_reducer.deadline(30.0) == 80.0 and Joined(["a", "b", "c"], timeout=200.0, clients={"b", "c"}).deadline(
        30.0
    ) == pytest.approx(90.0)
    outsider = Joined(["a", "b"], timeout=500.0, clients={"a", "b"}, outsiders=["z"])
    assert outsider.deadline(30.0) == pytest.approx(60.0)
    assert Joined(["a", "b"], clients={"b"}).deadline(30.0) == 30.0, "nobody proposed one: the configured one"


class FetchesLate(GroupAllReduce):
    """A client on a slow link: its fetches of the averaged parts start ``LATE`` seconds after the rest."""

    LATE = 3.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        fetch = self.client.fetch

        async def late_fetch(*a, **kw):
            await asyncio.sleep(self.LATE)
            return await fetch(*a, **kw)

        self.client.fetch = late_fetch


@pytest.mark.slow
def test_a_reducer_ends_its_group_when_its_clients_have_their_result(four):
    """A reducer's part is done when the contributions are in, but its clients fetch every part after
    that: a reducer that ended its group then opened its next groups (and waited for digests) before its
    clients came, and found itself alone there (issue 43, one public and three NATed peers). It now
    returns once every client was streamed its part, so the members end their group together."""
    tensors = [torch.randn(5_000, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    weights = [1.0, 1.0, 1.0]
    for attempt in range(2):  # a transport hiccup under load fails a round for everyone; the next runs
        results, _, _ = run_members(
            four, [0, 1, 2], tensors, weights, f"t-late-{attempt}", clients={2}, kinds={2: FetchesLate}
        )
        if all(r.ok for r in results):
            break
    assert all(r.ok for r in results), [r.error for r in results]
    reducers_end, client_end = [r.seconds for r in results[:2]], results[2].seconds
    assert all(s >= FetchesLate.LATE for s in reducers_end), (reducers_end, client_end)
    assert all(abs(s - client_end) < 1.5 for s in reducers_end), (reducers_end, client_end)
