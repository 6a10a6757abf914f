"""Where the members and coordinates of a large group go when it is all-reduced in bounded groups.

A group of N members, more than ``swarm.group_size`` (G), is cut into R = ceil(N / G) rows of at
most G members (dealt round-robin from the sorted members, so rows differ in size by one at most and
every member computes the same rows), and the flat tensor into G fixed *columns*
(``torch.tensor_split`` order, the same every round). In a row of n members, member i reduces a
contiguous run of the columns (``tensor_split(range(G), n)[i]``, at least one since n <= G). The
holders of column c are the members that reduce it, one per row: they all-reduce it among
themselves (``grid_allreduce.py``). No group has more than max(G, R) members.
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

    @cached_property
    def _row_of(self) -> dict[str, int]:
        return {p: k for k, row in enumerate(self.rows) for p in row}

    def row_of(self, peer: str) -> int:
        return self._row_of[peer]

    def columns_of(self, peer: str) -> range:
        """The columns ``peer`` reduces for its row."""
        row = self.rows[self.row_of(peer)]
        return _share(self.columns, len(row))[row.index(peer)]

    def holder(self, row: int, column: int) -> str:
        """The member of ``row`` that reduces ``column``."""
        members = self.rows[row]
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


def make_grid(members: list[str], size: int) -> Grid | None:
    """The grid of ``members`` (any order) in rows of at most ``size``; None when they fit in one group
    (``size`` 0: never cut)."""
    if size <= 0 or len(members) <= size:
        return None
    ordered = sorted(members)
    count = -(-len(ordered) // size)
    return Grid(tuple(tuple(ordered[k::count]) for k in range(count)), size)
