"""Who reduces for a group: its reachable members and how the tensor is split among them, or, when none
can be dialled, a reachable outsider.

Only the members that can be dialled reduce: the tensor is split among them (in proportion to their
declared bandwidths, hivemind's ``load_balance_peers``; else in equal parts: :func:`flat_group`). A
member that cannot be dialled (``reachable=False``, behind a NAT) is a *client*: it sends its encoded
part to every reducer and fetches every averaged part (P parts out, all parts in), reduces and serves
nothing, and nobody ever opens a stream to it. Every reducer's part waits for every member's
contribution, clients' included, so a lost client fails the attempt at its deadline like any member and
the retry forms without it. A group with no reachable member is reduced by a reachable *outsider*: the
first arrival picks one of the peers its ``helpers`` or the clients' arrival records name
(:func:`outsider_candidates`, :func:`named_outsiders`, then :func:`choose_outsider`, by the hash of the
attempt's key: a client whose DHT lost the reachable peers for a while may arrive first) and publishes it
in its decision (``matchmaking.py``); the members send it their parts with the part's description and it
creates the part on demand, adding nothing of its own (``reducer.PartSpec``). An outsider that fails is
avoided by the retry while another is known. In a grid, a row's columns go to its reachable members
only; a group whose reachable members cannot fill every row runs flat (``grid.make_grid``).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Collection, Iterable, Sequence

from p2p_spes.averaging.flat_allreduce import FlatGroup
from p2p_spes.averaging.membership import Joined

MAX_NAMED = 8  # reachable peers a client names in its arrival record, for the first arrival to pick an outsider from

log = logging.getLogger(__name__)


def flat_group(joined: Joined, timeout: float, deadline: float) -> FlatGroup:
    """The flat group ``joined`` decided: its reducers (when not every member) and their bandwidths
    (when any declared one), as every member derives them from the same decision."""
    members, reducers = tuple(joined.members), tuple(joined.reducers)
    bandwidths = tuple(joined.bandwidths.get(p, 0.0) for p in reducers)
    bandwidths = bandwidths if any(bandwidths) else ()
    return FlatGroup(
        members,
        joined.bases,
        timeout,
        deadline,
        reducers=() if reducers == members else reducers,
        bandwidths=bandwidths,
    )


def outsider_candidates(helpers: Callable[[], Iterable[str]] | None, avoid: Collection[str], peer_id: str) -> list[str]:
    """The reachable peers we know (``helpers()``, e.g. from the swarm's membership records) that may
    reduce for a group of clients: not us, nor those in ``avoid`` (that failed this round's earlier
    attempt) unless nobody else is left (a group of clients with no outsider fails for sure)."""
    if helpers is None:
        return []
    try:
        known = list(helpers())
    except Exception as exc:  # a membership read that failed leaves us without outsiders, not the round
        log.warning("could not list reachable peers to reduce for a group of clients: %r", exc)
        return []
    others = [p for p in known if p != peer_id]
    return [p for p in others if p not in avoid] or others


def no_outsider(known: Sequence[str]) -> str:
    """Why a group of clients failed: its decision named no outsider (with the reachable peers we know)."""
    names = ", ".join(known) or "none"
    return f"no member can be dialled and no reachable peer was named to reduce for the group (we know: {names})"


def named_outsiders(records: dict[str, dict]) -> list[str]:
    """The reachable peers the members' arrival records name (``"o"``, written by clients): one member's
    view of the swarm may miss a peer another's has. Malformed entries are left out."""
    named: set[str] = set()
    for value in records.values():
        listed = value.get("o") if isinstance(value, dict) else None
        if isinstance(listed, list):
            named.update(p for p in listed[:MAX_NAMED] if isinstance(p, str) and p)
    return sorted(named)


def choose_outsider(key: str, helpers: Sequence[str], members: Sequence[str]) -> list[str]:
    """The reachable peer that reduces for a group none of whose ``members`` can be dialled: one of
    ``helpers`` (not a member), picked by the hash of the group's key so that members knowing the same
    peers pick the same one, and a retry (another key) most likely another. Empty when there is none."""
    candidates = sorted(set(helpers) - set(members))
    if not candidates:
        return []
    return [candidates[int(hashlib.sha256(key.encode()).hexdigest(), 16) % len(candidates)]]
