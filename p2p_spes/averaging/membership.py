"""What a group's records decide: its members, join window, transfer deadline, agreed base and reducers.

Pure functions of the arrival records ``matchmaking.py`` writes and reads under a group's DHT key, so that
every member reading the same records computes the same group (and ``benchmarks/lab/simulation.py`` forms
groups as peers do): everyone who arrived before the group closed (:func:`closing_time`: the first
arrival's window, held open for its quorum), the base they agree on (:func:`agreed_base`), and who can
be dialled and with what bandwidth (:class:`Joined`). The first arrival publishes what it computed as a
*decision* record (:func:`decision`) that every member adopts (:func:`adopted`).

The transfer deadline is the longest any member proposed: each member measures its own from the
rates it saw, and a member that gives up at its own short deadline while another still sends within
its longer one would fail an attempt the slower one could finish, then retry it while that one is still
inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STRETCH = 3.0  # a group short of its quorum stays open up to this many matchmaking_time after its first arrival
# seconds a group held open for its quorum stays open after the arrival that makes it: the peers that come
# right behind it were finishing the same work (the adopters of the last round end within a moment of
# each other), and a group closed on the first of them leaves the rest to adopt its result again
QUORUM_GRACE = 1.0


@dataclass(frozen=True)
class Base:
    """What a member's tensor is relative to: the digest of its anchor and the round that set it."""

    digest: str
    round: int


def agreed_base(bases: dict[str, Base]) -> Base | None:
    """The base a group uses, the same for every member (all read the same records): by digest, the
    newest round that names it, then the most members naming it, then the larger digest."""
    if not bases:
        return None
    rounds: dict[str, int] = {}
    counts: dict[str, int] = {}
    for b in bases.values():
        rounds[b.digest] = max(rounds.get(b.digest, b.round), b.round)
        counts[b.digest] = counts.get(b.digest, 0) + 1
    digest = max(counts, key=lambda d: (rounds[d], counts[d], d))
    return Base(digest, rounds[digest])


def first_arrival(records: dict[str, dict]) -> str:
    """The member whose record says it arrived first (ties by peer id): it decides the membership."""
    return min(records, key=lambda p: (records[p]["t"], p))


def proposed(value: object) -> float | None:
    """A positive number from a record (window or deadline), or None: a bool or anything else is refused."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def arrival_delays(records: dict[str, dict]) -> dict[str, float]:
    """Every arrival's delay after the first, from a group key's records (malformed ones and ``done``
    records left out): what the next join window is fitted to (``pacing.Deadlines``)."""
    times = {p: v["t"] for p, v in records.items() if isinstance(v, dict) and isinstance(v.get("t"), float)}
    if not times:
        return {}
    first = min(times.values())
    return {p: t - first for p, t in times.items()}


def quorum_of(records: dict[str, dict]) -> int:
    """The arrivals the first arrival's record asks the group to wait for (0: none, also when malformed)."""
    q = records[first_arrival(records)].get("q")
    return q if type(q) is int and q > 0 else 0


def longest_wait(matchmaking_time: float) -> float:
    """The longest a group stays open after its first arrival (its quorum missing)."""
    return STRETCH * matchmaking_time


def closing_time(records: dict[str, dict], matchmaking_time: float) -> float:
    """When the group closes (DHT clock), the same for every member reading the same records: its agreed
    window after the first arrival when its quorum has arrived by then, else :data:`QUORUM_GRACE` after the
    arrival that makes the quorum, at most :func:`longest_wait` after the first (that, while the arrival
    has not come)."""
    times = sorted(v["t"] for v in records.values())
    first, need = times[0], quorum_of(records)
    end = first + agreed_window(records, matchmaking_time)
    if need <= 1 or sum(t <= end for t in times) >= need:
        return end
    cap = first + longest_wait(matchmaking_time)
    return min(times[need - 1] + QUORUM_GRACE, cap) if len(times) >= need else cap


def agreed_timeout(records: dict[str, dict], members: list[str]) -> float:
    """The transfer deadline of a group: the longest the members proposed (0.0 when none did, as peers
    of an earlier version do not; each then keeps its own)."""
    return max((d for p in members if (d := proposed(records.get(p, {}).get("d"))) is not None), default=0.0)


def agreed_window(records: dict[str, dict], matchmaking_time: float) -> float:
    """The join window the first arrival proposed (ties by peer id), at most ``matchmaking_time``."""
    window = proposed(records[first_arrival(records)].get("m"))
    return matchmaking_time if window is None else min(window, matchmaking_time)


@dataclass
class Joined:
    """A decided membership: sorted members, every arrival's delay after the first, the window used, the
    bases the members named and the transfer deadline they agreed on (0.0: none proposed)."""

    members: list[str]
    lateness: dict[str, float] = field(default_factory=dict)
    window: float = 0.0
    bases: dict[str, Base] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)  # peers that said they applied an earlier attempt (a retry's key)
    timeout: float = 0.0
    first: float = 0.0  # the first arrival's time (DHT clock): the group's transfers end by first + window + deadline
    clients: set[str] = field(default_factory=set)  # members nobody can dial: they reduce nothing
    bandwidths: dict[str, float] = field(default_factory=dict)  # what members declared (any unit, all the same)
    outsiders: list[str] = field(default_factory=list)  # reachable non-members that reduce for an all-client group

    @property
    def reducers(self) -> list[str]:
        """Who reduces the group's parts, in order: its reachable members, else the outsiders picked."""
        return [p for p in self.members if p not in self.clients] or list(self.outsiders)

    def deadline(self, configured: float) -> float:
        """The transfer deadline the group runs with: the agreed one, at most the cap; the configured one
        when no member proposed any. The cap is ``configured`` scaled by members / reducers: few reducers
        carry every client's contribution and result, where ``configured`` is for every member reducing."""
        cap = configured * len(self.members) / max(len(self.reducers), 1) if self.clients else configured
        return min(self.timeout, cap) if self.timeout > 0 else configured


def decide(records: dict[str, dict], matchmaking_time: float) -> Joined:
    """The membership every member computes from the same arrival records (``{peer: {"t": arrival,
    "m": proposed window, "q": quorum, "d": proposed deadline, "b"/"br": base, "c": not reachable,
    "bw": bandwidth}}``): everyone who arrived
    before the group closed (:func:`closing_time`; with its quorum still missing, everyone who came up to
    now), with the longest deadline they proposed.
    Also what ``benchmarks/lab/simulation.py`` runs, so the model forms groups as peers do."""
    times = {p: v["t"] for p, v in records.items()}
    first = min(times.values())
    closes = closing_time(records, matchmaking_time)
    agreed = closes - first
    members = sorted(p for p, t in times.items() if t <= closes)
    bases = {
        p: Base(records[p]["b"], records[p]["br"])
        for p in members
        if isinstance(records[p].get("b"), str) and type(records[p].get("br")) is int
    }
    return Joined(
        members,
        arrival_delays(records),
        agreed,
        bases,
        timeout=agreed_timeout(records, members),
        first=first,
        clients={p for p in members if records[p].get("c") is True},
        bandwidths={p: b for p in members if (b := proposed(records[p].get("bw"))) is not None},
    )


def decision(joined: Joined, peer_id: str, arrival: float) -> dict:
    """The record the first arrival publishes: the members, the window and the agreed base with the
    indices of the members that hold it (what a member needs to rebase)."""
    value = {"peer_id": peer_id, "t": arrival, "members": list(joined.members), "w": joined.window}
    if joined.timeout > 0:
        value["d"] = joined.timeout
    if joined.clients:
        value["c"] = [i for i, p in enumerate(joined.members) if p in joined.clients]
    if joined.bandwidths:
        value["bw"] = [joined.bandwidths.get(p, 0.0) for p in joined.members]
    if joined.outsiders:
        value["r"] = list(joined.outsiders)
    base = agreed_base(joined.bases)
    if base is not None:
        value.update(
            b=base.digest,
            br=base.round,
            h=[i for i, p in enumerate(joined.members) if p in joined.bases and joined.bases[p].digest == base.digest],
        )
    return value


def adopted(value: dict, own: Joined) -> Joined | None:
    """The membership a decision record holds, with our own arrivals' lateness; None if malformed."""
    members, window, holders = value.get("members"), proposed(value.get("w")), value.get("h", [])
    timeout = proposed(value["d"]) if "d" in value else 0.0
    clients, bandwidths, outsiders = value.get("c", []), value.get("bw", []), value.get("r", [])
    if (
        not isinstance(members, list)
        or not members
        or not all(isinstance(p, str) for p in members)
        or members != sorted(set(members))
        or window is None
        or timeout is None
        or not isinstance(holders, list)
        or not all(type(i) is int and 0 <= i < len(members) for i in holders)
        or not isinstance(clients, list)
        or not all(type(i) is int and 0 <= i < len(members) for i in clients)
        or not isinstance(bandwidths, list)
        or len(bandwidths) not in (0, len(members))
        or not all(isinstance(b, float) and b >= 0 for b in bandwidths)
        or not isinstance(outsiders, list)
        or not all(isinstance(p, str) and p not in members for p in outsiders)
    ):
        return None
    bases = {}
    if isinstance(value.get("b"), str) and type(value.get("br")) is int:
        bases = {members[i]: Base(value["b"], value["br"]) for i in holders}
    return Joined(
        list(members),
        dict(own.lateness),
        window,
        bases,
        timeout=timeout,
        first=own.first,
        clients={members[i] for i in clients},
        bandwidths={p: b for p, b in zip(members, bandwidths) if b > 0},
        outsiders=list(outsiders),
    )
