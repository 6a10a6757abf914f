"""One sync round of one peer, no server anywhere:

1. the shared parameters' pseudo-gradient (``anchor - current``, plus what our last message dropped)
   is all-reduced across every live peer, encoded with the run's codec and weighted by tokens since
   the last sync; every member applies the same decoded average to the same anchor (``outer.py``);
2. each expert this peer trains is all-reduced the same way among that expert's holders, all groups
   at once (a lone holder's group is itself, through the same codec), in the rounds
   ``swarm.expert_sync_rounds`` says (:func:`experts_due`); in the others a holder keeps training
   and serves the expert's anchor, so the frozen copies stay where they are;
3. digests of what each peer now holds are published; every peer brings the experts it does not
   train to the agreed digest (``agreement.py``): from the group's encoded average when its copy is
   the group's anchor, else by downloading the whole expert once;
4. at merge rounds every peer applies the same warm-up merge to the same state.

A group that fails (a peer died, a deadline passed) is discarded whole: the peer keeps its own values
for that group and tries again next round. A peer that missed the shared group adopts the result the
others agreed on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from dht.keys import group_key, peers_key, version_key
from dht.reachability import private_of
from dht.records import PeerRecord, VersionRecord
from p2p_spes.averaging import (
    GroupAllReduce,
    GroupResult,
    arrival_delays,
    tensor_digest,
)
from p2p_spes.config import SwarmConfig
from p2p_spes.merging import merge_alpha
from p2p_spes.model import MoETransformer
from p2p_spes.swarm.adoption import Adopter
from p2p_spes.swarm.agreement import Refresher, adoptable, all_published, wait_versions
from p2p_spes.swarm.apply import GroupApplier
from p2p_spes.swarm.counters import SwarmCounters
from p2p_spes.swarm.membership import FRESH, Membership, holder_groups, with_current_records
from p2p_spes.swarm.outer import OuterOptimizer, UpdateGuard, flatten
from p2p_spes.swarm.pacing import PUBLISH_LAG, Deadlines, adopt_window, version_ttl, version_window
from p2p_spes.swarm.report import RoundReport
from p2p_spes.swarm.runtime import Runtime
from p2p_spes.swarm.state import Downloader, StateServer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedOutcome:
    """What the shared group decided for the rest of the round: who took part and whom the expert
    groups wait for."""

    decided: bool  # the group's membership is the round's, with or without us
    late: bool  # the group closed without us
    members: frozenset[str]  # its members (every peer we expected, when undecided)
    peers: dict[str, PeerRecord]  # the live peers' records, re-read once the membership was decided
    lateness: dict[str, float]  # every arrival's delay after the first (the next join window is fitted to it)

    @property
    def present(self) -> set[str]:
        """Whom the expert groups expect: a peer that missed the shared group is dead, frozen or late, and
        waiting for it in every expert group would cost one join window per expert. When we are the late
        one, the group's members expect nobody else."""
        return set() if self.late else set(self.members)


def experts_due(every: int, round_no: int, last: bool) -> bool:
    """Whether round ``round_no`` averages the experts (and so refreshes every frozen copy): every
    ``every``-th round and the run's last, so that no expert's training is left out of the final model.
    Every peer decides alike from the round's number, with no message."""
    return every <= 1 or last or round_no % every == 0


@dataclass
class ExpertCycle:
    """What a holder remembers of its experts between the rounds that average them.

    ``tokens``: per expert we train, the tokens trained since its last group applied; an expert round
    weighs each holder by the training its pseudo-gradient carries (K rounds, fewer for a holder that
    came in since, more after a failed group), not by the last round's tokens. ``failed``: our experts
    whose last group failed, flagged in our digests until a round averages them again, so that nobody
    takes the stale anchor we serve in the rounds between for the agreed version."""

    tokens: dict[int, float] = field(default_factory=dict)
    failed: frozenset[int] = frozenset()

    def trained(self, local: Iterable[int], tokens: float) -> None:
        """A round's training; experts we no longer train are forgotten, new ones start from zero."""
        self.tokens = {e: self.tokens.get(e, 0.0) + tokens for e in local}

    def averaged(self, local: Iterable[int], failed: Iterable[int]) -> None:
        """A round that averaged the experts: the applied ones start over, the failed ones carry on."""
        self.failed, local = frozenset(failed), set(local)
        self.tokens = {e: (n if e in self.failed else 0.0) for e, n in self.tokens.items() if e in local}

    def weight(self, expert: int) -> float:
        return max(self.tokens.get(expert, 0.0), 1e-6)


class RoundRunner:
    """Runs sync rounds with the parts of a :class:`~p2p_spes.swarm.Swarm`."""

    def __init__(
        self,
        sw: SwarmConfig,
        runtime: Runtime,
        membership: Membership,
        reducer: GroupAllReduce,
        server: StateServer,
        downloader: Downloader,
        refresher: Refresher,
        outer: OuterOptimizer,
        guard: UpdateGuard,
        deadlines: Deadlines,
        stats: SwarmCounters,
    ) -> None:
        self.sw, self.runtime, self.membership, self.reducer = sw, runtime, membership, reducer
        self.server, self.downloader, self.refresher = server, downloader, refresher
        self.outer, self.deadlines, self.stats = outer, deadlines, stats
        self.peer_id = runtime.peer_id
        self.applier = GroupApplier(reducer, server, outer, guard, deadlines, stats)
        self.adopter = Adopter(self.peer_id, server, downloader, refresher, outer, self.applier.feedback, stats)
        self.last_versions: dict[str, VersionRecord] = {}  # the digests published in our last round, by peer
        self.cycle = ExpertCycle()

    def run(
        self,
        model: MoETransformer,
        round_no: int,
        step: int,
        weight: float,
        last: bool = False,
    ) -> RoundReport:
        """One round on ``model`` (see the module docstring); ``last``: the run's last round."""
        t0 = time.monotonic()
        marks = self.stats.wire.snapshot()  # what our streams carried before the round
        peers = self.membership.live_peers(FRESH)  # the boundary's checks read them a moment ago
        peers[self.peer_id] = PeerRecord.from_value(self.peer_id, self.membership.record())
        report = RoundReport(round=round_no, step=step, tokens=int(weight))
        weight = max(float(weight), 1e-6)
        window = self.deadlines.join_window()
        sending: dict[str, torch.Tensor] = {}  # uid -> the pseudo-gradient (with residual) we send
        shared = self._shared_group(model, round_no, peers, weight, window, sending, report)
        report.experts_synced = experts_due(self.sw.expert_sync_rounds, round_no, last)
        self.cycle.trained(model.local_experts, weight)
        if report.experts_synced:
            groups_end = self._expert_groups(model, round_no, shared, window, sending, report)
            self.cycle.averaged(
                model.local_experts, {e for e in model.local_experts if f"expert{e}" in report.failed_groups}
            )
        else:
            groups_end = self._hold_experts(model)
        self.server.take_snapshot(round_no, step, self.outer.momentum)
        self._agree(model, round_no, shared, report, groups_end)
        self._merge_if_due(model, round_no, step, report)
        report.seconds = time.monotonic() - t0
        self._finish(model, report, marks)
        return report

    def _shared_group(
        self,
        model: MoETransformer,
        round_no: int,
        peers: dict[str, PeerRecord],
        weight: float,
        window: float,
        sending: dict[str, torch.Tensor],
        report: RoundReport,
    ) -> SharedOutcome:
        """Phase 1: the shared parameters' group across every live peer, applied; what it decided."""
        shared = [p for _, p in model.shared_parameters()]
        flat = flatten(shared)
        res = self.runtime.call(
            self.reducer.run(
                round_no,
                "shared",
                self.applier.contribution("shared", flat, sending),
                weight,
                set(peers),
                window=window,
                timeout=self._group_timeout(flat, peers, peers),
                base=self.outer.base("shared"),
                rebase=self.adopter.rebase("shared", flat.numel()),
                bounded=True,
                quorum=self.sw.quorum,
            )
        )
        report.groups["shared"] = self.applier.apply(res, shared, "shared", flat, sending, round_no)
        report.join_window = res.window
        late = not res.ok and bool(res.members) and self.peer_id not in res.members
        decided = res.ok or late
        if decided:
            peers = with_current_records(peers, self.membership, self.peer_id)
        members = frozenset(res.members) if decided else frozenset(peers)
        return SharedOutcome(decided=decided, late=late, members=members, peers=peers, lateness=res.lateness)

    def _expert_groups(
        self,
        model: MoETransformer,
        round_no: int,
        shared: SharedOutcome,
        window: float,
        sending: dict[str, torch.Tensor],
        report: RoundReport,
    ) -> float:
        """Phase 2: every expert we train, averaged among its holders, all groups at once (they share one
        join window and one deadline, where one after another a member that froze mid-round would cost
        a window or a timeout per expert); a lone holder's copy is the truth. Returns the latest deadline
        of our groups (monotonic; 0.0 with none): the others' groups, begun with ours, end by about then."""
        flats = {e: flatten(model.expert_tensors(e)) for e in model.local_experts}
        groups = holder_groups(shared.peers, shared.present, self.peer_id, flats)
        pooled = [e for e in flats if len(groups[e]) > 1]

        async def expert_groups() -> list[GroupResult]:
            # the groups share the link: each one's deadline is for all of their bytes together
            payload = torch.empty(sum(flats[e].numel() for e in pooled))
            return await asyncio.gather(
                *(
                    self.reducer.run(
                        round_no,
                        f"expert{e}",
                        self.applier.contribution(f"expert:{e}", flats[e], sending),
                        self.cycle.weight(e),
                        groups[e],
                        window=window,
                        timeout=self._group_timeout(payload, groups[e], shared.peers),
                        base=self.outer.base(f"expert:{e}"),
                        rebase=self.adopter.rebase(f"expert:{e}", flats[e].numel()),
                        # its holders were in the shared group but end its transfers apart (a client's
                        # parts come through a reducer's link): held open for them, not closed on the first
                        quorum=self.sw.quorum,
                    )
                    for e in pooled
                )
            )

        results = dict(zip(pooled, self.runtime.call(expert_groups()))) if pooled else {}
        for e, flat in flats.items():
            uid = f"expert:{e}"
            res = results[e] if e in results else self.reducer.solo(self.applier.contribution(uid, flat, sending)())
            report.groups[f"expert{e}"] = self.applier.apply(res, model.expert_tensors(e), uid, flat, sending, round_no)
        return max((r.deadline_at for r in results.values()), default=0.0)

    def _hold_experts(self, model: MoETransformer) -> float:
        """Phase 2 in a round that does not average the experts: each expert we train keeps its anchor
        (what we serve and publish, and what every frozen copy holds) while our weights train on; the
        next round that averages it sends what we trained since as one pseudo-gradient."""
        for e in model.local_experts:
            self.outer.ahead.add(f"expert:{e}")
        return 0.0

    def _agree(
        self, model: MoETransformer, round_no: int, shared: SharedOutcome, report: RoundReport, groups_end: float
    ) -> None:
        """Phase 3: publish the digests of what we now hold, wait for the others', adopt the shared result
        if we missed the group, and bring the experts we do not train to the agreed versions. A member
        whose digest is missing may still be in its expert groups (a client's go through a reducer's link
        and can take far longer than ours): we wait for it until our groups' deadline has passed."""
        sw, peers = self.sw, shared.peers
        # experts no live peer trains: every peer keeps a copy, and the copies must agree
        held = model.held_experts()
        orphaned = [e for e in range(model.moe_cfg.num_experts) if not any(e in r.experts for r in peers.values())]
        mine = VersionRecord(
            self.peer_id,
            report.shared.ok,
            self.server.current("shared")["digest"],
            {e: self.server.current(f"expert:{e}")["digest"] for e in model.local_experts},
            {e: tensor_digest(model.expert_tensors(e)) for e in orphaned if e in held},
            group=report.shared.members if report.shared.ok else 0,
            failed=self.cycle.failed & frozenset(model.local_experts),
        )
        self.runtime.call(
            self.runtime.store(version_key(self.runtime.run_id, round_no), mine.to_value(), ttl=version_ttl(sw))
        )
        # wait for the digests of the peers that took part in this round; a peer that did not join the
        # shared group is dead or late, and waiting for it would only slow everyone down
        adopting = not report.shared.ok and not report.shared.refused
        # adopting, with the group's membership known: its members that applied an attempt hold the same
        # bits, so the first result one of them publishes is the result; we end the round when they do
        # (once each has published, as they wait for each other), at most a version window after the
        # first. Ending later would make the adopter late for the next round, to adopt again; ending at
        # the first result would make it open the next round before the members come, to a group of adopters
        candidates = set(shared.members) if shared.decided else None

        async def held_until() -> float:  # read on the loop that changes the parts
            return max(self.reducer.server.adopted_until(round_no), groups_end + PUBLISH_LAG)

        versions = wait_versions(
            self.runtime,
            round_no,
            set(shared.members),
            adopt_window(sw) if adopting else version_window(sw),
            enough=(lambda vs: bool(adoptable(vs, self.peer_id, candidates))) if adopting else None,
            after=version_window(sw),
            complete=(lambda vs: all_published(adoptable(vs, self.peer_id, candidates))) if shared.decided else None,
            hold=lambda: self.runtime.call(held_until()),
        )
        report.versions_missing = len(shared.members - set(versions))
        if adopting:
            report.adopted_shared_from = self.adopter.adopt_shared(model, round_no, versions, candidates)
        # the next join window counts every arrival in the group's key, the late ones included: a window
        # fitted to the members alone shrinks to the fast peers' spread and shuts the slower ones out
        # for good (each of them adopts, late, every round; its tokens are lost every time)
        if shared.lateness:
            key = group_key(self.runtime.run_id, round_no, "shared")
            self.deadlines.observe_round(shared.lateness, arrival_delays(self.runtime.call(self.runtime.get(key))))
        # choose versions from the shared group's members first: a late peer (thawed, or out of its group)
        # publishes a digest some members see and others do not, and must not tip anyone's choice
        agreed = {p: v for p, v in versions.items() if p in shared.members} if shared.decided else versions
        self.last_versions = versions
        frozen = [e for e in held if e not in model.local_experts]  # none in partial residency
        by_delta = self.stats.delta_refreshes
        report.refreshed, report.refresh_missed = self.refresher.refresh(model, peers, frozen, versions, agreed)
        if not self.reducer.reachable:
            report.taken_agreed = self.adopter.take_agreed_own(model, round_no, peers, versions, agreed, report)
        report.refreshed_by_delta = self.stats.delta_refreshes - by_delta
        report.orphaned = orphaned
        # an expert a peer trained this round is not orphaned, even if its record came too late for
        # our snapshot of the live peers (a joiner): its holder's version, refreshed above, stands
        trained = {e for v in versions.values() for e in v.experts}
        report.orphans_agreed = self.refresher.agree_on_copies(
            model, [e for e in orphaned if e in held and e not in trained], agreed
        )

    def _merge_if_due(self, model: MoETransformer, round_no: int, step: int, report: RoundReport) -> None:
        """Phase 4: the warm-up merge at merge rounds, while its alpha is above 0."""
        sw = self.sw
        if sw.merge_interval and step % sw.merge_interval == 0:
            alpha = merge_alpha(step, sw.merge_alpha_start, sw.merge_decay_steps)
            if alpha > 0:
                if self.runtime.reachability.reachable:  # private peers may still be refreshing from our copies
                    self.server.keep_copies(round_no)
                self.applier.merge(model, alpha)
                self.server.take_snapshot(round_no, step, self.outer.momentum)
                report.merge_alpha = alpha

    def _finish(self, model: MoETransformer, report: RoundReport, marks: dict[str, tuple[int, int]]) -> None:
        """Phase 5: the round's bytes (every byte our streams carried since ``marks``), digests and
        outcome into ``report`` and the counters."""
        report.traffic = self.stats.wire.since(marks)
        report.bytes_sent = sum(t.sent for t in report.traffic.values())
        report.bytes_received = sum(t.received for t in report.traffic.values())
        public = self.outer.public_values(model)  # what we serve where our weights run ahead of it
        report.shared_digest = tensor_digest(public.get("shared", [p.detach() for _, p in model.shared_parameters()]))
        report.expert_digests = {
            str(e): tensor_digest(public.get(f"expert:{e}", model.expert_tensors(e))) for e in model.held_experts()
        }
        self.stats.count_round(report.outcome)

    def _group_timeout(self, flat: torch.Tensor, members: Iterable[str], peers: dict[str, PeerRecord]) -> float | None:
        """The transfer deadline we propose for an all-reduce of ``flat`` among ``members`` (None: not
        measured yet), for its busiest link: a reducer's. With every member reducing each moves about
        (m - 1) / m of a contribution and of an averaged part each way; with only R of them reachable (the
        others are clients; an outsider reduces for a group of clients) a reducer moves (m - 1) / R."""
        members = set(members) | {self.peer_id}
        private = private_of({p: r for p, r in peers.items() if p in members and p != self.peer_id})
        private |= set() if self.reducer.reachable else {self.peer_id}
        m = max(len(members), 2)
        reducers = max(m - len(private), 1)
        codec = self.reducer.codec
        wire = codec.wire_bytes(flat.numel()) + codec.result.wire_bytes(flat.numel(), m)  # (sparse: a bundle of m)
        return self.deadlines.proposed_timeout(int(wire * (m - 1) / reducers), scale=m / reducers if private else 1.0)

    def publish_record(self) -> None:
        """Renew our record at once with this round in it (not waiting for the heartbeat)."""
        self.runtime.submit(
            self.runtime.store(peers_key(self.runtime.run_id), self.membership.record(), ttl=self.sw.record_ttl)
        )
