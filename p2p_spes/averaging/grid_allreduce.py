"""The transfers of a group larger than ``swarm.group_size``: rows, then columns, then results for all.

Once a large group's membership is decided, every member computes the same grid (``grid.py``):

1. **Rows.** Each member sends the part of its tensor in each row member's columns to that member,
   encoded with the run's codec, as in a flat group. A row member combines what came for its columns
   (``reducer.py``, the run's aggregation rule) when every row member's part is in, or at the stage's
   deadline with those that came. A member nobody can dial (a client) holds no columns: it only sends
   its parts to its row's reachable members and fetches the columns' results (``grid.py``).
2. **Columns.** For each column it reduces, a row member all-reduces its row's combination with the
   holders of that column in the other rows, weighted by the tokens it combined: a flat group of at
   most one member per row (``allreduce.GroupAllReduce.run``, retried among survivors like any group).
   It then serves the column's encoded result to whoever asks.
3. **Results.** Every member fetches every column's result, from its own row's holder first and, if
   that one is gone or its row missed the column, from the holders in the other rows. All holders of
   a column serve the same bytes, so every member that gets all columns decodes bit-identical values.

What this does to exactness: each column is the weighted mean of the contributions that reached it.
A member lost during the rows is missing from the columns it had not sent its part to yet, and a row
whose holder came late or died is missing from that column, so the columns of one round may average
slightly different sets of peers. No member applies anything unless it has every column, and all
that do apply the same values; a member whose own contribution missed a column still applies the
result (its progress in that column is lost for the round, as a late peer's is). A column that fails
for good fails the round for everyone, as a flat group does.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from p2p_spes.averaging.compression import Codec
from p2p_spes.averaging.error_feedback import ErrorFeedback
from p2p_spes.averaging.grid import Grid, column_bounds
from p2p_spes.averaging.part_client import PartClient
from p2p_spes.averaging.reducer import Part, PartServer
from p2p_spes.averaging.transport import TransportError, gather_or_cancel, pack

log = logging.getLogger(__name__)


@dataclass
class ColumnResult:
    """What a column's flat all-reduce gave its holder: the column's encoded averaged parts (the same on
    every holder) and what the holder's contribution decoded to (its error feedback)."""

    messages: list[torch.Tensor] | None
    sent: torch.Tensor | None
    bytes_sent: int = 0
    bytes_received: int = 0


ColumnRun = Callable[[str, torch.Tensor, float, set[str]], Awaitable[ColumnResult]]
ColumnMembers = Callable[[str], Awaitable[list[str]]]


@dataclass
class GridOutcome:
    """One member's view of a grid all-reduce."""

    tensor: torch.Tensor | None = None  # every column's result, decoded
    sent: torch.Tensor | None = None  # our contribution as the reducers decoded it
    counted: bool = False  # our contribution is in every column
    bytes_sent: int = 0
    bytes_received: int = 0
    retries: int = 0
    error: str | None = None
    missing: list[str] = field(default_factory=list)  # row members whose part never reached us


class GridRound:
    """Runs the transfers of one large group for one member (see the module docstring)."""

    def __init__(self, peer_id: str, codec: Codec, server: PartServer, client: PartClient) -> None:
        self.peer_id, self.codec, self.server, self.client = peer_id, codec, server, client
        # what the row's combination lost on its way into each column, added the next time we hold it
        self.feedback = ErrorFeedback(codec)
        self._outliving: set[asyncio.Future] = set()  # our columns' work left running for the others (held:
        # a task nothing holds is collected mid-transfer)

    async def run(
        self,
        round_no: int,
        group: str,
        grid: Grid,
        flat: torch.Tensor,
        weight: float,
        column_run: ColumnRun,
        row_deadline: float,
        deadline: float,
        column_members: ColumnMembers | None = None,
    ) -> GridOutcome:
        """Contribute ``flat`` to our row by ``row_deadline`` and return every column's result by
        ``deadline`` (monotonic times); ``column_run(key, tensor, weight, expected holders)`` is the flat
        all-reduce of one column among its holders, ``column_members(key)`` who joined that column (read
        when none of our grid's holders serves it: a peer whose view of the group differed holds other
        columns)."""
        out = GridOutcome()
        me, k = self.peer_id, grid.row_of(self.peer_id)
        row = list(grid.rows[k])  # who contributes to the row's parts
        reducers = grid.reducers(k)  # who holds them (every member, unless some cannot be dialled)
        bounds = column_bounds(flat.numel(), grid.columns)
        spans = [(bounds[grid.columns_of(p).start], bounds[grid.columns_of(p).stop]) for p in reducers]
        row_key = f"{group}/row{k}"
        gid = hashlib.sha256(pack(row if reducers == row else [row, reducers])).hexdigest()[:16]
        keys = [pack([round_no, row_key, gid, i]) for i in range(len(reducers))]
        part = None  # a client reduces nothing
        if me in reducers:
            lo, hi = spans[reducers.index(me)]
            part = Part(row, gid, (hi - lo,), row_deadline, name=row_key, start=lo, relay=True)
            self.server.decided[(round_no, row_key)] = gid
            self.server.register(keys[reducers.index(me)], part)
            self.server.forget_later(
                keys[reducers.index(me)], (round_no, row_key), max(deadline - time.monotonic(), 1.0)
            )
        self.server.holding[(round_no, group)] = {pack([round_no, f"{group}/c{c}"]) for c in grid.columns_of(me)}
        asyncio.get_running_loop().call_later(
            max(deadline - time.monotonic(), 1.0) + 5.0, self.server.holding.pop, (round_no, group), None
        )
        sent: list[torch.Tensor] = [torch.empty(0)] * len(reducers)
        took = [False] * len(reducers)

        async def contribute(i: int, peer: str) -> None:
            message = self.codec.encode(flat[spans[i][0] : spans[i][1]].contiguous())
            sent[i] = self.codec.decode(message, spans[i][1] - spans[i][0])
            if peer == me:
                self.server.add(part, me, float(weight), sent[i], message)
                took[i] = True
                return
            try:
                took[i] = await self.client.send(peer, keys[i], message, weight, out)
            except TransportError as exc:
                log.info("round %d %s: %s did not take our part (%s)", round_no, row_key, peer, exc)

        async def rows_then_columns() -> dict[int, list[torch.Tensor] | None]:
            try:
                await asyncio.wait_for(
                    asyncio.gather(*(contribute(i, p) for i, p in enumerate(reducers))),
                    max(row_deadline - time.monotonic(), 0.1),
                )
            except asyncio.TimeoutError:
                pass
            if part is None:
                return {}
            try:
                await asyncio.wait_for(part.done.wait(), max(row_deadline - time.monotonic(), 0.01))
            except asyncio.TimeoutError:
                self.server.close(part)  # with the contributions that came
            out.missing = sorted(set(row) - set(part.contributions))
            mine = grid.columns_of(me)
            done = await asyncio.gather(
                *(self._column(round_no, group, grid, c, part, bounds, column_run, deadline, out) for c in mine)
            )
            return dict(zip(mine, done))

        local_task = asyncio.ensure_future(rows_then_columns())
        try:
            # a column that failed fails our result: the other fetches are cancelled (our own columns
            # are shielded in them and go on for the others)
            columns = await gather_or_cancel(
                (
                    self._fetch_column(round_no, group, grid, c, k, local_task, deadline, out, column_members)
                    for c in range(grid.columns)
                ),
                max(deadline - time.monotonic(), 0.1),
            )
        except Exception as exc:
            out.error = f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} before the deadline"
            log.warning("round %d group %s failed: %s", round_no, group, out.error)
            return out
        finally:
            if not local_task.done():  # our columns go on for the others until their own deadline
                local_task.add_done_callback(lambda t: t.cancelled() or t.exception())
                self._outliving.add(local_task)
                local_task.add_done_callback(self._outliving.discard)
        values = [
            self.codec.result.decode_parts(messages, bounds[c + 1] - bounds[c])
            for c, (messages, _) in enumerate(columns)
        ]
        out.tensor, out.sent = torch.cat(values), torch.cat(sent)
        out.counted = all(took) and all(own for _, own in columns)
        return out

    async def _column(
        self,
        round_no: int,
        group: str,
        grid: Grid,
        c: int,
        part: Part,
        bounds: list[int],
        column_run: ColumnRun,
        deadline: float,
        out: GridOutcome,
    ) -> list[torch.Tensor] | None:
        """All-reduce our row's combination of column ``c`` with its other holders, and serve the result."""
        uid = f"{group}/c{c}"
        key = pack([round_no, uid])
        messages = None
        try:
            values = part.result[bounds[c] - part.start : bounds[c + 1] - part.start]
            tensor = self.feedback.compensate(uid, values)
            res = await column_run(uid, tensor, part.weight, set(grid.holders(c)))
            out.bytes_sent += res.bytes_sent
            out.bytes_received += res.bytes_received
            if res.messages is not None:
                self.feedback.settle(uid, tensor, res.sent)
                messages = res.messages
        except Exception as exc:  # the column is served as failed: members ask another holder
            log.warning("round %d column %s failed: %r", round_no, uid, exc)
        self.server.publish(key, messages, max(deadline - time.monotonic(), 1.0) + 5.0)
        return messages

    async def _fetch_column(
        self,
        round_no: int,
        group: str,
        grid: Grid,
        c: int,
        row: int,
        local: asyncio.Future,
        deadline: float,
        out: GridOutcome,
        column_members: ColumnMembers | None,
    ) -> tuple[list[torch.Tensor], bool]:
        """Column ``c``'s encoded result and whether our row's holder served it (our row is in it):
        from our grid's holders of it, then from whoever joined the column."""
        key = pack([round_no, f"{group}/c{c}"])
        holders = grid.holders(c, first_row=row)
        if holders[0] == self.peer_id:
            messages = (await asyncio.shield(local)).get(c)
            if messages is not None:
                return messages, True
            holders = holders[1:]
        errors, asked = [], set()
        for sweep in range(2):
            if sweep and column_members is not None:
                try:
                    holders = [p for p in await column_members(f"{group}/c{c}") if p not in asked and p != self.peer_id]
                except Exception as exc:
                    errors.append(f"its members: {type(exc).__name__}")
                    holders = []
            for i, holder in enumerate(holders):
                remaining = deadline - time.monotonic()
                last = sweep == 1 and i == len(holders) - 1
                budget = remaining if last else max(remaining / 2, min(remaining, 2.0))
                asked.add(holder)
                try:
                    messages = await asyncio.wait_for(self.client.fetch(holder, key, out, column=True), budget)
                    return messages, holder == grid.holder(row, c)
                except Exception as exc:
                    errors.append(f"{holder[:8]}: {type(exc).__name__}")
        raise TransportError(f"no holder served column {c} ({', '.join(errors) or 'none asked'})")
