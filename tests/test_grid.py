"""Bounded groups: the grid's layout at many sizes, and a grid all-reduce on real DHTs in one process."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from helpers import Dies, Forgot, Peers
from hivemind.proto import averaging_pb2

from p2p_spes.averaging.allreduce import GroupAllReduce
from p2p_spes.averaging.grid import column_bounds, make_grid
from p2p_spes.averaging.reducer import PartServer
from p2p_spes.averaging.transport import tensor_digest

WINDOW = 2.0


@pytest.mark.parametrize("n,size", [(3, 2), (5, 2), (17, 16), (24, 16), (33, 8), (100, 16), (1000, 16), (1000, 32)])
def test_every_member_is_in_one_row_and_every_column_has_one_holder_per_row(n, size):
    members = [f"peer{i:04d}" for i in reversed(range(n))]
    grid = make_grid(members, size)
    rows = [list(r) for r in grid.rows]
    assert sorted(itertools.chain(*rows)) == sorted(members)
    assert len(rows) == -(-n // size) and max(map(len, rows)) <= size
    assert max(map(len, rows)) - min(map(len, rows)) <= 1
    for k, row in enumerate(rows):
        # the members of a row split the columns into contiguous runs covering them once
        runs = [grid.columns_of(p) for p in row]
        assert [c for run in runs for c in run] == list(range(size)) and all(len(run) >= 1 for run in runs)
        assert all(grid.row_of(p) == k for p in row)
    for c in range(size):
        holders = grid.holders(c)
        assert len(holders) == len(rows) and [grid.row_of(h) for h in holders] == list(range(len(rows)))
        assert all(c in grid.columns_of(h) for h in holders)
        # a member of row k asks its own row's holder first, then the rows after it
        assert grid.holders(c, first_row=len(rows) - 1)[0] == holders[-1]
    # every member computes the same grid whatever order it read the members in
    assert make_grid(sorted(members), size) == grid


def test_small_groups_and_size_zero_stay_flat():
    assert make_grid(["a", "b", "c"], 3) is None
    assert make_grid([f"p{i}" for i in range(100)], 0) is None


def test_column_bounds_cover_the_tensor_in_order():
    for numel, columns in [(10, 3), (7, 16), (1_000_003, 16)]:
        bounds = column_bounds(numel, columns)
        assert bounds[0] == 0 and bounds[-1] == numel and len(bounds) == columns + 1
        assert all(a <= b for a, b in itertools.pairwise(bounds))


@pytest.fixture(scope="module")
def five():
    peers = Peers(5)
    yield peers
    peers.close()


class Silent(Forgot):
    """The handlers of a peer that left after joining: every call is refused at once."""

    async def column(self, request, context):
        yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)


class Leaves(Dies):
    """Joins the group, then sends nothing and refuses everyone, columns included."""

    handlers = Silent


def run_grid(peers, tensors, weights, compression, run_id, kinds=None):
    kinds = kinds or {}

    async def main():
        reducers = []
        for i, node in enumerate(peers.nodes):
            reducer = kinds.get(i, GroupAllReduce)(
                node,
                peers.p2ps[i],
                node.peer_id.to_base58(),
                run_id,
                owner=peers.owners[i],
                compression=compression,
                matchmaking_time=WINDOW,
                timeout=8.0,
                group_size=2,
            )
            await reducer.start()
            reducers.append(reducer)
        expected = {node.peer_id.to_base58() for node in peers.nodes}
        return await asyncio.gather(
            *(r.run(0, "shared", tensors[i], weights[i], expected, bounded=True) for i, r in enumerate(reducers))
        )

    return peers.call(main())


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["none", "topk"])
def test_a_grid_all_reduce_ends_bit_identical_and_exact_without_compression(five, compression):
    """5 members in rows of at most 2 (3 rows, 2 columns): every member applies the same bits, and
    without compression they are the token-weighted mean of all five."""
    tensors = [torch.randn(10_001, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    weights = [1.0, 2.0, 3.0, 1.0, 5.0]
    results = run_grid(five, tensors, weights, compression, f"t-grid-{compression}")
    assert all(r.ok for r in results), [r.error for r in results]
    assert all(r.rows == 3 and len(r.members) == 5 for r in results)
    assert len({tensor_digest([r.tensor]) for r in results}) == 1, "members' copies differ"
    assert all(r.sent is not None for r in results), "a member's contribution missed a column"
    w = torch.tensor(weights, dtype=torch.float64)
    exact = ((torch.stack(tensors).double() * w[:, None]).sum(0) / w.sum()).float()
    if compression == "none":
        torch.testing.assert_close(results[0].tensor, exact, rtol=1e-5, atol=1e-6)
    else:  # top-k keeps 1/64 of each block: what it sends points the way the mean does
        cos = torch.nn.functional.cosine_similarity(results[0].tensor, exact, dim=0)
        assert cos > 0.05, float(cos)


@pytest.mark.slow
def test_a_member_lost_in_the_rows_costs_its_row_not_the_round(five):
    """A member of a row of two joins and leaves. Its row-mate waits for its part until the rows'
    deadline and so misses the columns, which the other rows closed without it; it still fetches every
    column from the other rows. All four survivors end bit-identical with the weighted mean of the three
    whose rows were complete: a column is never a mix of averaged and unaveraged values."""
    ids = [node.peer_id.to_base58() for node in five.nodes]
    grid = make_grid(ids, 2)
    pair = next(row for row in grid.rows if len(row) == 2)
    gone, mate = ids.index(pair[0]), ids.index(pair[1])
    tensors = [torch.randn(4_001, generator=torch.Generator().manual_seed(10 + i)) for i in range(5)]
    weights = [1.0, 2.0, 1.0, 3.0, 1.0]
    results = run_grid(five, tensors, weights, "none", "t-grid-lost", kinds={gone: Leaves})
    survivors = [i for i in range(5) if i != gone]
    assert not results[gone].ok
    assert all(results[i].ok for i in survivors), [results[i].error for i in survivors]
    assert len({tensor_digest([results[i].tensor]) for i in survivors}) == 1, "the survivors' copies differ"
    # the row-mate's contribution missed the columns (it carries nothing over); everyone else's is in
    assert results[mate].sent is None and results[mate].lost == [ids[gone]]
    assert all(results[i].sent is not None for i in survivors if i != mate)
    counted = [i for i in survivors if i != mate]
    w = torch.tensor([weights[i] for i in counted], dtype=torch.float64)
    mean = (torch.stack([tensors[i].double() for i in counted]) * w[:, None]).sum(0) / w.sum()
    torch.testing.assert_close(results[counted[0]].tensor, mean.float(), rtol=1e-5, atol=1e-6)
    # nobody waited past the rows' 8 s deadline by more than the columns' window and transfers
    assert max(results[i].seconds for i in survivors) < 8.0 + 3 * WINDOW + 5.0


def test_a_column_we_do_not_hold_is_refused_at_once_and_one_we_hold_is_served_when_published():
    """A peer whose view of the group differed asks us for a column our grid gives to someone else:
    it is told at once (it goes on to the column's members), not kept waiting for our whole deadline."""
    from p2p_spes.averaging.aggregation import weighted_mean
    from p2p_spes.averaging.compression import Codec
    from p2p_spes.averaging.reducer import MISSING, OK
    from p2p_spes.averaging.transport import pack, parse_tensor

    async def main():
        server = PartServer(Codec("none"), weighted_mean, wait=30.0)
        ours, other = pack([3, "shared/c1"]), pack([3, "shared/c0"])
        server.holding[(3, "shared")] = {ours}

        async def ask(key):
            return [m async for m in server.column(averaging_pb2.AveragingData(group_id=key), None)]

        refused = await asyncio.wait_for(ask(other), 1.0)
        pending = asyncio.ensure_future(ask(ours))
        await asyncio.sleep(0.2)
        assert not pending.done()  # ours is not published yet: the asker waits for it
        server.publish(ours, [torch.arange(5.0)], seconds=5.0)
        served = await asyncio.wait_for(pending, 1.0)
        return refused, served

    refused, served = asyncio.run(main())
    assert [m.code for m in refused] == [MISSING]
    assert all(m.code == OK for m in served)
    assert torch.equal(parse_tensor([m.tensor_part for m in served]), torch.arange(5.0))
