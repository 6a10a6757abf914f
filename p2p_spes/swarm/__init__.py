"""A peer of the swarm: joins the DHT, picks experts, syncs with the others every ``sync_steps``, leaves.

:class:`Swarm` is a small facade over parts that each own one idea and are tested alone:

- ``runtime.py``: the event-loop thread, the DHT, bounded DHT reads and writes;
- ``membership.py``: live peers, our record and heartbeat, the model check, claims of partitions/experts;
- ``state.py``: the snapshot this peer serves over the state RPC, and digest-checked downloads;
- ``agreement.py``: published digests, the one majority rule, refreshing experts to the agreed version;
- ``outer.py``: the outer step (average or Nesterov), its anchors and momentum, the update guard;
- ``pacing.py``: when a round opens (the swarm's progress, not our step count) and measured deadlines;
- ``sync_round.py``: one sync round -> :class:`RoundReport` (``report.py``);
- ``coverage.py``: the self-healing takeover plan and fetching experts to take over;
- ``data_server.py``: the run's data files, served to and fetched from peers.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from dht.auth import load_auth
from dht.reachability import RECORD_FIELD, private_of
from dht.records import PeerRecord
from p2p_spes.averaging import GroupAllReduce, build_aggregator, tensor_digest
from p2p_spes.config import Config
from p2p_spes.data_manifest import FileEntry, Manifest
from p2p_spes.errors import SwarmError
from p2p_spes.memory import SyncMemory
from p2p_spes.model import MoETransformer
from p2p_spes.swarm.agreement import Refresher
from p2p_spes.swarm.compat import codec_of
from p2p_spes.swarm.counters import SwarmCounters
from p2p_spes.swarm.coverage import Coverage
from p2p_spes.swarm.data_server import DataServer, Holding, PeerSource, holders_of, holding, peer_sources
from p2p_spes.swarm.membership import FRESH, Membership
from p2p_spes.swarm.outer import OuterOptimizer, UpdateGuard
from p2p_spes.swarm.pacing import Deadlines, RoundWatch, linger, sync_deadline, version_window
from p2p_spes.swarm.report import GroupReport, RoundReport
from p2p_spes.swarm.runtime import Runtime
from p2p_spes.swarm.state import Downloader, StateServer
from p2p_spes.swarm.sync_round import RoundRunner

__all__ = ["GroupReport", "RoundReport", "Swarm", "sync_deadline", "version_window"]
log = logging.getLogger(__name__)


class Swarm:
    """One peer's membership in a run: build the parts, then join, sync and leave."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        sw = cfg.swarm
        self.auth = load_auth(sw.secret_file, sw.allowed_peers)
        self.runtime = Runtime(sw, self.auth)
        self.stats = SwarmCounters(wire=self.runtime.meter)
        self.peer_id, self.maddrs = self.runtime.peer_id, self.runtime.maddrs
        self._model: MoETransformer | None = None
        self.rounds: list[RoundReport] = []
        self.membership = Membership(self.runtime, cfg, self.stats, experts=self._local_experts)
        self.update_status(**{RECORD_FIELD: self.runtime.reachability.role})  # nobody dials a private peer
        self.outer = OuterOptimizer(sw)
        self.server = StateServer(
            self.runtime,
            self.auth,
            self.stats,
            self.membership.refresh_members,
            anchors=lambda: self.outer.anchor,
            public=self.outer.public_values,
        )
        self.deadlines = Deadlines(sw)
        self.downloader = Downloader(
            self.runtime,
            self.stats,
            timeout=sw.averaging_timeout,
            deadlines=self.deadlines,
            private=lambda: private_of(self.membership.live_peers(math.inf)),  # our last read: no DHT request
        )
        self.watch = RoundWatch(self.runtime, poll=min(1.0, sw.matchmaking_time / 4))
        self.reducer = GroupAllReduce(
            self.runtime.dht,
            self.runtime.p2p,
            self.peer_id,
            self.runtime.run_id,
            owner=self.runtime.identity.owner,
            compression=codec_of(sw),
            matchmaking_time=sw.matchmaking_time,
            timeout=sw.averaging_timeout,
            aggregate=build_aggregator(sw.aggregation, trim_fraction=sw.trim_fraction, clip_tau=sw.clip_tau),
            retries=sw.group_retries,
            group_size=sw.group_size,
            reachable=self.runtime.reachability.reachable,
            # read on the loop's thread, when a group has no reachable member: our reads of a record lifetime, no DHT request
            helpers=lambda: self.membership.reachable_seen.within(sw.record_ttl, self.peer_id),
        )
        self.data_server = DataServer(self.runtime, self.auth, self.membership.refresh_members)
        self.runtime.call(self.reducer.start())
        self.runtime.call(self.server.start())
        self.runtime.call(self.data_server.start())
        self.refresher = Refresher(
            self.peer_id, self.downloader, self.stats, self.outer, self.reducer.codec.result, self.reducer.reachable
        )
        self.runner = RoundRunner(
            sw,
            self.runtime,
            self.membership,
            self.reducer,
            self.server,
            self.downloader,
            self.refresher,
            self.outer,
            UpdateGuard(sw.max_update_ratio),
            self.deadlines,
            self.stats,
        )
        self.coverage = Coverage(cfg, self.membership, self.downloader, self.stats)

    # The model the swarm reads, averages, serves and writes --------------------------------------
    @property
    def model(self) -> MoETransformer | None:
        return self._model

    def use_model(self, model: MoETransformer | None) -> None:
        """Point every part at ``model`` (the one the trainer trains)."""
        self._model = model
        self.server.model = model

    def _local_experts(self) -> list[int] | None:
        return None if self._model is None else self._model.local_experts

    # Membership ----------------------------------------------------------------------------------
    @property
    def status(self) -> dict[str, Any]:
        return self.membership.status

    def update_status(self, **fields: Any) -> None:
        self.membership.update_status(**fields)

    def live_peers(self) -> dict[str, PeerRecord]:
        return self.membership.live_peers()

    def check_model(self, data: str | None = None, tokenizer: str | None = None) -> None:
        self.membership.check_model(data, tokenizer)

    # The run's data ------------------------------------------------------------------------------
    def run_data_sources(self) -> list[PeerSource]:
        """Peers holding the data most of the run's peers hold (to read its manifest from)."""
        records = self.membership.others()
        counts = Counter(h.fingerprint for r in records.values() if (h := Holding.of(r)) is not None)
        if not counts:
            return []
        return peer_sources(self.runtime, records, counts.most_common(1)[0][0], self.peer_id)

    def data_holders(self, manifest: Manifest) -> Callable[[FileEntry], list[PeerSource]]:
        """A function giving, for a file of ``manifest``, the live peers that hold it."""

        def sources(entry: FileEntry) -> list[PeerSource]:
            return holders_of(self.runtime, self.membership.others(max_age=5.0), manifest, entry, self.peer_id)

        return sources

    def serve_data(self, manifest: Manifest, root: Path, held: list[str] | None) -> None:
        """Serve our data's files to peers and say in our record which train shards we hold."""
        self.data_server.serve(manifest, root, held)
        self.update_status(data=holding(manifest, held).as_record())

    def data_partition(self, preferred: int | None = None) -> int:
        return self.membership.data_partition(preferred)

    def choose_experts(self, partition: int) -> list[int]:
        return self.membership.choose_experts(partition)

    def claim(self, experts: list[int], partition: int) -> None:
        self.membership.claim(experts, partition)

    def settle_claim(self, partition: int, experts: list[int], attempts: int = 3) -> tuple[int, list[int]]:
        return self.membership.settle_claim(partition, experts, attempts)

    def announce(self) -> None:
        self.membership.announce()

    def swarm_step(self) -> int | None:
        return self.membership.swarm_step()

    def reach_others(self) -> bool:
        """Whether other live peers answer; a peer that read some before and now reads none tries to
        reach them again for up to two record lifetimes first (``Membership.reach_others``)."""
        return self.membership.reach_others(2 * self.cfg.swarm.record_ttl)

    def swarm_round(self) -> int | None:
        """The newest round another live peer has finished, or None when we are alone."""
        rounds = [r.round for r in self.membership.others(FRESH).values()]
        return max(rounds) if rounds else None

    # Pacing (pacing.py) --------------------------------------------------------------------------
    def expect_round(self, round_no: int) -> None:
        """Watch for ``round_no`` to open, so we join it when another peer starts it."""
        self.watch.expect(round_no)

    def round_opened(self, round_no: int) -> bool:
        """Whether another peer has arrived in ``round_no``'s shared group (or a later round's)."""
        return self.watch.opened(round_no)

    def sole_experts(self) -> list[int]:
        """Our experts that no other live peer trains (their newest version is ours)."""
        return self.membership.sole_experts(self._model.local_experts)

    def download(self, peer: str, uid: str, like: Sequence[torch.Tensor], attempts: int = 4):
        return self.downloader.download(peer, uid, like, attempts)

    # Joining -------------------------------------------------------------------------------------
    def attach(self, model: MoETransformer) -> None:
        """Start serving ``model`` and publishing our record."""
        self.use_model(model)
        self.server.take_snapshot(-1, 0, self.outer.momentum)
        self.outer.reset_anchors(model)
        self.update_status(serving=True)
        self.membership.start_heartbeat()
        self.watch.start()

    def catch_up(self, keep: Collection[int] = ()) -> dict[str, Any] | None:
        """Load the swarm's current shared parameters and experts from live peers (not from a file).

        Experts in ``keep`` are not downloaded: a peer that fell behind keeps the experts only it
        trains, whose latest version is its own. Returns the source's (round, step) meta, or None
        when no other peer serves weights yet or what it serves is what we hold already.
        """
        model = self._model
        # only peers that already serve a snapshot; others are starting up like us
        peers = {p: r for p, r in self.membership.others().items() if r.extra.get("serving")}
        if not peers:
            return None
        like = [p.detach() for _, p in model.shared_parameters()]
        errors: list[str] = []
        # the newest first, among the peers that can be dialled: a joiner's dials to a private one fail
        private = private_of(peers)
        order = sorted(peers, key=lambda p: (p in private, -peers[p].round, -peers[p].step, p))
        peers = {p: peers[p] for p in order}  # the experts' holders are asked in this order too
        if self._same_start(order[0], peers[order[0]].experts, like):
            return None  # nothing to take: we already hold what the run serves
        found = self.downloader.first_of(order, "shared", like, errors, attempts=4)
        if found is None:
            raise SwarmError("could not download the run's current weights from any live peer: " + "; ".join(errors))
        source, (meta, shared) = found
        model.write_shared(shared)
        self.outer.fetch_momentum(self.downloader, source, "shared", sum(t.numel() for t in like))
        wanted = [e for e in model.held_experts() if e not in set(keep)]
        fetched, _ = self.refresher.refresh(model, peers, wanted, any_copy=True)
        # the anchors are what we downloaded: the source's last agreed values unless its last round
        # failed, and then our first group sees the digests differ and takes the agreed one (a rebase),
        # so a joiner downloads the shared parameters once, not twice
        self.outer.reset_anchors(model, meta["round"])
        self.server.take_snapshot(meta["round"], meta["step"], self.outer.momentum)
        log.info(
            "caught up from %s at round %s step %s (%d experts fetched)", source, meta["round"], meta["step"], fetched
        )
        return meta

    def _same_start(self, source: str, its_experts: list[int], shared: list[torch.Tensor]) -> bool:
        """Whether the run has not synced yet and ``source`` serves the very weights we start from (the
        same seeded init, checked by digest for the shared parameters and every expert it trains): then
        there is nothing to download. On a slow link that saves a joiner the minutes it would spend
        fetching weights it already has, and the steps it would fall behind meanwhile."""
        model = self._model
        try:
            meta = self.downloader.meta(source, "shared")
            if meta.get("round") != -1 or meta.get("digest") != tensor_digest(shared):
                return False
            for e in (e for e in its_experts if e in model.held_experts()):
                theirs = self.downloader.meta(source, f"expert:{e}").get("digest")
                if theirs != tensor_digest(model.expert_tensors(e)):
                    return False
        except Exception as exc:  # an older peer, or a failed request: download as usual
            log.info("could not compare our weights with %s's (%s): downloading them", source, exc)
            return False
        log.info("the run has not synced yet and %s serves our own initial weights: nothing to download", source)
        self.server.take_snapshot(-1, 0, self.outer.momentum)
        self.stats.catch_up_skipped += 1
        return True

    # Sync ----------------------------------------------------------------------------------------
    def sync(self, round_no: int, step: int, weight: float, last: bool = False) -> RoundReport:
        """One round (``sync_round.py``; ``last``: the run's last), recorded and published in our status."""
        report = self.runner.run(self._model, round_no, step, weight, last)
        self.rounds.append(report)
        self.update_status(
            round=round_no,
            step=step,
            sync_seconds=round(report.seconds, 3),
            recent_rounds=[r.summary() for r in self.rounds[-5:]],
            **self.deadlines.describe(),
        )
        self.runner.publish_record()
        return report

    def sync_memory(self) -> SyncMemory:
        """Bytes of the sync state this peer keeps on the CPU (memory.py)."""
        outer = self.outer
        return SyncMemory(
            anchors=sum(t.numel() * t.element_size() for t in outer.anchor.values()),
            momentum=sum(t.numel() * t.element_size() for t in outer.momentum.values()),
            residuals=self.runner.applier.feedback.nbytes(),
            reducer_residuals=sum(t.numel() * t.element_size() for _, t in self.reducer.server.residual.values()),
        )

    # Self-healing coverage -----------------------------------------------------------------------
    def experts_to_take(self) -> list[int]:
        return self.coverage.experts_to_take(self._model.local_experts, self.runner.last_versions)

    def fetch_copy(self, expert: int) -> list[torch.Tensor] | None:
        return self.coverage.fetch_copy(self._model, expert)

    def took_on(self, experts: list[int], weights: dict[int, list[torch.Tensor]]) -> None:
        """After the model made ``experts`` local: load downloaded weights, serve them, announce."""
        model = self._model
        for e, tensors in weights.items():
            model.write_expert(e, tensors)
        for e in experts:
            self.outer.reanchor(f"expert:{e}", model.expert_tensors(e))
        last = self.rounds[-1] if self.rounds else None
        self.server.take_snapshot(last.round if last else -1, last.step if last else 0, self.outer.momentum)
        self.stats.experts_taken_over += len(experts)
        self.announce()
        log.warning("took over experts %s (now training %s)", experts, model.local_experts)

    # Leaving -------------------------------------------------------------------------------------
    def linger(self) -> None:
        """Keep serving after our last round until the others have refreshed from it (bounded)."""
        if self.rounds:
            linger(self.cfg.swarm, self.rounds[-1].round, self.membership.others, self.runtime.reachability.reachable)

    def leave(self) -> None:
        """Tell the others we are gone (our experts' coverage drops at once) and stop everything."""
        self.watch.stop()
        if self._model is not None:
            self.membership.announce_leaving()
        self.shutdown()

    def shutdown(self) -> None:
        self.runtime.shutdown()
