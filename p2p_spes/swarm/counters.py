"""What a peer's swarm did over its run: one typed counter per event, counted where it happens, published
in the peer's DHT record (the inspector and dashboard read it) and written whole into ``summary.json``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from p2p_spes.averaging.wire_meter import WireMeter


@dataclass
class SwarmCounters:
    # rounds this peer ran, one outcome each (see ``RoundReport.outcome``)
    rounds_joined: int = 0  # averaged: applied its shared group's average (the group had other members)
    rounds_adopted: int = 0  # missed the shared group and took the result its members agreed on (own progress replaced)
    rounds_alone: int = 0  # nobody else came: nothing was averaged
    rounds_failed: int = 0  # neither averaged nor adopted: kept its own values
    # rounds and steps it never ran
    rounds_skipped: int = 0  # rounds the swarm finished while this peer was behind; it took their state instead
    catch_up_skipped: int = 0  # times it took the swarm's state instead of running a round it was behind for
    steps_skipped: int = 0  # training steps never computed: replaced by a later state taken from the swarm
    schedule_steps_advanced: int = 0  # steps jumped: the schedule moved on to the swarm's round (slower peers)
    # refreshes, repairs and refusals
    refresh_missed: int = 0  # frozen experts that could not be brought to the agreed version in a round
    delta_refreshes: int = 0  # frozen experts refreshed from their group's encoded update (not downloaded whole)
    anchors_rebased: int = 0  # times it took a group's agreed anchor from a member
    updates_refused: int = 0  # group results the update guard refused (not finite, implausibly large)
    experts_taken_over: int = 0  # under-covered experts it took on
    experts_reinitialised: int = 0  # experts nobody could serve, started afresh
    dht_redials: int = 0  # its DHT had lost every neighbour and dialled the bootstrap again
    reconnects: int = 0  # it read nobody at a boundary, then found the run again

    wire: WireMeter = field(default_factory=WireMeter, repr=False)  # every byte on our streams, by purpose

    def as_dict(self) -> dict[str, int]:
        """The counters, with the wire's totals: ``bytes_sent`` and ``bytes_received`` are every byte our
        streams carried (as a member, as a reducer, serving and downloading), ``bytes_served`` what
        others downloaded from us (state and the run's data files)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "wire"}
        out["bytes_sent"], out["bytes_received"] = self.wire.sent, self.wire.received
        out["bytes_served"] = self.wire.by_purpose["serving"].sent + self.wire.by_purpose["data_served"].sent
        return out

    def rounds(self) -> dict[str, int]:
        """This peer's rounds by outcome, and those it never ran (the swarm finished them while it was behind)."""
        return {
            "averaged": self.rounds_joined,
            "adopted": self.rounds_adopted,
            "alone": self.rounds_alone,
            "failed": self.rounds_failed,
            "skipped": self.rounds_skipped,
        }

    def traffic(self) -> dict[str, dict[str, int]]:
        """Bytes sent and received by purpose (``averaging/wire_meter.py``), for ``summary.json``."""
        return {p: {"sent": t.sent, "received": t.received} for p, t in self.wire.by_purpose.items()}

    def count_round(self, outcome: str) -> None:
        """Count a round by its outcome: ``averaged``, ``adopted``, ``alone`` or ``failed``."""
        field_name = {
            "averaged": "rounds_joined",
            "adopted": "rounds_adopted",
            "alone": "rounds_alone",
            "failed": "rounds_failed",
        }[outcome]
        setattr(self, field_name, getattr(self, field_name) + 1)
