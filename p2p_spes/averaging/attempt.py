"""What one formation of a group averages and what it gives back: :class:`Attempt` (the request, passed
by keyword and never changed: a retry is a copy with other fields) and :class:`GroupResult` (the answer,
filled in by matchmaking and the transfers)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from p2p_spes.averaging.membership import Base
from p2p_spes.averaging.transport import TransportError

HOLD = 1.0  # seconds past a failed attempt's deadline before the next forms: members that finished say so by then

Rebase = Callable[[Base, list[str]], Awaitable[None]]
Contribution = torch.Tensor | Callable[[], torch.Tensor]


def relaxed_timeout(proposal: float | None, configured: float) -> float | None:
    """What a member proposes for a retry: twice the deadline it measured, at most ``configured`` (a
    round that lost a member is a disturbed one, and the members' rates were not measured under it)."""
    return None if proposal is None else min(2 * proposal, configured)


@dataclass(frozen=True, eq=False)
class Attempt:
    """One formation of ``group`` under the DHT key ``key`` (the group's name for the first attempt,
    ``group~N`` for the N-th), with what this member brings to it."""

    round_no: int
    group: str
    key: str
    tensor: Contribution  # flat fp32 on the CPU, or a function giving it once we hold the agreed base
    weight: float
    expected: frozenset[str]  # the peers we wait for (ourselves included or not)
    on_members: Callable[[], None] | None = None  # called once the membership is decided (or failed)
    window: float | None = None  # the join window we propose (None: the configured one)
    timeout: float | None = None  # the transfer deadline we propose (None: the configured one)
    base: Base | None = None  # what ``tensor`` is relative to (a pseudo-gradient's anchor)
    rebase: Rebase | None = None  # takes the group's agreed base from the members holding it
    hold_until: float | None = None  # a retry forms no earlier (monotonic): members that finished say so first
    bounded: bool = False  # a group larger than ``group_size`` runs as a grid
    quorum: int = 0  # members to wait for past the window (the first attempt only)
    abort: bool = False  # the previous attempt failed for everyone: form at once
    avoid: frozenset[str] = frozenset()  # outsiders that failed an earlier attempt: not asked to reduce again

    @property
    def is_retry(self) -> bool:
        return self.key != self.group


@dataclass
class GroupResult:
    tensor: torch.Tensor | None  # the group's average, decoded (the same bits on every member)
    members: list[str]
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    error: str | None = None
    transfer_seconds: float = 0.0  # from the membership decided to the result (or the failure)
    lateness: dict[str, float] = field(default_factory=dict)  # every arrival's delay after the first, seconds
    window: float = 0.0  # the join window the group used (the first arrival's proposal)
    sent: torch.Tensor | None = None  # our contribution as the reducers decoded it (error feedback)
    messages: list[torch.Tensor] = field(default_factory=list)  # the encoded averaged parts, in order
    base: Base | None = None  # the base the group agreed on
    retries: int = 0  # parts sent or fetched again after their stream was cut short
    attempts: int = 1  # times the group formed this round (a failed transfer is retried among those who come)
    lost: list[str] = field(default_factory=list)  # members of the first attempt missing from the one that succeeded
    retryable: bool = False  # failed in the transfers (not in matchmaking): the survivors may form again
    deadline_at: float = 0.0  # monotonic time by which the transfers had to end: any member done by then says so
    rows: int = 0  # rows of a bounded group run as a grid (0: one flat group)
    doomed: bool = False  # failed for every member (a reducer lacks our contribution): retry without waiting

    @property
    def ok(self) -> bool:
        return self.tensor is not None


async def based_tensor(attempt: Attempt, result: GroupResult, bases: dict[str, Base]) -> torch.Tensor:
    """Our tensor, once we hold the base the group agreed on (taken from a member that holds it)."""
    if attempt.base is not None and result.base is not None and result.base.digest != attempt.base.digest:
        holders = [p for p in result.members if p in bases and bases[p].digest == result.base.digest]
        if attempt.rebase is None:
            raise TransportError(f"the group agreed on base {result.base.digest[:12]}, we hold another")
        await attempt.rebase(result.base, holders)
    return attempt.tensor() if callable(attempt.tensor) else attempt.tensor
