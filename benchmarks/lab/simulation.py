"""A discrete-event model of sync rounds at sizes one machine cannot run (100 to 1,000 peers).

**The project's own code** decides what it decides in a real run: who is in a group
(``membership.decide`` on the arrival records peers would write, with the join window each peer's
``pacing.Deadlines`` proposes from the arrivals it saw), the group's transfer deadline (the longest its
members propose, each ``Deadlines.transfer_timeout`` from the rates it observed), the size of every message
(``compression.Codec.wire_bytes``), where experts go (``placement.spes_block``; a restarted peer
resumes its own) and who takes over an expert whose holders died (``healing.plan_takeover``), and the
rule that a group attempt is all-or-nothing and is retried (``swarm.group_retries``) among the members
that survive it and the peers that arrived after it closed, formed after the failed attempt's deadline
(``allreduce.GroupAllReduce``, ``allreduce.HOLD``), or ``matchmaking.ABORT_HOLD`` after a kill that left
a reducer without a contribution; and, for a shared group of more than ``swarm.group_size``, its rows
and columns (``grid.make_grid``, ``grid.column_bounds``: who reduces which column and who holds it in
each row).

**What is modelled** instead of run: time. Each peer has a step time (log-normal around
``step_seconds``) and a symmetric link (uniform in ``mbit``); a round opens when the fastest live peer
finishes its ``sync_steps`` and every other peer arrives at the end of the step it is in (pacing), plus
up to 0.2 s of DHT latency. An all-reduce of ``n`` members lasts two phases of ``(n-1)/n`` of the
encoded tensor up and down at the slowest member's rate, plus 50 ms per phase; a peer then downloads
the encoded updates of the experts it holds frozen at its own rate. Each live peer fails at a
constant rate, on average ``fail_prob`` times per failure-free round (its steps, a join window and one
all-reduce among everyone), so a round stretched by a retry meets more failures: killed (restarts from
its checkpoint ``restart_rounds`` rounds later) or frozen (back the next round). A member that fails
after it arrived fails the attempt: a kill is noticed at once (at the transfers' start at the earliest),
a freeze at the deadline; a kill before the reduce-scatter's end (half the transfers) dooms the attempt
for everyone. Not modelled: the expert groups' own failures (their holders are the shared group's
members), the version exchange, merges, CPU contention, latency beyond the fixed per-phase cost, and
the two-boundary confirmation healing waits for (takeovers happen at once).
In a grid, a row that loses a member before its transfers end waits for it until the rows' deadline
(and so misses the columns that closed earlier); a column's holders form a flat group with its retry;
a member whose row's holder died fetches the column from another row at no extra cost; the results'
download takes the slowest member's time for the whole tensor.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field

from p2p_spes.averaging.allreduce import HOLD, relaxed_timeout
from p2p_spes.averaging.compression import Codec
from p2p_spes.averaging.grid import Grid, column_bounds, make_grid
from p2p_spes.averaging.matchmaking import ABORT_HOLD, DECISION_LAG
from p2p_spes.averaging.membership import decide
from p2p_spes.config import SwarmConfig
from p2p_spes.healing import plan_takeover
from p2p_spes.placement import spes_block
from p2p_spes.swarm.compat import codec_of
from p2p_spes.swarm.pacing import Deadlines

PHASE_LATENCY = 0.05  # seconds of round trips per all-reduce phase


@dataclass
class SimConfig:
    """One simulated swarm. Sizes default to spes-1b (shared 261M, 16 experts of 56.6M parameters)."""

    peers: int = 100
    rounds: int = 40
    experts: int = 16
    shared_params: int = 261_454_080
    expert_params: int = 56_623_104
    replicas: int = 1
    max_experts_per_peer: int = 4
    sync_steps: int = 50
    step_seconds: float = 1.0  # median step time
    speed_spread: float = 0.3  # sigma of log step time
    mbit: tuple[float, float] = (10.0, 100.0)
    fail_prob: float = 0.05  # per live peer per round
    kill_share: float = 0.5  # of failures; the rest are freezes
    restart_rounds: int = 3
    swarm: SwarmConfig = field(
        default_factory=lambda: SwarmConfig(compression="topk", matchmaking_time=30.0, averaging_timeout=600.0)
    )
    seed: int = 0


@dataclass
class _Peer:
    id: str
    step: float  # seconds per training step
    rate: float  # bytes per second, each way
    experts: list[int]
    deadlines: Deadlines
    dead_until: int = -1  # round at which a killed peer is back


@dataclass
class RoundOutcome:
    """One simulated round of the shared group."""

    round: int
    live: int  # peers alive at its start
    failed: int  # of which failed during the round
    members: int  # in the attempt that decided it
    applied: bool  # the shared group's average was applied (by its members, and adopted by late peers)
    attempts: int
    peers_applied: int  # members that applied + late peers that adopted
    seconds: float  # from the round's opening to the end of the shared group
    bytes_per_peer: float  # mean over live peers: shared group traffic + frozen-expert refresh
    coverage: float  # share of experts with a live holder at the round's start
    counted: float = 1.0  # share of the members' contributions the applied average holds (a grid may drop some)


@dataclass
class SimResult:
    config: SimConfig
    rounds: list[RoundOutcome]

    def summary(self) -> dict[str, float]:
        rs = self.rounds
        unfailed = sum(r.live - r.failed for r in rs)
        return {
            "peers": self.config.peers,
            "rounds": len(rs),
            "rounds_applied": sum(r.applied for r in rs) / len(rs),
            "peer_rounds_applied": sum(r.peers_applied for r in rs) / max(unfailed, 1),
            "retried_rounds": sum(r.attempts > 1 for r in rs) / len(rs),
            "seconds_per_round_median": statistics.median(r.seconds for r in rs),
            "seconds_per_round_p90": sorted(r.seconds for r in rs)[int(0.9 * (len(rs) - 1))],
            "mb_per_peer_round": statistics.fmean(r.bytes_per_peer for r in rs) / 1e6,
            "coverage_min": min(r.coverage for r in rs),
            "counted_mean": statistics.fmean(r.counted for r in rs if r.applied) if any(r.applied for r in rs) else 0.0,
            "mean_live": statistics.fmean(r.live for r in rs),
        }


def _all_reduce_seconds(codec: Codec, numel: int, rates: list[float]) -> tuple[float, int]:
    """Two phases at the slowest member's rate, and the bytes each member moves (both phases, both ways):
    contributions in the members' codec, averaged parts in that of a mean of n of them."""
    n = len(rates)
    if n < 2:
        return 0.0, 0
    # per direction; under sparse an averaged part is a bundle of the n members' messages
    out, back = (c.wire_bytes(numel, n if codec.forwards else 1) * (n - 1) / n for c in (codec, codec.result_for(n)))
    return (out + back) / min(rates) + 2 * PHASE_LATENCY, int(2 * (out + back))


def simulate(cfg: SimConfig) -> SimResult:
    """Run ``cfg.rounds`` rounds of ``cfg.peers`` peers (see the module docstring)."""
    rng = random.Random(cfg.seed)
    sw = cfg.swarm
    codec = codec_of(sw)
    peers = []
    for i in range(cfg.peers):
        pid = f"peer{i:05d}"
        peers.append(
            _Peer(
                pid,
                cfg.step_seconds * math.exp(rng.gauss(0, cfg.speed_spread)),
                rng.uniform(*cfg.mbit) * 1e6 / 8,
                spes_block(i, cfg.peers, cfg.experts),
                Deadlines(sw),
            )
        )
    expert_wire = codec.lone.wire_bytes(cfg.expert_params)  # a lone holder's update: a group of one
    outcomes = []
    for r in range(1, cfg.rounds + 1):
        # a killed peer restarts from its checkpoint at round dead_until, with its experts (--resume)
        live = [p for p in peers if p.dead_until <= r]
        if not live:
            continue  # every peer is down (restarting): no round happens
        coverage = len(_holders(live, r)) / cfg.experts
        t_open = min(p.step for p in live) * cfg.sync_steps
        # each live peer fails at a constant rate, fail_prob times per failure-free round on average (its
        # steps, a join window and one all-reduce among everyone): a round that runs long meets more of them
        nominal = (
            t_open + sw.matchmaking_time + _all_reduce_seconds(codec, cfg.shared_params, [p.rate for p in live])[0]
        )
        fails = (
            {p.id: (rng.expovariate(cfg.fail_prob / nominal), rng.random() < cfg.kill_share) for p in live}
            if cfg.fail_prob > 0
            else {}
        )
        arrival = {p.id: t_open + rng.uniform(0, p.step) + rng.uniform(0, 0.2) for p in live}
        present = [p for p in live if p.id not in fails or fails[p.id][0] > arrival[p.id]]
        by_id = {p.id: p for p in live}
        # each proposes the deadline it measured for an all-reduce among everyone present, as sync_round does
        _, expected_bytes = _all_reduce_seconds(codec, cfg.shared_params, [p.rate for p in present])
        # each asks for its quorum of the live peers it sees (the first arrival's counts: matchmaking.py)
        quorum = math.ceil(sw.quorum * len(live))
        records = {
            p.id: {
                "t": arrival[p.id],
                "m": p.deadlines.join_window(),
                "q": quorum,
                "d": p.deadlines.proposed_timeout(expected_bytes // 2),
            }
            for p in present
        }
        applied, attempts, moved, end, counted = False, 0, {}, t_open, 0.0
        members: list[str] = []
        late: list[str] = []
        if records:
            joined = opened = decide(records, sw.matchmaking_time)  # opened: the attempt under way
            members, late = joined.members, [p for p in records if p not in joined.members]
            for m in members:
                by_id[m].deadlines.observe_arrivals(joined.lateness)
            # a peer stops waiting once every live peer it expects is there (then a 0.5 s re-read)
            everyone = len(members) == len(live)
            start = (
                max(arrival[m] for m in members) if everyone else min(arrival[m] for m in members) + joined.window
            ) + 0.5
            grid = make_grid(members, sw.group_size)
            deadline = joined.deadline(sw.averaging_timeout)
            if grid is not None:
                applied, end, counted, attempts = _grid_round(
                    grid, start, joined.window, deadline, fails, by_id, codec, cfg, moved
                )
            while grid is None:
                attempts += 1
                if len(members) < 2:
                    break  # alone: nothing averaged (at a retry, nothing applied either)
                seconds, nbytes = _all_reduce_seconds(codec, cfg.shared_params, [by_id[m].rate for m in members])
                for m in members:
                    moved[m] = moved.get(m, 0) + nbytes
                # (a member that died after it arrived, in the join window too: it was in, its part is missing)
                lost = {m: fails[m] for m in members if m in fails and fails[m][0] < start + min(seconds, deadline)}
                if not lost and seconds <= deadline:
                    applied, end, counted = True, start + seconds, 1.0
                    for m in members:
                        by_id[m].deadlines.observe_transfer(nbytes // 2, seconds)
                    break
                # a kill is noticed at once (a dial at the transfers' start at the earliest), a freeze (or a link
                # too slow) at the deadline; one before the reduce-scatter ended left a reducer without a
                # contribution, so nobody can have finished and the retry forms at once (allreduce.py)
                kills = [max(t, start) for t, kill in lost.values() if kill]
                noticed = min(kills or [start + deadline])
                doomed = bool(kills) and noticed < start + seconds / 2
                if attempts > sw.group_retries:
                    end = noticed
                    break
                # the late peers of the first attempt join its retry too (allreduce.GroupAllReduce.run)
                survivors = [
                    m for m in members + (late if attempts == 1 else []) if not (m in fails and fails[m][0] <= noticed)
                ]
                # the retry forms once the failed attempt has ended for every member: its deadline counted
                # from the latest the members read the decision (allreduce.py), + HOLD
                reform = (
                    noticed + ABORT_HOLD
                    if doomed
                    else max(noticed, opened.first + opened.window + DECISION_LAG + deadline + HOLD)
                )
                # each proposes twice the deadline it measured (at most the configured one), as allreduce does
                retry = {
                    m: {
                        "t": noticed + rng.uniform(0, 0.3),
                        "m": sw.matchmaking_time,
                        "d": relaxed_timeout(by_id[m].deadlines.proposed_timeout(nbytes // 2), sw.averaging_timeout),
                    }
                    for m in survivors
                }
                if not retry:
                    end = noticed
                    break
                reformed = opened = decide(retry, sw.matchmaking_time)
                members, deadline = reformed.members, reformed.deadline(sw.averaging_timeout)
                late = [p for p in late if p not in members]
                start = reform + 0.5 + rng.uniform(0, 0.3)
        refresh = []
        for p in live:
            frozen = cfg.experts - len(p.experts)
            refresh.append(moved.get(p.id, 0) + frozen * expert_wire)
        fails = {pid: f for pid, f in fails.items() if f[0] < end}  # later ones belong to the next round's draw
        for pid, (_, kill) in fails.items():
            if kill:
                by_id[pid].dead_until = r + cfg.restart_rounds
        failed_now = set(fails)
        outcomes.append(
            RoundOutcome(
                round=r,
                live=len(live),
                failed=len(fails),
                members=len(members),
                applied=applied,
                attempts=attempts,
                peers_applied=(
                    len([m for m in members if m not in failed_now]) + len([p for p in late if p not in failed_now])
                )
                if applied
                else 0,
                seconds=end - t_open,
                bytes_per_peer=statistics.fmean(refresh),
                coverage=coverage,
                counted=counted if applied else 0.0,
            )
        )
        _heal(peers, r + 1, cfg)
    return SimResult(cfg, outcomes)


def _grid_round(
    grid: Grid,
    start: float,
    window: float,
    timeout: float,
    fails: dict[str, tuple[float, bool]],
    by_id: dict[str, _Peer],
    codec: Codec,
    cfg: SimConfig,
    moved: dict[str, int],
) -> tuple[bool, float, float, int]:
    """A shared group run as a grid (``grid_allreduce.py``): rows, then a flat all-reduce per column among
    its holders (retried like any group), then every member fetches every column, within the group's
    agreed transfer deadline ``timeout``. Returns whether the
    average was applied, when the group ended, the share of the members' contributions it holds and the
    most attempts a column took."""
    sw = cfg.swarm
    bounds = column_bounds(cfg.shared_params, grid.columns)
    wire = [codec.wire_bytes(bounds[c + 1] - bounds[c]) for c in range(grid.columns)]
    members = [p for row in grid.rows for p in row]

    # rows: every member sends each row member the wire bytes of its columns; a row that lost a member
    # waits for it until the row deadline, then its holders come to the columns with what they have
    row_end, row_in = {}, {}
    for k, row in enumerate(grid.rows):
        rate = min(by_id[m].rate for m in row)
        up = {m: sum(wire[c] for c in grid.columns_of(m)) for m in row}
        seconds = (sum(wire) - min(up.values())) / rate + PHASE_LATENCY
        gone = [m for m in row if m in fails and fails[m][0] < start + seconds]  # (it had arrived)
        row_end[k] = start + timeout if gone else start + seconds
        row_in[k] = [m for m in row if m not in gone]
        for m in row:
            moved[m] = moved.get(m, 0) + (sum(wire) - up[m]) + up[m] * (len(row) - 1)
    applied, end, counted, attempts = True, start, 0, 1
    for c in range(grid.columns):
        holders = {grid.row_of(h): h for h in grid.holders(c)}
        arrived = {
            k: row_end[k] for k, h in holders.items() if h in row_in[k] and fails.get(h, (math.inf,))[0] > row_end[k]
        }
        if not arrived:
            return False, max(row_end.values()), 0.0, 1
        first = min(arrived.values())
        close = min(max(arrived.values()), first + window)  # all came, or the window closed on the late
        in_column = [k for k, t in arrived.items() if t <= close]
        col_start = close + 0.5
        ok = False
        for attempt in range(1 + sw.group_retries):
            attempts = max(attempts, attempt + 1)
            names = [holders[k] for k in in_column]
            rate = min(by_id[h].rate for h in names)
            cols = max(len(grid.columns_of(h)) for h in names)
            seconds, moved_each = _all_reduce_seconds(codec, (bounds[c + 1] - bounds[c]), [rate] * len(names))
            seconds *= cols  # a holder's link carries all of its columns at once
            for h in names:
                moved[h] = moved.get(h, 0) + moved_each
            gone = [
                k for k in in_column if holders[k] in fails and col_start <= fails[holders[k]][0] < col_start + seconds
            ]
            if not gone:
                ok, col_end = True, col_start + seconds
                break
            in_column = [k for k in in_column if k not in gone]
            col_start += timeout + HOLD + 0.5  # the retry forms after the failed attempt's deadline
            if len(in_column) < 2:  # alone at a retry: it fails (the others may have applied the attempt)
                break
        if not ok:
            applied = False
            end = max(end, col_start)
            continue
        counted += sum(len(row_in[k]) for k in in_column)
        # results: each member fetches the column from a holder (its own row's, or another's)
        for m in members:
            if c not in grid.columns_of(m):
                moved[m] = moved.get(m, 0) + wire[c]
        for k in in_column:
            moved[holders[k]] = moved.get(holders[k], 0) + wire[c] * (len(grid.rows[k]) - 1)
        end = max(end, col_end)
    fetch = max(sum(wire) / by_id[m].rate for m in members) + PHASE_LATENCY
    if applied:
        # what each member's deadlines learn from the transfers, as sync_round's do: not a row's that
        # waited for a lost member (its members report it lost)
        for k, row in enumerate(grid.rows):
            if len(row_in[k]) == len(row):
                for m in row:
                    by_id[m].deadlines.observe_transfer(moved.get(m, 0), end + fetch - start)
    return applied, end + fetch, counted / (grid.columns * len(members)) if applied else 0.0, attempts


def _holders(peers: list[_Peer], r: int) -> dict[int, int]:
    """Live holders per expert at round ``r``."""
    out: dict[int, int] = {}
    for p in peers:
        if p.dead_until <= r:
            for e in p.experts:
                out[e] = out.get(e, 0) + 1
    return out


def _heal(peers: list[_Peer], r: int, cfg: SimConfig) -> None:
    """Takeovers planned by ``healing.plan_takeover`` from the peers live at round ``r``."""
    live = [p for p in peers if p.dead_until <= r]
    held = {p.id: p.experts for p in live}
    plan = plan_takeover(held, {p.id: cfg.max_experts_per_peer for p in live}, cfg.experts, cfg.replicas)
    for p in live:
        p.experts = sorted(set(p.experts) | set(plan.get(p.id, [])))
