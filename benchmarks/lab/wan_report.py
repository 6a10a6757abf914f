"""What a swarm run did, per peer and per sync round, read back from each peer's ``metrics.jsonl`` and ``summary.json``.

The WAN lab (``benchmarks/wan.py``, ``tests/test_wan.py``) asks of a run on slow links and unequal
CPUs: did every round have every peer in it, how long did rounds take and how many bytes did they
move, how many steps did each peer compute and how many did it skip or jump over, how many of its
tokens went into averaged rounds, what share of its wall time was spent computing, and did all peers
end with bit-identical weights. Nothing here runs a swarm: it reads the files peers leave behind, so
it also reads runs of older code (fields added later, ``outcome``, ``tokens_contributed``,
``schedule_jump``, ``tokens_averaged``, are derived when possible and ``None`` otherwise). Step
records are complete only with ``train.log_interval=1``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from p2p_spes.metrics_log import read_metrics
from p2p_spes.run_summary import read_summary


@dataclass
class RoundRow:
    """One peer's view of one sync round."""

    peer: int
    round: int
    step: int
    members: int  # peers in its shared group
    outcome: str  # averaged | alone | adopted | failed
    seconds: float
    bytes_sent: int
    bytes_received: int
    downloaded_bytes: int  # state downloads in the round (refreshes, catch-up, adoption)
    tokens_contributed: int | None
    schedule_jump: int | None
    shared_digest: str
    expert_digests: dict[str, str]
    time: float  # when it was logged (its end), wall clock
    shared_error: str | None = None  # why its shared group failed, when it did

    @property
    def began(self) -> float:
        return self.time - self.seconds


@dataclass
class PeerReport:
    """One peer's run: its rounds and where its steps, tokens and wall time went."""

    peer: int
    rounds: list[RoundRow]
    final_step: int  # the schedule position it ended at
    start_step: int  # the step it started from (a joiner's catch-up puts it at the swarm's step)
    started_at: float  # wall clock when its first step began (after its catch-up download)
    steps_computed: int  # training steps it actually ran (step records)
    steps_jumped: int  # schedule moved on after rounds (summed ``schedule_jump``)
    steps_skipped: int  # steps given up to rejoin the swarm after missing rounds (summary)
    tokens: int  # tokens it processed
    tokens_averaged: int | None  # its tokens that went into rounds averaged with others
    compute_seconds: float
    wall_seconds: float
    final_val_loss: float | None
    bytes_sent: int
    bytes_received: int
    compression: str = "none"  # the run's codec (summary)
    role: str = "public"  # whether others could dial it: public, or private (a client of the rounds)

    @property
    def averaged_share(self) -> float | None:
        return None if self.tokens_averaged is None or not self.tokens else self.tokens_averaged / self.tokens

    @property
    def compute_share(self) -> float:
        return self.compute_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "rounds"}
        return {
            **out,
            "averaged_share": self.averaged_share,
            "compute_share": self.compute_share,
            "rounds": [r.__dict__ for r in self.rounds],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], compression: str | None = None) -> PeerReport:
        """A report written by :meth:`to_dict` (``compression`` for files written before it was kept)."""
        names = {f.name for f in fields(cls)} - {"rounds"}
        values = {k: v for k, v in d.items() if k in names}
        if compression is not None and "compression" not in d:
            values["compression"] = compression
        return cls(rounds=[RoundRow(**r) for r in d["rounds"]], **values)


@dataclass
class SwarmReport:
    """Every peer's report and whether they ended bit-identical."""

    peers: list[PeerReport]
    last_common_round: int | None
    identical: bool
    differences: list[str] = field(default_factory=list)  # why not identical

    def rounds_after_join(self) -> dict[int, list[RoundRow]]:
        """Per peer, the rounds every peer should be in: those no peer began before the last peer to join
        had caught up and started training (a round already under way may miss a joiner)."""
        if not self.peers:
            return {}
        joined = max(p.started_at for p in self.peers)
        began: dict[int, float] = {}
        for row in (r for p in self.peers for r in p.rounds):
            began[row.round] = min(began.get(row.round, row.began), row.began)
        return {p.peer: [r for r in p.rounds if began[r.round] >= joined] for p in self.peers}

    def describe_rounds(self) -> str:
        """Each peer's rounds in one line (members/outcome, and why its shared group failed): what a test
        prints when a round went wrong."""
        return "; ".join(
            f"peer {p.peer} (from step {p.start_step}, skipped {p.steps_skipped}): "
            + " ".join(
                f"r{r.round}:{r.members}/{r.outcome}" + (f" ({r.shared_error})" if r.shared_error else "")
                for r in p.rounds
            )
            for p in self.peers
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SwarmReport:
        """A report as :meth:`to_dict` wrote it (in a ``benchmarks.wan`` result file)."""
        compression = d.get("config", {}).get("swarm", {}).get("compression")
        return cls(
            [PeerReport.from_dict(p, compression) for p in d["peers"]],
            d["last_common_round"],
            d["identical"],
            list(d.get("differences", [])),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "last_common_round": self.last_common_round,
            "identical": self.identical,
            "differences": self.differences,
            "peers": [p.to_dict() for p in self.peers],
        }


def outcome_of(record: dict[str, Any]) -> str:
    """A round record's outcome; records of older code have no ``outcome`` field: derived the same way."""
    if "outcome" in record:
        return str(record["outcome"])
    if record.get("shared_ok"):
        return "averaged" if record.get("shared_members", 1) > 1 else "alone"
    return "adopted" if record.get("adopted_shared_from") else "failed"


def round_row(peer: int, record: dict[str, Any]) -> RoundRow:
    return RoundRow(
        peer=peer,
        round=int(record["sync_round"]),
        step=int(record.get("step", -1)),
        members=int(record.get("shared_members", 0)),
        outcome=outcome_of(record),
        seconds=float(record.get("sync_seconds", 0.0)),
        bytes_sent=int(record.get("bytes_sent", 0)),
        bytes_received=int(record.get("bytes_received", 0)),
        downloaded_bytes=int(record.get("traffic", {}).get("downloading", [0, 0])[1]),
        tokens_contributed=record.get("tokens_contributed"),
        schedule_jump=record.get("schedule_jump"),
        shared_digest=str(record.get("shared_digest", "")),
        expert_digests=dict(record.get("expert_digests", {})),
        time=float(record.get("time", 0.0)),
        shared_error=record.get("groups", {}).get("shared", {}).get("error"),
    )


def read_peer(run_dir: Path, peer: int) -> PeerReport:
    """The report of the peer whose run directory is ``run_dir`` (``<swarm run dir>/peer<i>``)."""
    records = read_metrics(run_dir)
    summary: dict[str, Any] = read_summary(run_dir)
    steps = [r for r in records if "step_time_s" in r]
    rounds = [round_row(peer, r) for r in records if "sync_round" in r]
    start = steps[0]["step"] - 1 if steps else 0
    began = 0.0
    if steps:  # the first step ran before the first record: its own, or a round's its hooks ran (logged first)
        first = records[0]
        began = first["time"] - float(first.get("sync_seconds", 0.0)) - steps[0]["step_time_s"]
    ended = max((r["time"] for r in records if "time" in r), default=began)
    return PeerReport(
        peer=peer,
        rounds=rounds,
        final_step=int(summary.get("step", steps[-1]["step"] if steps else 0)),
        start_step=int(start),
        started_at=began,
        steps_computed=len(steps),
        steps_jumped=sum(r.schedule_jump or 0 for r in rounds),
        steps_skipped=int(summary.get("steps_skipped", 0)),
        tokens=int(summary.get("tokens", steps[-1]["tokens"] if steps else 0)),
        tokens_averaged=summary.get("tokens_averaged"),
        compute_seconds=sum(float(r["step_time_s"]) for r in steps),
        wall_seconds=max(ended - began, 0.0),
        final_val_loss=summary.get("final_val_loss"),
        bytes_sent=int(summary.get("bytes_sent", 0)),
        bytes_received=int(summary.get("bytes_received", 0)),
        compression=str(summary.get("compression") or "none"),
        role=str((summary.get("reachability") or {}).get("role") or "public"),
    )


def compare_final(peers: list[PeerReport]) -> tuple[int | None, list[str]]:
    """The last round every peer logged, and how the peers' weights differ after it (empty: identical).

    Identical means equal shared digests and expert digests in that round and, without compression,
    equal final validation losses (the loss is computed on the weights at the end, so it also covers
    steps after the round). Under a lossy codec the digests are of the published values: a lone holder
    trains on its own weights, which run ahead of what it publishes, so the final losses differ by design.
    """
    if not peers or any(not p.rounds for p in peers):
        return None, ["a peer logged no round"]
    common = set.intersection(*({r.round for r in p.rounds} for p in peers))
    if not common:
        return None, ["no round common to every peer"]
    last = max(common)
    rows = [next(r for r in reversed(p.rounds) if r.round == last) for p in peers]
    differences = []
    if len({r.shared_digest for r in rows}) > 1:
        differences.append(f"round {last}: shared digests differ")
    if len({json.dumps(r.expert_digests, sort_keys=True) for r in rows}) > 1:
        differences.append(f"round {last}: expert digests differ")
    losses = {p.final_val_loss for p in peers}
    exact = all(p.compression == "none" for p in peers)
    if exact and (len(losses) > 1 or None in losses):
        differences.append(f"final validation losses differ or are missing: {[p.final_val_loss for p in peers]}")
    return last, differences


def read_swarm(run_dir: Path, peers: int) -> SwarmReport:
    """The report of a swarm whose peers ran in ``run_dir/peer0`` ... ``run_dir/peer<peers-1>``."""
    reports = [read_peer(Path(run_dir) / f"peer{i}", i) for i in range(peers)]
    last, differences = compare_final(reports)
    return SwarmReport(peers=reports, last_common_round=last, identical=not differences, differences=differences)
