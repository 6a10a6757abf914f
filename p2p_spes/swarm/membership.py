"""Who is in the run: the live peers' records, our own record and heartbeat, the model check, and claims.

Every peer publishes a :class:`~dht.records.PeerRecord` under the run's peers key and renews it every
``swarm.heartbeat`` seconds; a record that lapses (``swarm.record_ttl``) or says ``left`` takes the peer
out of everyone's view. Joining peers claim a data partition and experts here, and settle racing claims
by claim time (``placement.py`` holds the rules, this module the DHT side of them).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from hivemind.utils import get_dht_time

from dht.keys import config_key, peers_key, run_config_key
from dht.reachability import SeenReachable, private_of
from dht.records import PeerRecord
from dht.run_config import run_config_record
from p2p_spes import __version__
from p2p_spes.config import Config
from p2p_spes.placement import free_partition, least_covered
from p2p_spes.swarm.compat import Ours, RunView, check_run, sync_settings_of
from p2p_spes.swarm.counters import SwarmCounters
from p2p_spes.swarm.runtime import Runtime

log = logging.getLogger(__name__)
MAX_SEEN = 32  # peers remembered for a redial
PROBES = 3  # peers the DHT lacks that a heartbeat pings (a group cut off from the rest meets it again)
# seconds a read of the live peers stands in for a new one at a round boundary: the reconnect check reads
# them, then the are-we-behind check and the round would read them again before the peer arrives
FRESH = 2.0


class Membership:
    """Our record (status, experts, counters) and our view of everyone else's."""

    def __init__(
        self, runtime: Runtime, cfg: Config, stats: SwarmCounters, experts: Callable[[], list[int] | None]
    ) -> None:
        """``experts`` returns the experts we train now (None before a model exists: the claimed ones)."""
        self.runtime, self.cfg, self.stats = runtime, cfg, stats
        self.peer_id = runtime.peer_id
        self.fingerprint = cfg.model_fingerprint()
        self.status: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._experts = experts
        self._claimed: list[int] = []
        self._published: list[tuple[str, dict[str, Any]]] = []  # model and run config, renewed with the record
        self._heartbeat: asyncio.Future | None = None
        self.members: set[str] = set()  # peers with a valid record (private runs: proof of the secret)
        self.seen: dict[str, None] = {}  # other live peers we read, in order, newest last: whom to redial if cut off
        self._isolated = False
        self._redial: asyncio.Task | None = None
        self.run_config = run_config_record(cfg)  # published once the model check passed
        self._last_read: tuple[float, dict[str, PeerRecord]] | None = None  # (monotonic time, live peers)
        self.reachable_seen = SeenReachable()  # who may reduce for a group of clients

    # Views of the others ---------------------------------------------------------------------
    def live_peers(self, max_age: float = 0.0) -> dict[str, PeerRecord]:
        """Peers with a current record for this model that have not announced leaving (us included); with ``max_age``,
        our last read if it is that recent (a read costs a DHT lookup; ``inf``: none, ever, so safe on the loop)."""
        last = self._last_read
        if max_age == float("inf") or (max_age > 0 and last is not None and time.monotonic() - last[0] < max_age):
            return dict(last[1]) if last is not None else {}
        records = self.runtime.call(self.runtime.get(peers_key(self.runtime.run_id)))
        out = {}
        for peer, value in records.items():
            record = PeerRecord.from_value(peer, value)
            if record is not None and record.fingerprint == self.fingerprint and not value.get("left"):
                out[peer] = record
        self.remember(p for p in out if p != self.peer_id)
        self._last_read = (time.monotonic(), dict(out))
        self.reachable_seen.update(out, records, self._last_read[0], self.peer_id)
        return out

    def remember(self, peers: Any) -> None:
        """Keep the ``MAX_SEEN`` peers read most recently (whom ``stay_connected`` pings if we are cut off)."""
        with self._lock:  # the heartbeat reads it on the loop's thread
            fresh = list(peers)
            self.seen = dict.fromkeys(([p for p in self.seen if p not in fresh] + fresh)[-MAX_SEEN:])

    def others(self, max_age: float = 0.0) -> dict[str, PeerRecord]:
        return {p: r for p, r in self.live_peers(max_age).items() if p != self.peer_id}

    def reach_others(self, within: float) -> bool:
        """Whether another live peer answers; when none does although we read some before, redial them and
        read again for up to ``within`` seconds before believing we are alone.

        A peer thawed after a long stop reads nothing until its DHT finds its neighbours again: believing
        itself alone, it would take over every expert and run its rounds alone. If nobody answers in
        time they are forgotten, so a peer whose swarm really left waits once."""
        if not self.seen or self.others():
            return bool(self.seen)
        log.warning(
            "no other peer of the run answers (we read %d before): reconnecting for up to %.0f s",
            len(self.seen),
            within,
        )
        with self._lock:
            known = list(reversed(self.seen))  # newest first
        give_up = time.monotonic() + within
        table = (-1, -1)  # the DHT's neighbours before and after the last redial (-1: it did not answer)
        while time.monotonic() < give_up:
            try:
                table = self.runtime.call(self.runtime.redial(known, force=True))
            except Exception as exc:
                log.info("redial failed: %s", exc)
            found = self.others()
            if found:
                self.stats.reconnects += 1
                log.warning("reached the run again (%d other peers)", len(found))
                return True
            time.sleep(min(self.cfg.swarm.heartbeat, 1.0))
        log.warning(
            "none of the %d peers we knew answered in %.0f s (the DHT knew %d neighbours, %d after the "
            "last redial): going on alone",
            len(known),
            within,
            *table,
        )
        with self._lock:
            self.seen.clear()
        return False

    def swarm_step(self) -> int | None:
        """The median step the other live peers report, or None when we are alone."""
        steps = sorted(r.step for r in self.others().values())
        return steps[len(steps) // 2] if steps else None

    def sole_experts(self, local: list[int]) -> list[int]:
        """Those of ``local`` that no other live peer trains (their newest version is ours)."""
        others = {e for r in self.others().values() for e in r.experts}
        return [e for e in local if e not in others]

    async def refresh_members(self) -> set[str]:
        """Re-read who has a valid record (called by the state RPC when an unknown peer asks)."""
        self.members = set(await self.runtime.get(peers_key(self.runtime.run_id)))
        return self.members

    def check_model(self, data: str | None = None, tokenizer: str | None = None) -> None:
        """Refuse to join a run that trains a different model, or (given our ``data`` and ``tokenizer``
        fingerprints) on other data; nothing of ours is sent before this."""
        rt = self.runtime
        ours = self.cfg.model_defining()
        sync = sync_settings_of(self.cfg.swarm, self.cfg.train.max_steps)
        check_run(
            rt.run_id,
            self.peer_id,
            RunView(rt.call(rt.get(config_key(rt.run_id))), rt.call(rt.get(run_config_key(rt.run_id)))),
            Ours(self.fingerprint, ours, sync, self.run_config["hash"], data, tokenizer),
        )
        model_record = {"fingerprint": self.fingerprint, "model": ours, "sync": sync}
        if data is not None:
            model_record.update(data=data, tokenizer=tokenizer)
            self.run_config = {**self.run_config, "data_fingerprint": data}
        self._published = [
            (config_key(rt.run_id), model_record),
            (run_config_key(rt.run_id), self.run_config),
        ]
        for key, value in self._published:
            rt.call(rt.store(key, value, ttl=self.cfg.swarm.record_ttl))

    # Placement -------------------------------------------------------------------------------
    def data_partition(self, preferred: int | None = None) -> int:
        """The data partition no other live peer reads (``preferred``, a restarting peer's own, when
        free); it is also the SPES block index of ``experts.placement: spes`` (placement.py)."""
        used = Counter(r.extra.get("data_partition") for r in self.others().values())
        return free_partition(used, self.cfg.peer.count, preferred)

    def choose_experts(self, partition: int) -> list[int]:
        """The experts a peer reading ``partition`` trains: that partition's SPES block (``spes``), the
        explicit list, or the least-covered experts by the live peers' records (as many as the block)."""
        cfg = self.cfg
        if cfg.experts.placement in ("spes", "explicit"):
            return cfg.local_experts(partition)
        holders = Counter(e for r in self.others().values() for e in r.experts)
        return least_covered(
            holders, cfg.moe.num_experts, cfg.experts_per_partition(partition), self.peer_id, cfg.swarm.replicas
        )

    def claim(self, experts: list[int], partition: int) -> None:
        """Publish our experts and data partition at once, so peers joining right after us see them taken."""
        self._claimed = list(experts)
        with self._lock:
            self.status["data_partition"] = partition
            self.status.setdefault("claimed_at", get_dht_time())
        self.announce()

    def settle_claim(self, partition: int, experts: list[int], attempts: int = 3) -> tuple[int, list[int]]:
        """Resolve racing joins: peers that claimed at the same moment may have picked the same data
        partition (and SPES block) or the same experts, leaving others without a reader or holder. The
        later claimant (by claim time, then peer id) re-picks from the others' claims while a partition
        is free or an expert lacks holders; bounded to ``attempts`` looks, one short wait each."""
        cfg = self.cfg
        num_experts, replicas, count = cfg.moe.num_experts, cfg.swarm.replicas, cfg.peer.count
        for _ in range(attempts):
            time.sleep(min(cfg.swarm.heartbeat, 1.5))
            others = self.others()
            ours = (self.status["claimed_at"], self.peer_id)
            earlier = {p: r for p, r in others.items() if (float(r.extra.get("claimed_at", float("inf"))), p) < ours}
            used = Counter(r.extra.get("data_partition") for r in others.values())
            taken = any(r.extra.get("data_partition") == partition for r in earlier.values())
            full = all(used.get(i) for i in range(count))  # more peers than partitions: sharing is expected
            moved = free_partition(used, count) if taken and not full else partition
            if cfg.experts.placement in ("spes", "explicit"):
                chosen = cfg.local_experts(moved)
            else:
                holders = Counter(e for r in others.values() for e in r.experts)
                clash = [e for e in experts if any(e in r.experts for r in earlier.values()) and holders[e] >= replicas]
                short = [e for e in range(num_experts) if holders[e] < replicas and e not in experts]
                chosen = sorted(experts)
                if (clash and short) or moved != partition:
                    chosen = least_covered(
                        holders, num_experts, cfg.experts_per_partition(moved), self.peer_id, replicas
                    )
            if moved == partition and chosen == sorted(experts):
                return partition, experts
            log.info(
                "data partition %d / experts %s were claimed first by another peer: reading partition %d, "
                "training %s instead",
                partition,
                experts,
                moved,
                chosen,
            )
            partition, experts = moved, chosen
            self.claim(experts, partition)
        return partition, experts

    # Our record ------------------------------------------------------------------------------
    def update_status(self, **fields: Any) -> None:
        with self._lock:
            self.status.update(fields)

    def record(self, left: bool = False) -> dict[str, Any]:
        """Our record as published: experts, step, round, counters and the status fields."""
        with self._lock:
            status = dict(self.status)
        experts = self._experts()
        sw = self.cfg.swarm
        extra = {
            "version": __version__,
            "time": get_dht_time(),
            "num_experts": self.cfg.moe.num_experts,
            "replicas": sw.replicas,
            "residency": sw.residency,
            "max_experts": sw.max_experts_per_peer or self.cfg.moe.num_experts,
            **status,
            **self.stats.as_dict(),
        }
        if left:
            extra["left"] = True
        return PeerRecord(
            self.peer_id,
            list(self._claimed if experts is None else experts),
            int(extra.pop("step", 0)),
            int(extra.pop("round", -1)),
            self.fingerprint,
            self.runtime.maddrs,
            extra=extra,
        ).to_value()

    def announce(self) -> None:
        self.runtime.call(self.publish())

    async def publish(self) -> None:
        await self.runtime.store(peers_key(self.runtime.run_id), self.record(), ttl=self.cfg.swarm.record_ttl)

    def start_heartbeat(self) -> None:
        self._heartbeat = self.runtime.submit(self._heartbeat_loop())

    async def stay_connected(self) -> None:
        """Rejoin the DHT through peers we saw and our initial peers when it lost every neighbour, and ping
        ``PROBES`` of them it lacks at every heartbeat (``dht.node.Redial``).

        Without this a peer cut off for a while (stopped, or its link down) that the others dropped in
        turn would read no records again: it would see itself alone and take over every expert."""
        private = private_of(self.live_peers(float("inf")))  # DHT clients: they answer no ping (dht/reachability.py)
        with self._lock:
            known = [p for p in self.seen if p not in private]
        if not known and not self.runtime.initial_peer_ids:
            return  # the run's first peer, before a reachable peer joined: there is nobody to reach
        random.shuffle(known)  # the probes take turns
        try:
            before, after = await self.runtime.redial(known, probe=PROBES)
        except Exception as exc:  # a background task: say what failed rather than lose it
            log.warning("checking the DHT's neighbours failed: %s", exc)
            return
        if before != 0:
            if after > before:
                log.info("met %d DHT neighbours we had lost", after - before)
            self._isolated = False
            return
        if after > 0:
            self.stats.dht_redials += 1
            log.warning("the DHT had lost every neighbour; reconnected through the peers we knew (%d now)", after)
        elif not self._isolated:
            log.warning(
                "the DHT has lost every neighbour and none of the %d peers we knew answered; retrying every %.0f s",
                len(self.seen) + len(self.runtime.initial_peer_ids),
                self.cfg.swarm.heartbeat,
            )
        self._isolated = after == 0

    async def _heartbeat_loop(self) -> None:
        while True:
            if self._redial is None or self._redial.done():  # apart: pinging dead peers must not delay our record
                self._redial = asyncio.create_task(self.stay_connected())
            try:
                await self.publish()
                for key, value in self._published:  # the model and run config live as long as a peer does
                    await self.runtime.store(key, value, ttl=self.cfg.swarm.record_ttl)
            except Exception as exc:
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self.cfg.swarm.heartbeat)

    def announce_leaving(self) -> None:
        """Stop the heartbeat and say we left, so our experts' coverage drops at once.

        The DHT keeps, per subkey, the value that expires last: the departure must expire after the last
        heartbeat's record (written up to ``heartbeat`` seconds ago with ``record_ttl``), or nodes drop it
        and the peer looks alive until that record lapses."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        try:
            ttl = self.cfg.swarm.record_ttl + 1.0
            self.runtime.call(
                self.runtime.store(peers_key(self.runtime.run_id), self.record(left=True), ttl=ttl), timeout=5
            )
        except Exception as exc:
            log.warning("could not announce leaving: %s", exc)


def with_current_records(peers: dict[str, PeerRecord], membership: Membership, me: str) -> dict[str, PeerRecord]:
    """``peers`` (read at our boundary) updated with the records as they are once the shared group is
    decided. A peer that ended the last round after we began this one, and took over an expert then,
    announced it before it joined the shared group; read at our boundary, it is not yet a holder, and
    each of us would average that expert alone, leaving its holders with different versions for a
    round. Our own record stays ours; if the DHT does not answer, the boundary's view stands."""
    try:
        current = membership.live_peers()
    except Exception as exc:
        log.info("could not re-read the peers' records (%s): the expert groups follow our boundary's", exc)
        return peers
    return {**peers, **{p: r for p, r in current.items() if p != me}}


def holder_groups(
    peers: dict[str, PeerRecord], present: set[str], me: str, experts: Iterable[int]
) -> dict[int, set[str]]:
    """Whom we average each of our ``experts`` with: the peers of ``present`` whose record says they
    train it, and us."""
    return {e: {p for p, r in peers.items() if e in r.experts and p in present} | {me} for e in experts}
