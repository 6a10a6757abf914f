"""How peers agree on one version of everything without a coordinator: published digests and one majority rule.

After its groups, every peer publishes a :class:`~dht.records.VersionRecord` for the round: the digest
of its shared parameters, of each expert it trains and of its copy of each expert nobody trains. Every
peer then brings the experts it does not train to the version the others name most often (ties to
the larger digest; a holder whose group failed counts only when no other holder names a version), so
all peers pick the same one from the same records, and downloads are asked for by that digest. A peer
whose copy is the anchor the version was computed from takes the group's encoded average instead
(``update:expert:E@digest``: a few percent of the expert under top-k, an eighth in int4 with
``swarm.lone_compression``) and applies the outer step the
members applied; the result must hash to the agreed digest, else the expert is downloaded whole, once.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from dht.keys import version_key
from dht.reachability import private_of, reachable_first
from dht.records import PeerRecord, VersionRecord
from p2p_spes.averaging import Codec, TransportError, tensor_digest
from p2p_spes.model import MoETransformer
from p2p_spes.swarm.counters import SwarmCounters
from p2p_spes.swarm.outer import OuterOptimizer, flatten, split_like
from p2p_spes.swarm.runtime import Runtime
from p2p_spes.swarm.state import Downloader

log = logging.getLogger(__name__)


def majority(digests: Iterable[Any]) -> str | None:
    """The digest named most often (ties to the larger one, so every peer picks the same); None if none."""
    counts = Counter(d for d in digests if isinstance(d, str))
    return max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0] if counts else None


def expert_version(versions: Mapping[str, VersionRecord], e: int, exclude: str | None = None) -> str | None:
    """The version of expert ``e`` its holders' records (but ``exclude``'s) name most often, counting
    first the holders whose group succeeded: one whose group failed kept values nobody agreed on, and
    a tie between its digest and its group's other holder would otherwise go to the larger digest."""
    named = {p: v.experts[e] for p, v in versions.items() if p != exclude and e in v.experts}
    return majority(d for p, d in named.items() if e not in versions[p].failed) or majority(named.values())


def group_id(members: Iterable[str]) -> str:
    """A short name for a group's exact membership: peers with the same one must agree on its result."""
    return hashlib.sha256("\n".join(sorted(members)).encode()).hexdigest()[:12]


def read_versions(runtime: Runtime, round_no: int) -> dict[str, VersionRecord]:
    """The well-formed version records published for ``round_no``, by peer."""
    raw = runtime.call(runtime.get(version_key(runtime.run_id, round_no)))
    parsed = {p: VersionRecord.from_value(p, v) for p, v in raw.items()}
    return {p: v for p, v in parsed.items() if v is not None}


def adoptable(
    versions: dict[str, VersionRecord], peer_id: str, among: set[str] | None = None
) -> dict[str, VersionRecord]:
    """The records of other peers (of ``among``, if given: the members of the group we missed) that
    carry a shared result ``peer_id`` could adopt."""
    return {p: v for p, v in versions.items() if p != peer_id and v.ok and (among is None or p in among)}


def all_published(results: dict[str, VersionRecord]) -> bool:
    """Whether every member of the group behind the most published shared result has published it
    (each record says how many members its group had; 0, a peer of an earlier version, says nothing)."""
    best = majority(v.shared for v in results.values())
    if best is None:
        return False
    holders = [v for v in results.values() if v.shared == best]
    return len(holders) >= max(v.group for v in holders) > 0


def wait_versions(
    runtime: Runtime,
    round_no: int,
    peers: set[str],
    window: float,
    enough: Callable[[dict[str, VersionRecord]], bool] | None = None,
    after: float = 0.0,
    complete: Callable[[dict[str, VersionRecord]], bool] | None = None,
    hold: Callable[[], float] | None = None,
) -> dict[str, VersionRecord]:
    """Version records of ``round_no``, waiting up to ``window`` seconds for every one of ``peers``.

    Every record read is kept (a member that published early may lapse before a late member
    publishes). With ``enough``, the wait also ends ``after`` seconds after ``enough(records)`` first
    held, and at once when ``complete(records)`` holds: a peer adopting the others' result needs one
    of their digests, and ends its round with them when it has all of theirs. With ``hold``, a peer
    still missing waits past the window until the monotonic time ``hold()`` (groups of clients we reduce
    for end then; their members publish only after them).
    """
    start = time.monotonic()
    since: float | None = None  # when enough() first held
    seen: dict[str, VersionRecord] = {}
    while True:
        seen.update(read_versions(runtime, round_no))
        now = time.monotonic()
        if set(peers) <= set(seen) or (now - start > window and (hold is None or now > hold())):
            return seen
        if enough is not None and enough(seen):
            since = now if since is None else since
            if now - since >= after or (complete is not None and complete(seen)):
                return seen
        time.sleep(0.2)


COPY_WAIT = 7.0  # seconds at least to wait for a reachable peer's copy of an expert only private peers hold


class Refresher:
    """Brings the experts this peer does not train to the agreed version, downloading each once."""

    def __init__(
        self,
        peer_id: str,
        downloader: Downloader,
        stats: SwarmCounters,
        outer: OuterOptimizer | None = None,
        codec: Codec | None = None,
        reachable: bool = True,
    ) -> None:
        """With ``outer`` and ``codec``, experts at a group's anchor are refreshed by its encoded average.
        ``reachable``: others can dial us; a private peer (False) never dials another private one."""
        self.peer_id, self.downloader, self.stats = peer_id, downloader, stats
        self.outer, self.codec, self.reachable = outer, codec, reachable

    def _order(self, holders: list[str], private: set[str]) -> list[str]:
        """``holders`` to ask, in order: those others can dial first; private ones last, and only by a
        reachable peer (a connection they opened to it carries the request), never by a private one."""
        return [h for h in reachable_first(holders, private) if self.reachable or h not in private]

    def _fetch(
        self, model: MoETransformer, e: int, uid: str, sources: list[str], unreachable: set[str], polling: bool = False
    ) -> bool:
        """Download ``uid`` into expert ``e`` from the first of ``sources`` that serves it; whether one did.
        ``polling``: asking reachable peers for a copy they may not have refreshed yet (a refusal is expected)."""
        like = [t.detach() for t in model.expert_tensors(e)]
        for holder in (h for h in sources if h not in unreachable):
            try:
                _, tensors = self.downloader.download(holder, uid, like, attempts=2)
            except TransportError as exc:
                (log.info if polling else log.warning)("could not fetch expert %d from %s: %s", e, holder, exc)
                continue
            except Exception as exc:
                log.warning("could not reach %s for expert %d: %s", holder, e, exc)
                unreachable.add(holder)
                continue
            model.write_expert(e, tensors)
            if self.outer is not None and self.outer.stateful:  # our outer steps on it must match its holders'
                self.outer.fetch_momentum(self.downloader, holder, f"expert:{e}", sum(t.numel() for t in like))
            return True
        return False

    def _by_delta(self, model: MoETransformer, e: int, digest: str, holders: list[str]) -> bool:
        """Bring expert ``e`` to ``digest`` from its group's encoded average; False when that cannot be
        done (no holder serves it, our copy is not its base, or the result does not hash right)."""
        if self.outer is None or self.codec is None:
            return False
        like = model.expert_tensors(e)
        copy = flatten(like)
        base = tensor_digest([copy])
        # its expected size, for the transfer's time limit: a group's parts, or a lone holder's update
        size = max(self.codec.wire_bytes(copy.numel(), len(holders)), self.codec.lone.wire_bytes(copy.numel()))
        for holder in holders[:2]:
            try:
                meta, messages = self.downloader.update(holder, f"expert:{e}", digest, size + 64 * len(holders))
            except Exception as exc:
                log.info("no update of expert %d from %s (%s): downloading it whole", e, holder, exc)
                continue
            if meta.get("base") != base:
                return False  # our copy is not the anchor the group moved from
            try:
                average = self.codec.decode_update(messages, copy.numel())
            except TransportError as exc:
                log.warning("refused the update of expert %d from %s: %s", e, holder, exc)
                continue
            value = self.outer.step_frozen(f"expert:{e}", copy, average)
            if value is None:
                return False
            tensors = split_like(value, like)
            if tensor_digest(tensors) != digest:
                log.warning("expert %d rebuilt from %s's update does not match the agreed digest", e, holder)
                return False
            model.write_expert(e, tensors)
            self.stats.delta_refreshes += 1
            return True
        return False

    def refresh(
        self,
        model: MoETransformer,
        peers: Mapping[str, PeerRecord],
        experts: Iterable[int],
        versions: Mapping[str, VersionRecord] | None = None,
        preferred: Mapping[str, VersionRecord] | None = None,
        any_copy: bool = False,
        own: bool = False,
    ) -> tuple[int, int]:
        """Download each of ``experts`` once from a holder; with ``versions`` only the agreed digest,
        counted among the ``preferred`` versions when any of them has the expert.

        With ``any_copy`` (joining), an expert nobody holds any more is taken from another peer's
        frozen copy, so an expert is not lost while any copy exists. With ``own`` the experts are ones
        we train: our own record counts in choosing the agreed version (we keep ours when it is that one).
        Returns (fetched, missed): missed
        counts experts that have a holder but could not be fetched (an expert with no holder left
        keeps the copy every peer already has).
        """
        fetched = missed = 0
        unreachable: set[str] = set()
        private = private_of(peers)
        later: list[tuple[int, str, list[str]]] = []  # experts whose agreed copy reachable peers may serve soon
        for e in experts:
            holders = [p for p, r in peers.items() if e in r.experts and p != self.peer_id]
            if any_copy:  # holders first, then anyone's frozen copy
                holders += sorted(p for p in peers if p != self.peer_id and p not in holders)
            uid, copies = f"expert:{e}", []
            if versions is not None:
                best = None
                for pool in (preferred or {}, versions):  # holders as the versions name them: the same for everyone
                    best = expert_version(pool, e, None if own else self.peer_id)
                    if best is not None:
                        break
                if best is None:
                    missed += bool(holders)
                    continue
                holders = sorted(p for p, v in versions.items() if p != self.peer_id and v.experts.get(e) == best)
                uid = f"expert:{e}@{best}"
                if tensor_digest(model.expert_tensors(e)) == best:
                    continue  # already the agreed version
                if self._by_delta(model, e, best, self._order(holders, private)):
                    fetched += 1
                    continue
                if not self.reachable or all(h in private for h in holders):
                    # its holders are out of our reach: a reachable peer serves its frozen copy once it has
                    # refreshed it to the agreed digest (it dials them, or they opened a connection to it)
                    copies = sorted(p for p in peers if p != self.peer_id and p not in holders and p not in private)
            if self._fetch(model, e, uid, self._order(holders, private), unreachable):
                fetched += 1
            elif copies:
                later.append((e, uid, copies))
            else:
                missed += bool(holders)
        # a reachable peer serves a copy once it has fetched it from its holder: give it the time of two
        # downloads of them all (it fetches them, then we do), asking again after 1, 2, 4, ... s
        tensors = [t for e, _, _ in later for t in model.expert_tensors(e)]
        budget = max(COPY_WAIT, 2 * self.downloader.deadline(tensors)) if later else 0.0
        waited, wait = 0.0, 1.0
        while later and waited < budget:  # at most log2(budget) + 1 asks
            time.sleep(min(wait, budget - waited))
            waited, wait = waited + min(wait, budget - waited), wait * 2
            left = [
                (e, uid, copies)
                for e, uid, copies in later
                if not self._fetch(model, e, uid, copies, unreachable, True)
            ]
            fetched, later = fetched + len(later) - len(left), left
        for e, uid, _ in later:
            log.warning("no reachable peer served %s in %.0f s: expert %d stays as it was", uid, budget, e)
        missed += len(later)
        self.stats.refresh_missed += missed
        return fetched, missed

    def take_agreed(
        self,
        model: MoETransformer,
        peers: Mapping[str, PeerRecord],
        experts: Iterable[int],
        versions: Mapping[str, VersionRecord],
        agreed: Mapping[str, VersionRecord],
    ) -> list[int]:
        """Bring each of ``experts`` (ones we train) to the version the round agreed on, our own record
        counted; the ones that changed."""
        before = {e: tensor_digest(model.expert_tensors(e)) for e in experts}
        if before:
            self.refresh(model, peers, list(before), versions, agreed, own=True)
        return [e for e, d in before.items() if tensor_digest(model.expert_tensors(e)) != d]

    def agree_on_copies(
        self, model: MoETransformer, orphaned: Iterable[int], versions: Mapping[str, VersionRecord]
    ) -> int:
        """Bring every copy of an expert nobody trains to the copy most peers published, so all agree."""
        fetched = 0
        for e in orphaned:
            best = majority(v.copies.get(e) for v in versions.values())
            if best is None or tensor_digest(model.expert_tensors(e)) == best:
                continue
            sources = sorted(p for p, v in versions.items() if p != self.peer_id and v.copies.get(e) == best)
            like = [t.detach() for t in model.expert_tensors(e)]
            found = self.downloader.first_of(sources, f"expert:{e}@{best}", like)
            if found is None:
                self.stats.refresh_missed += 1
                continue
            model.write_expert(e, found[1][1])
            fetched += 1
        return fetched
