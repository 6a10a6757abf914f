"""What a sync round reports: typed records for the trainer's metrics, the peer's DHT record and tests."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from p2p_spes.averaging.wire_meter import Traffic


@dataclass
class GroupReport:
    """One averaging group of a round, as this peer saw it."""

    ok: bool
    members: int
    group_id: str
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    error: str | None = None
    refused: str | None = None  # why the result was not applied (the update guard), when it was not
    retries: int | None = None  # parts sent or fetched again after a stream was cut short, when any
    attempts: int | None = None  # times the group formed, when a failed transfer made it form again
    lost: list[str] | None = None  # members of its first attempt missing from the one that succeeded
    rows: int | None = None  # rows of a shared group run as a grid (p2p_spes/averaging/grid.py), when it was
    partial: bool | None = None  # a grid's result that our own contribution missed part of, when it did

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class RoundReport:
    """One sync round of one peer: its groups, what it moved and what it agreed on."""

    round: int
    step: int
    groups: dict[str, GroupReport] = field(default_factory=dict)  # "shared", "expert3", ...
    seconds: float = 0.0
    bytes_sent: int = 0  # every byte our streams sent during the round, whatever for (``traffic``)
    bytes_received: int = 0  # every byte they received
    traffic: dict[str, Traffic] = field(default_factory=dict)  # by purpose: averaging, reducing, serving, ...
    experts_synced: bool = True  # the round averaged the experts (swarm.expert_sync_rounds); else none has a group
    refreshed: int = 0  # frozen experts brought to the agreed version
    refreshed_by_delta: int = 0  # of which rebuilt from their group's encoded average
    taken_agreed: int = 0  # experts we train taken at the agreed version (a private peer whose group missed a holder)
    refresh_missed: int = 0
    orphaned: list[int] = field(default_factory=list)  # experts no live peer trained this round
    orphans_agreed: int = 0
    versions_missing: int = 0  # members of the shared group whose digests did not arrive in time
    adopted_shared_from: str | None = None  # the peer whose agreed shared parameters we took after missing the group
    merge_alpha: float | None = None
    join_window: float = 0.0  # seconds the shared group waited for late arrivals (the first arrival's proposal)
    tokens: int = 0  # the tokens this peer contributed (its weight in the round)
    shared_digest: str = ""
    expert_digests: dict[str, str] = field(default_factory=dict)

    @property
    def shared(self) -> GroupReport:
        return self.groups["shared"]

    @property
    def outcome(self) -> str:
        """``averaged`` (the shared group had other members), ``alone`` (nobody else came: nothing was
        averaged), ``adopted`` (we missed the group and took its result) or ``failed``."""
        if self.shared.ok:
            return "averaged" if self.shared.members > 1 else "alone"
        return "adopted" if self.adopted_shared_from else "failed"

    @property
    def failed_groups(self) -> list[str]:
        return sorted(g for g, v in self.groups.items() if not v.ok)

    def summary(self) -> dict[str, Any]:
        """What the inspector shows of a round (published in the peer's record, so kept small)."""
        return {
            "round": self.round,
            "step": self.step,
            "members": self.shared.members,
            "ok": self.outcome == "averaged",
            "outcome": self.outcome,
            "seconds": round(self.seconds, 3),
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "failed_groups": len(self.failed_groups),
        }

    def metrics(self, step: int) -> dict[str, Any]:
        """The line the trainer logs for this round (``metrics.jsonl``), at training step ``step``."""
        return {
            "sync_round": self.round,
            "step": step,
            "sync_seconds": round(self.seconds, 3),
            "outcome": self.outcome,
            "shared_ok": self.shared.ok,
            "shared_members": self.shared.members,
            "join_window": round(self.join_window, 2),
            "tokens_contributed": self.tokens,
            "shared_group": self.shared.group_id,
            "adopted_shared_from": self.adopted_shared_from,
            "groups_failed": self.failed_groups,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "traffic": {p: [t.sent, t.received] for p, t in self.traffic.items()},  # [sent, received] bytes
            "experts_synced": self.experts_synced,
            "refreshed": self.refreshed,
            "refreshed_by_delta": self.refreshed_by_delta,
            "taken_agreed": self.taken_agreed,
            "refresh_missed": self.refresh_missed,
            "orphaned": self.orphaned,
            "orphans_agreed": self.orphans_agreed,
            "versions_missing": self.versions_missing,
            "merge_alpha": self.merge_alpha,
            "shared_digest": self.shared_digest,
            "expert_digests": self.expert_digests,
            "groups": {name: g.to_dict() for name, g in self.groups.items()},
        }
