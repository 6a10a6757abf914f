"""The live progress view: what it reads from metrics.jsonl, the events it prints, and the swarm's watch loop."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
import time

from rich.console import Console

from p2p_spes.local_swarm import LocalSwarm
from p2p_spes.metrics_log import MetricsTail
from p2p_spes.progress import PeerProgress, ProgressView


def plain_view(names, max_steps=100, plain_every=0.0):
    out = io.StringIO()
    view = ProgressView(names, max_steps, console=Console(file=out, width=200), live=False, plain_every=plain_every)
    return view, out


def round_record(n, step, outcome="averaged", members=2, **extra):
    return {
        "sync_round": n,
        "step": step,
        "sync_seconds": 1.5,
        "outcome": outcome,
        "shared_members": members,
        "bytes_sent": 2_000_000,
        "bytes_received": 4_000_000,  # every byte, downloads included
        "traffic": {"averaging": [2_000_000, 3_000_000], "downloading": [0, 1_000_000]},
        "groups_failed": [],
        **extra,
    }


def test_tail_returns_whole_lines_once_and_waits_for_a_line_being_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.read() == []  # no file yet
    path.write_text('{"step": 1}\n{"step": 2')
    assert tail.read() == [{"step": 1}]
    with open(path, "a") as f:
        f.write('}\nnot json, cut by a kill\n{"step": 3}\n')
    assert tail.read() == [{"step": 2}, {"step": 3}]
    assert tail.read() == []
    path.write_text('{"step": 9}\n')  # replaced by a fresh start: read from the top
    assert tail.read() == [{"step": 9}]


def test_events_name_what_happened_and_each_is_printed_once():
    view, out = plain_view(["peer0", "peer1"])
    view.update("peer0", {"step": 5, "loss": 7.5, "tokens_per_s": 1000.0, "time": 10.0})
    view.update("peer0", round_record(1, 10, members=1, outcome="alone"))
    view.update("peer0", round_record(2, 20))
    view.update("peer0", round_record(3, 30))  # joined already: no second event
    view.update("peer1", round_record(3, 30, members=3))
    view.update("peer1", round_record(4, 40, outcome="failed", groups_failed=["shared", "expert2"]))
    view.update("peer1", round_record(5, 50, outcome="adopted"))
    view.update("peer1", {"step": 50, "took_over": [4], "local_experts": [1, 4]})
    view.update("peer0", {"step": 70, "rounds_skipped": [4, 5, 6, 7], "caught_up_round": 7, "shared_digest": "ab"})
    view.set_state("peer1", "died", "killed by SIGKILL")
    view.set_state("peer1", "died", "killed by SIGKILL")
    assert view.events == [
        "peer0 joined the run: averaged round 2 with 2 peer(s)",
        "peer1 joined the run: averaged round 3 with 3 peer(s)",
        "round 3: 3 peers averaged the shared weights (before: 2)",
        "round 4 failed on peer1 (groups: shared, expert2); it keeps its own weights and tries again next round",
        "peer1 missed round 5 and took the result the others agreed on",
        "peer1 took over expert(s) [4] (now trains [1, 4])",
        "peer0 fell behind the swarm: took its state of round 7 (skipped 4 round(s)) and goes on from step 70",
        "peer1 died: killed by SIGKILL",
    ]
    text = out.getvalue()
    assert text.count("peer1 died") == 1 and "\x1b[" not in text  # plain lines, no redraw codes
    p0 = view.peers["peer0"]
    assert (p0.round, p0.round_outcome, p0.step) == (3, "averaged", 70)
    assert p0.sent_mb == 6.0 and p0.received_mb == 12.0  # three rounds of 2 MB out, 4 MB in


def test_plain_output_prints_every_peer_status_line_and_eta_follows_the_pace():
    view, out = plain_view(["peer0"], max_steps=100)
    for step in (10, 20, 30):
        view.update("peer0", {"step": step, "loss": 6.0, "time": 100.0 + step})  # one step per second
    assert view.peers["peer0"].eta_seconds() == 70.0
    view.refresh()
    assert "peer0: training, step 30/100, loss 6.000" in out.getvalue() and "ETA 1m10s" in out.getvalue()
    done = PeerProgress("x", 10, step=10)
    assert done.eta_seconds() == 0.0
    assert PeerProgress("y", 10, step=3).eta_seconds() is None  # no pace yet


def test_a_terminal_gets_a_redrawn_table():
    out = io.StringIO()
    console = Console(file=out, width=160, force_terminal=True)
    with ProgressView(["peer0"], 50, console=console) as view:
        assert view.live
        view.update("peer0", {"step": 7, "loss": 5.25, "time": 1.0})
        view.refresh(force=True)
    text = out.getvalue()
    assert "7/50" in text and "5.250" in text and "\x1b[" in text


def test_swarm_watch_reports_what_each_peer_wrote_and_how_it_ended(tmp_path):
    # two stand-in peers (no network): one writes its records and finishes, one is killed
    swarm = LocalSwarm(None, [], 2, tmp_path)
    script = textwrap.dedent("""
        import json, sys, time, pathlib
        d = pathlib.Path(sys.argv[1]); d.mkdir(parents=True, exist_ok=True)
        with open(d / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": 10, "loss": 6.5, "time": time.time()}) + "\\n")
            f.write(json.dumps({"sync_round": 1, "step": 10, "sync_seconds": 2.0, "outcome": "averaged",
                                "shared_members": 2, "bytes_sent": 1000000, "bytes_received": 1000000}) + "\\n")
        time.sleep(float(sys.argv[2]))
    """)
    for i, linger in enumerate((0.5, 60)):
        swarm.procs.append(
            subprocess.Popen(
                [sys.executable, "-c", script, str(tmp_path / f"peer{i}"), str(linger)], start_new_session=True
            )
        )
    view, _ = plain_view([], max_steps=20, plain_every=60)
    try:
        swarm.procs[0].wait(30)
        records = tmp_path / "peer1" / "metrics.jsonl"
        for _ in range(300):  # peer1 has written its records
            if records.exists() and records.read_text().count("\n") == 2:
                break
            time.sleep(0.1)
        swarm.procs[1].kill()
        codes = swarm.watch(view, timeout=30, interval=0.2)
    finally:
        swarm.stop(grace=1)
    assert codes[0] == 0 and codes[1] < 0
    assert view.peers["peer0"].state == "finished" and view.peers["peer1"].state == "died"
    assert view.peers["peer1"].step == 10 and view.peers["peer1"].loss == 6.5
    assert any(e.startswith("peer1 died: killed by SIGKILL") for e in view.events)
    assert "peer0 joined the run: averaged round 1 with 2 peer(s)" in view.events
    assert json.loads((tmp_path / "peer0" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 10
