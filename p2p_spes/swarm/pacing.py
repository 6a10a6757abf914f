"""When rounds happen and how long they wait: paced by the swarm, with deadlines from measurements.

**Rounds follow the swarm, not each peer's step count.** A round opens when the first peer arrives in
its shared group: that peer has done ``sync_steps`` steps since the last round. Every other peer sees
the opening (a :class:`RoundWatch` polls the group's DHT key in the background) and joins at the end
of the step it is in, contributing the tokens it processed so far (the average is token-weighted).
A slower peer, or one just back from a long download, meets the same round instead of arriving
sync_steps of its own steps later; no step it computed is thrown away. After the round every member
takes the round's place in the schedule (``round * sync_steps``), so the learning-rate and merge
schedules follow the swarm's progress.

**Deadlines come from what the peers measured** (:class:`Deadlines`): the join window a peer proposes
is the recent lateness of the last arrivals (median + 4 MAD + 1 s), and a transfer's deadline is the
payload over the transfer rate this peer observed (3x, + 2 s), both bounded by the configured
``matchmaking_time`` and ``averaging_timeout``. A slow link does not time out every round, and a dead
peer does not hold the others for the configured maximum once the swarm knows how fast it is.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable

from dht.keys import group_key
from dht.reachability import private_of
from dht.records import PeerRecord
from p2p_spes.averaging import DECISION_LAG, HOLD, longest_wait
from p2p_spes.config import SwarmConfig
from p2p_spes.swarm.runtime import Runtime

log = logging.getLogger(__name__)


def median_and_mad(values: list[float]) -> tuple[float, float]:
    """The median and the median absolute deviation of ``values`` (robust to one odd round)."""
    mid = statistics.median(values)
    return mid, statistics.median(abs(v - mid) for v in values)


class Deadlines:
    """Join windows and transfer deadlines from this peer's recent measurements."""

    def __init__(self, sw: SwarmConfig, history: int = 8, min_samples: int = 3) -> None:
        self.sw = sw
        self.min_samples = min_samples
        self._lateness: deque[float] = deque(maxlen=history)  # per round: the last arrival's delay, s
        self._rates: deque[float] = deque(maxlen=4 * history)  # bytes per second of finished transfers
        self.floor = min(5.0, sw.averaging_timeout)  # no transfer deadline is shorter than this

    def observe_arrivals(self, lateness: dict[str, float]) -> None:
        """Record a group's arrivals (seconds after the first); the latest one bounds the next window."""
        if len(lateness) > 1:
            self._lateness.append(min(max(lateness.values()), self.sw.matchmaking_time))

    def observe_round(self, lateness: dict[str, float], after: dict[str, float]) -> None:
        """Record a round's arrivals: ``after`` (the group key read once the round is over, so it
        holds the peers that came after the group closed) unless it holds fewer than ``lateness`` (what
        the group read when it closed). Fitted to the members alone, the window shrinks to the fast
        peers' spread and shuts a slower peer out round after round."""
        self.observe_arrivals(after if len(after) >= len(lateness) else lateness)

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """Record a transfer that completed; small ones (< 64 kB) say more about latency than bandwidth."""
        if nbytes >= 65536 and seconds > 0:
            self._rates.append(nbytes / seconds)

    def join_window(self) -> float:
        """The join window to propose: recent lateness of the last arrivals, median + 4 MAD + 1 s."""
        if len(self._lateness) < self.min_samples:
            return self.sw.matchmaking_time
        mid, mad = median_and_mad(list(self._lateness))
        return min(max(mid + 4 * mad + 1.0, 1.0), self.sw.matchmaking_time)

    def transfer_timeout(self, nbytes: int, scale: float = 1.0) -> float:
        """The deadline for moving ``nbytes`` at the rate observed so far (3x the median time, + 2 s), at
        most ``scale`` x ``averaging_timeout`` (``scale`` > 1: a group whose few reducers carry more than
        every member reducing would)."""
        cap = self.sw.averaging_timeout * scale
        if len(self._rates) < self.min_samples:
            return cap
        rate, _ = median_and_mad(list(self._rates))
        return min(max(3 * nbytes / rate + 2.0, self.floor), cap)

    def proposed_timeout(self, nbytes: int, scale: float = 1.0) -> float | None:
        """The deadline to propose to a group (it keeps the longest proposed): None until our links are
        measured, so that a peer that knows nothing of them yet (a joiner, a restart) does not stretch
        every group it joins to the configured ``averaging_timeout``; it keeps the group's. A group with
        clients (``scale`` > 1) gets the scaled cap even then: the configured one is for all reducing."""
        if len(self._rates) < self.min_samples and scale <= 1.0:
            return None
        return self.transfer_timeout(nbytes, scale)

    def describe(self) -> dict[str, float]:
        """What the inspector and metrics show: the window and the median observed rate."""
        rate = statistics.median(self._rates) if self._rates else 0.0
        return {"join_window": round(self.join_window(), 2), "rate_MBps": round(rate / 1e6, 2)}


class RoundWatch:
    """Sees a round open (another peer arrived in its shared group) without waiting for our own boundary."""

    def __init__(self, runtime: Runtime, poll: float) -> None:
        self.runtime, self.poll = runtime, poll
        self._round: int | None = None  # the round we wait for
        self._opened: set[int] = set()
        self._task = None

    def start(self) -> None:
        self._task = self.runtime.submit(self._loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def expect(self, round_no: int) -> None:
        """Watch for ``round_no`` (and the one after it: a peer that sees that one open missed ours)."""
        self._round = round_no

    def opened(self, round_no: int) -> bool:
        return round_no in self._opened

    async def _loop(self) -> None:
        while True:
            watched = self._round
            try:
                if watched is not None and watched not in self._opened:
                    for r in (watched, watched + 1):
                        arrivals = await self.runtime.get(group_key(self.runtime.run_id, r, "shared"))
                        if any(p != self.runtime.peer_id for p in arrivals):
                            self._opened.update(range(watched, r + 1))
                            break
            except Exception as exc:  # a failed poll only delays the next look
                log.debug("round watch: %s", exc)
            await asyncio.sleep(self.poll)


PUBLISH_LAG = 3.0  # seconds from a member's last group deadline to its digests in the DHT (apply, hash, store)


def version_window(sw: SwarmConfig) -> float:
    """How long a peer waits after its groups for the others' digests: their rounds start up to a
    join window apart."""
    return sw.matchmaking_time + 2.0


def adopt_window(sw: SwarmConfig) -> float:
    """How long a peer that missed the shared group waits for the digests of those that made it: they
    publish after their transfers (up to an averaging timeout after the group closed) and expert groups,
    and without a digest of theirs there is no result to adopt."""
    return version_window(sw) + sw.averaging_timeout


def version_ttl(sw: SwarmConfig) -> float:
    """How long a digest stays in the DHT: a peer that missed the group reads it up to an adopt window
    after the members published it."""
    return sw.record_ttl + adopt_window(sw)


def sync_deadline(sw: SwarmConfig, peers: int | None = None) -> float:
    """The longest a sync round can hold a peer up, whatever the others do: join window (held open for
    its quorum up to ``longest_wait``) and averaging timeout, then a join window and a timeout once more
    per group retry (which forms ``HOLD`` after the failed attempt's deadline has passed for every
    member, ``DECISION_LAG`` after it has for the first), then the wait for the others' digests, which
    is longest when adopting their result (downloads of refreshed experts come on top, bounded by
    size). A shared group run as a grid (more than ``group_size`` of the swarm's ``peers``, or any
    number when not given) has its rows' deadline, a column's (and its retries') and the results' on top."""
    flat = (longest_wait(sw.matchmaking_time) if sw.quorum else sw.matchmaking_time) + sw.averaging_timeout
    flat += sw.group_retries * (sw.matchmaking_time + sw.averaging_timeout + HOLD + DECISION_LAG)
    if sw.group_size and (peers is None or peers > sw.group_size):
        flat += 2 * sw.averaging_timeout + sw.matchmaking_time
    return flat + adopt_window(sw)


def linger(sw: SwarmConfig, last: int, others: Callable[[], dict[str, PeerRecord]], reachable: bool) -> None:
    """After our ``last`` round, wait while other peers (their records from ``others()``) are still in an
    earlier one: they may be refreshing from our copies. A join window and a third of a timeout at most;
    a reachable peer waits for a private one up to a whole round (:func:`sync_deadline`): a private peer
    takes the experts only private peers train from a reachable peer's copy, and from nobody else."""
    start, bound = time.monotonic(), sw.matchmaking_time + sw.averaging_timeout / 3
    while time.monotonic() - start < bound:
        peers = others()
        behind = {p: r for p, r in peers.items() if r.round < last}
        if not behind:
            return
        if reachable and private_of(behind):
            bound = max(bound, sync_deadline(sw, len(peers) + 1))
        time.sleep(0.5)
