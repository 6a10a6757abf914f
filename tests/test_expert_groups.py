"""Who a peer averages each of its experts with, and the records that decides it from (pure: no DHT).

The case that needed it (a 12-minute chaos run, round 27): peer B ended round 26 late, took over
experts 1 and 6 and announced it; peer A, their other holder, had already read the records at its
boundary of round 27. A saw itself as their lone holder and kept its own values; B waited for A, ended
alone and kept its own. Both reported a clean round with different versions of the two experts.
"""

from __future__ import annotations

from dht.records import PeerRecord
from p2p_spes.swarm.membership import holder_groups, with_current_records


def record(peer: str, experts: list[int], step: int = 520) -> PeerRecord:
    return PeerRecord(peer, experts, step, step // 20, "fp", [])


class Membership:
    """``live_peers`` as the DHT answers it now (or a DHT that does not answer)."""

    def __init__(self, current: dict[str, PeerRecord] | None) -> None:
        self.current = current
        self.reads = 0

    def live_peers(self, max_age: float = 0.0) -> dict[str, PeerRecord]:
        self.reads += 1
        if self.current is None:
            raise TimeoutError("the DHT did not answer")
        return dict(self.current)


def test_a_holder_announced_after_our_boundary_joins_the_experts_group():
    at_boundary = {"A": record("A", [0, 1, 3, 6]), "B": record("B", [2, 4, 5, 7]), "C": record("C", [0, 2, 3, 4])}
    now = {**at_boundary, "B": record("B", [1, 2, 4, 5, 6, 7])}  # B took over 1 and 6 after A's read
    present = {"A", "B", "C"}  # the round's shared group
    stale = holder_groups(at_boundary, present, "A", [0, 1, 3, 6])
    assert stale[1] == {"A"} and stale[6] == {"A"}  # what A did: each expert alone, B's copy never met
    membership = Membership(now)
    peers = with_current_records(at_boundary, membership, "A")
    assert membership.reads == 1
    groups = holder_groups(peers, present, "A", [0, 1, 3, 6])
    assert groups == {0: {"A", "C"}, 1: {"A", "B"}, 3: {"A", "C"}, 6: {"A", "B"}}
    # B's own view (it read A's record long before) gives the same groups for the shared experts
    theirs = holder_groups(with_current_records(at_boundary, Membership(now), "B"), present, "B", [1, 2, 4, 5, 6, 7])
    assert theirs[1] == groups[1] and theirs[6] == groups[6]


def test_only_members_present_count_and_our_own_record_stays_ours():
    at_boundary = {"A": record("A", [1]), "B": record("B", [1]), "D": record("D", [1])}
    # the DHT still holds our previous record (without expert 2, which we took since) and a newcomer's
    now = {"A": record("A", [1], step=500), "B": record("B", [1]), "E": record("E", [1, 2])}
    peers = with_current_records(at_boundary, Membership(now), "A")
    assert peers["A"] is at_boundary["A"]
    assert set(peers) == {"A", "B", "D", "E"}  # a peer missing from the DHT now is not dropped here
    assert holder_groups(peers, {"A", "B"}, "A", [1, 2]) == {1: {"A", "B"}, 2: {"A"}}  # D and E: not in the group


def test_a_dht_that_does_not_answer_leaves_the_boundarys_view():
    at_boundary = {"A": record("A", [1]), "B": record("B", [2])}
    membership = Membership(None)
    assert with_current_records(at_boundary, membership, "A") is at_boundary
    assert membership.reads == 1
