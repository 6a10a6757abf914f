"""Where the members and coordinates of a large group go when it is all-reduced in bounded groups.

A group of N members, more than ``swarm.group_size`` (G), is cut into R = ceil(N / G) rows of at
most G members (dealt round-robin from the sorted members, so rows differ in size by one at most and
every member computes the same rows), and the flat tensor into G fixed *columns*
(``torch.tensor_split`` order, the same every round). In a row of n members, member i reduces a
contiguous run of the columns (``tensor_split(range(G), n)[i]``, at least one since n <= G). The
holders of column c are the members that reduce it, one per row: they all-reduce it among
themselves (``grid_allreduce.py``). No group has more than max(G, R) members.

Members that cannot be dialled (clients) hold no columns: the reachable members are dealt first, then
the clients, each row sorted, and a row's columns are shared among its reachable members only. When
there are fewer reachable members than rows the group is not cut (the flat group has a role for clients).
Without clients the rows are exactly those above.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


def column_bounds(numel: int, columns: int) -> list[int]:
    """The start of each column in a flat tensor of ``numel`` values, and its end: ``columns + 1`` offsets."""
    sizes = [len(c) for c in torch.tensor_split(torch.empty(numel, dtype=torch.bool), columns)]
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return bounds


@dataclass(frozen=True)
class Grid:
    """Rows of members and the columns each member reduces; see the module docstring."""

    rows: tuple[tuple[str, ...], ...]
    columns: int
    clients: frozenset[str] = frozenset()  # members nobody can dial: they hold no columns

    @cached_property
    def _row_of(self) -> dict[str, int]:
        return {p: k for k, row in enumerate(self.rows) for p in row}

    def row_of(self, peer: str) -> int:
        return self._row_of[peer]

    def reducers(self, row: int) -> list[str]:
        """The members of ``row`` that hold its columns (those that can be dialled), in row order."""
        return [p for p in self.rows[row] if p not in self.clients]

    def columns_of(self, peer: str) -> range:
        """The columns ``peer`` reduces for its row (none for a client)."""
        if peer in self.clients:
            return range(0)
        reducers = self.reducers(self.row_of(peer))
        return _share(self.columns, len(reducers))[reducers.index(peer)]

    def holder(self, row: int, column: int) -> str:
        """The member of ``row`` that reduces ``column``."""
        members = self.reducers(row)
        for peer, share in zip(members, _share(self.columns, len(members))):
            if column in share:
                return peer
        raise ValueError(f"column {column} is outside the grid's {self.columns}")

    def holders(self, column: int, first_row: int = 0) -> list[str]:
        """The holder of ``column`` in every row, starting at ``first_row`` and wrapping around: the
        order a member of that row asks them for the column's result."""
        r = len(self.rows)
        return [self.holder((first_row + k) % r, column) for k in range(r)]


def _share(columns: int, members: int) -> list[range]:
    """Contiguous runs of ``range(columns)``, one per member, as ``tensor_split`` cuts them."""
    runs, start = [], 0
    for chunk in torch.tensor_split(torch.arange(columns), members):
        runs.append(range(start, start + len(chunk)))
        start += len(chunk)
    return runs


def make_grid(members: list[str], size: int, clients: set[str] | frozenset[str] = frozenset()) -> Grid | None:
    """The grid of ``members`` (any order) in rows of at most ``size``; None when they fit in one group
    (``size`` 0: never cut) or when fewer than one per row can be dialled (``clients``: those that cannot)."""
    if size <= 0 or len(members) <= size:
        return None
    count = -(-len(members) // size)
    clients = frozenset(clients) & set(members)
    if not clients:
        ordered = sorted(members)
        return Grid(tuple(tuple(ordered[k::count]) for k in range(count)), size)
    reachable = sorted(set(members) - clients)
    if len(reachable) < count:
        return None
    ordered = reachable + sorted(clients)
    return Grid(tuple(tuple(sorted(ordered[k::count])) for k in range(count)), size, clients)
