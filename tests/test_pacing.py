"""Rounds paced by the swarm and deadlines from measurements, without a network (swarm/pacing.py, peer.py)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
from helpers import SMALL

from benchmarks.convergence import lockstep_place  # holds peers at each boundary until all reach it)
from p2p_spes.averaging.membership import agreed_window
from p2p_spes.config import load_config
from p2p_spes.local_swarm import LocalSwarm
from p2p_spes.peer import SwarmSync
from p2p_spes.swarm import GroupReport, RoundReport
from p2p_spes.swarm.counters import SwarmCounters
from p2p_spes.swarm.pacing import Deadlines, RoundWatch, median_and_mad


def test_join_window_follows_the_last_arrivals_within_the_configured_bound():
    sw = load_config(None, ["swarm.matchmaking_time=10", "swarm.averaging_timeout=60"]).swarm
    d = Deadlines(sw)
    assert d.join_window() == 10.0, "no history yet: the configured window"
    for late in (0.8, 1.1, 0.9, 1.0):
        d.observe_arrivals({"a": 0.0, "b": late})
    mid, mad = median_and_mad([0.8, 1.1, 0.9, 1.0])
    assert d.join_window() == pytest.approx(mid + 4 * mad + 1.0)
    assert d.join_window() < 3.0, "peers that arrive within a second do not wait 10 s for a dead one"
    for _ in range(8):
        d.observe_arrivals({"a": 0.0, "b": 30.0})  # someone is very late: capped at the configured window
    assert d.join_window() == 10.0
    d.observe_arrivals({"a": 0.0})  # a group of one says nothing about lateness
    assert len(d._lateness) == 8


def test_the_join_window_counts_the_peers_that_came_after_the_group_closed():
    """Members fitting the window to their own spread (0.2 s) shut out a peer 4 s behind them round
    after round; read after the round, the group key holds its arrival too, and the window opens to it."""
    sw = load_config(None, ["swarm.matchmaking_time=10"]).swarm
    members_only, with_late = Deadlines(sw), Deadlines(sw)
    for _ in range(4):
        members_only.observe_round({"a": 0.0, "b": 0.2}, {})  # the read after the round failed: what we had
        with_late.observe_round({"a": 0.0, "b": 0.2}, {"a": 0.0, "b": 0.2, "late": 4.0})
    assert members_only.join_window() < 2.0
    assert 4.0 < with_late.join_window() <= 10.0
    shrunk = Deadlines(sw)
    for _ in range(4):  # a read that finds fewer arrivals than the group had (a lapsed record) is not used
        shrunk.observe_round({"a": 0.0, "b": 0.2, "c": 3.0}, {"a": 0.0, "b": 0.2})
    assert shrunk.join_window() > 3.0


def test_transfer_deadline_scales_with_the_payload_and_the_observed_rate():
    sw = load_config(None, ["swarm.averaging_timeout=600"]).swarm
    d = Deadlines(sw)
    assert d.transfer_timeout(10**9) == 600.0, "no measurement yet: the configured timeout"
    assert d.proposed_timeout(10**9) is None, "nor anything to propose to a group (it keeps the others')"
    for _ in range(3):
        d.observe_transfer(2_500_000, 1.0)  # 20 Mbit/s
    assert d.transfer_timeout(25_000_000) == pytest.approx(3 * 10 + 2)  # a 25 MB payload takes ~10 s
    assert d.proposed_timeout(25_000_000) == pytest.approx(32.0)
    assert d.transfer_timeout(1000) == d.floor, "never shorter than the floor"
    assert d.transfer_timeout(10**10) == 600.0, "never longer than the configured timeout"
    d.observe_transfer(100, 10.0)  # tiny transfers measure latency, not bandwidth: ignored
    assert d.transfer_timeout(25_000_000) == pytest.approx(32.0)


def test_a_group_with_clients_gets_a_longer_deadline_even_before_any_measurement():
    """Three members and one reducer: its link carries two contributions in and two results out, where
    every member reducing would carry two thirds of one each way; the cap scales by members / reducers."""
    sw = load_config(None, ["swarm.averaging_timeout=30"]).swarm
    d = Deadlines(sw)
    assert d.proposed_timeout(10**9, scale=3.0) == 90.0, "unmeasured: the scaled configured timeout"
    for _ in range(3):
        d.observe_transfer(2_500_000, 1.0)  # 20 Mbit/s
    assert d.proposed_timeout(100_000_000, scale=3.0) == pytest.approx(90.0)  # 122 s wanted: the scaled cap
    assert d.proposed_timeout(50_000_000, scale=3.0) == pytest.approx(3 * 20 + 2)
    assert d.proposed_timeout(50_000_000) == 30.0, "all reducing: the configured cap"


def test_the_first_arrivals_window_is_the_groups():
    records = {"b": {"t": 5.0, "m": 2.0}, "a": {"t": 5.0, "m": 3.0}, "c": {"t": 4.0, "m": 20.0}}
    assert agreed_window(records, 8.0) == 8.0, "the earliest proposes; capped at matchmaking_time"
    records["c"]["m"] = 1.5
    assert agreed_window(records, 8.0) == 1.5
    del records["c"]
    assert agreed_window(records, 8.0) == 3.0, "a tie on time goes to the smaller peer id"
    assert agreed_window({"x": {"t": 1.0}}, 8.0) == 8.0, "a record without a proposal: the configured window"


class _Loop:
    """An event loop on a thread, as the swarm's runtime has."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_round_watch_sees_another_peer_open_the_round():
    arrivals: dict[str, dict] = {}
    runner = _Loop()

    async def get(key):
        return dict(arrivals.get(key, {}))

    runtime = SimpleNamespace(run_id="run", peer_id="me", get=get, submit=runner.submit)
    watch = RoundWatch(runtime, poll=0.05)
    watch.start()
    try:
        watch.expect(3)
        arrivals["run.round3.shared"] = {"me": {}}  # only our own arrival: not opened by anyone else
        threading.Event().wait(0.3)
        assert not watch.opened(3)
        arrivals["run.round4.shared"] = {"other": {}}  # the round after ours opened: ours was missed
        for _ in range(100):
            if watch.opened(3):
                break
            threading.Event().wait(0.05)
        assert watch.opened(3) and watch.opened(4)
    finally:
        watch.stop()
        threading.Event().wait(0.1)  # let the cancellation reach the task before the loop stops
        runner.close()


class _Swarm:
    """A stand-in whose rounds are instant: it records what each peer contributes."""

    def __init__(self) -> None:
        self.opened: set[int] = set()
        self.calls: list[tuple[int, int, float]] = []
        self.last_flags: list[bool] = []  # whether each round was told it is the run's last
        self.stats = SwarmCounters()
        self.members = 2
        self.others_round: int | None = None  # the newest round another live peer finished
        self.others_after_sync: int | None = None  # ... once our round is over (we were frozen inside it)
        self.caught_up: list[int | None] = []
        self.reached = 0

    def update_status(self, **fields) -> None:
        pass

    def expect_round(self, round_no: int) -> None:
        pass

    def round_opened(self, round_no: int) -> bool:
        return round_no in self.opened

    def experts_to_take(self) -> list[int]:
        return []

    def swarm_round(self) -> int | None:
        return self.others_round

    def reach_others(self) -> bool:
        self.reached += 1  # called at every due boundary, before the round
        return True

    def sole_experts(self) -> list[int]:
        return []

    def catch_up(self, keep=()) -> dict:
        self.caught_up = [*self.caught_up, self.others_round]
        return {"round": self.others_round, "step": self.others_round * 10}

    def sync(self, round_no, step, weight, last=False) -> RoundReport:
        self.calls.append((round_no, step, weight))
        self.last_flags.append(last)
        if self.others_after_sync is not None:
            self.others_round = self.others_after_sync
        return RoundReport(
            round=round_no,
            step=step,
            tokens=int(weight),
            groups={"shared": GroupReport(ok=True, members=self.members, group_id="g")},
        )


def _trainer(max_steps: int = 40):
    return SimpleNamespace(
        step=0,
        tokens=0,
        last_metrics={"loss": 1.0},
        log_record=lambda r: None,
        cfg=SimpleNamespace(train=SimpleNamespace(max_steps=max_steps)),
    )


def test_a_slow_peer_joins_the_round_another_peer_opened_and_keeps_its_tokens():
    swarm, trainer = _Swarm(), _trainer()
    hook = SwarmSync(swarm, sync_steps=10)
    for _ in range(4):  # a peer 3x slower: 4 steps done when the others finish 10 and open round 1
        trainer.step += 1
        trainer.tokens += 100
        hook.post_step(trainer)
    assert swarm.calls == []
    swarm.opened.add(1)
    trainer.step += 1
    trainer.tokens += 100
    hook.post_step(trainer)
    assert swarm.calls == [(1, 10, 500)], (
        "it joins at the end of the step in progress, with all its tokens, "
        "and runs the round at the round's agreed step (merges happen at the same round for everyone)"
    )
    assert trainer.step == 10, "and takes the round's place in the schedule"
    assert hook.next_round == 2 and hook.tokens_averaged == 500
    assert swarm.stats.schedule_steps_advanced == 5 and swarm.stats.steps_skipped == 0


def test_a_peer_runs_its_own_boundary_and_no_round_past_the_end():
    swarm, trainer = _Swarm(), _trainer(max_steps=25)
    hook = SwarmSync(swarm, sync_steps=10)
    for _ in range(25):
        trainer.step += 1
        trainer.tokens += 10
        hook.post_step(trainer)
    assert [c[:2] for c in swarm.calls] == [(1, 10), (2, 20)], "no round 3: it would end past max_steps"
    assert swarm.last_flags == [False, True], "round 2 is the run's last (swarm.expert_sync_rounds averages it)"
    assert swarm.reached == 2, "a peer makes sure it reaches the others before each round it runs"
    swarm.members = 1
    trainer2, hook2 = _trainer(), SwarmSync(swarm, sync_steps=10)
    for _ in range(10):
        trainer2.step += 1
        trainer2.tokens += 10
        hook2.post_step(trainer2)
    assert hook2.tokens_averaged == 0, "a round alone averages nothing"


@pytest.mark.parametrize("others_round", [None, 1, 5])
def test_a_peer_alone_in_a_round_the_others_have_moved_past_rejoins_them(others_round):
    """A peer frozen inside its round, past the others' round records, finds nobody and averages alone;
    when the others' records say they are rounds ahead it takes their state like a joiner instead of
    spending one lone round after another catching up. Alone in the swarm (or alone with the others
    not past it) it goes on."""
    swarm, trainer = _Swarm(), _trainer(max_steps=100)
    swarm.members, swarm.others_round, swarm.others_after_sync = 1, min(others_round or 0, 1) or None, others_round
    hook = SwarmSync(swarm, sync_steps=10)
    for _ in range(10):
        trainer.step += 1
        hook.post_step(trainer)
    assert [c[0] for c in swarm.calls] == [1]
    if others_round == 5:
        assert swarm.caught_up == [5] and hook.next_round == 6 and trainer.step == 50
        assert swarm.stats.steps_skipped == 40
    else:
        assert swarm.caught_up == [] and hook.next_round == 2 and trainer.step == 10


@pytest.mark.parametrize("others_round", [1, 2, 5])
def test_a_peer_whose_round_the_swarm_finished_long_ago_takes_its_state_instead(others_round):
    """Back from a freeze, the others' records say they finished our due round and the next: the round
    would find nobody, so the peer takes their state at once (its tokens since its last round are
    replaced) and logs the rounds it skipped. One round behind it runs the round (its late member
    adopts the agreed result there)."""
    records = []
    swarm, trainer = _Swarm(), _trainer(max_steps=100)
    trainer.log_record = records.append
    swarm.others_round = others_round
    hook = SwarmSync(swarm, sync_steps=10)
    for _ in range(10):
        trainer.step += 1
        trainer.tokens += 100
        hook.post_step(trainer)
    if others_round == 1:
        assert [c[0] for c in swarm.calls] == [1] and swarm.caught_up == []
        return
    assert swarm.calls == [] and swarm.caught_up == [others_round]
    assert hook.next_round == others_round + 1 and trainer.step == 10 * others_round
    assert swarm.stats.rounds_skipped == others_round
    assert records[-1]["rounds_skipped"] == list(range(1, others_round + 1))
    assert records[-1]["caught_up_round"] == others_round
    trainer.step += 10
    trainer.tokens += 1000
    hook.post_step(trainer)  # the next round weighs only what was trained since the state was taken
    assert swarm.calls == [(others_round + 1, 10 * (others_round + 1), 1000)]


def test_round_outcomes_are_reported_honestly():
    def report(ok, members, adopted=None):
        return RoundReport(
            round=1,
            step=10,
            adopted_shared_from=adopted,
            groups={"shared": GroupReport(ok=ok, members=members, group_id="g")},
        )

    assert report(True, 3).outcome == "averaged"
    alone = report(True, 1)
    assert alone.outcome == "alone" and alone.summary()["ok"] is False, "a group of one is not an ok round"
    assert report(False, 2, adopted="peer").outcome == "adopted"
    assert report(False, 0).outcome == "failed"
    assert alone.metrics(10)["outcome"] == "alone"


@pytest.mark.slow
def test_a_peer_joining_before_the_first_round_downloads_nothing(tmp_path):
    """Before any round the run serves the seeded weights every peer starts from: checked by digest, not
    downloaded (at 20 Mbit/s a tiny-config download alone cost a joiner 30 s and its first rounds)."""
    # held at each boundary until both peers reach it: on a loaded machine (CI) the first peer otherwise
    # reached the first round (at step 10, and once even at step 50) and averaged alone before the
    # joiner's DHT was up, and the joiner then caught up from round 1
    gate = tmp_path / "gate"
    gate.mkdir()
    swarm = LocalSwarm(
        None,
        SMALL + ["train.max_steps=100", "swarm.sync_steps=50"],
        peers=2,
        run_dir=tmp_path,
        place=lockstep_place(gate, 2),
    )
    swarm.run(timeout=200, stagger=1.0)
    joiner = (tmp_path / "peer1.log").read_text()
    assert "serves our own initial weights: nothing to download" in joiner, joiner[-2000:]
    assert "caught up from" not in joiner
    final = {s["final_val_loss"] for s in swarm.summaries()}
    assert len(final) == 1, "both still end with the same model"
