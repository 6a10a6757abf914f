"""The scale benchmark's bookkeeping: which peer-rounds count against the swarm, and the sets of weights
at the end (``benchmarks/scale.py summarize``), on metrics lines written here."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import scale
from benchmarks.lab.chaos import Fault


def round_line(n: int, outcome: str, start: float, seconds: float, digest: str) -> dict:
    return {
        "sync_round": n,
        "step": 10 * n,
        "outcome": outcome,
        "sync_seconds": seconds,
        "time": start + seconds,
        "shared_digest": digest,
        "bytes_sent": 1_000_000,
        "bytes_received": 1_000_000,
        "traffic": {"downloading": [0, 0]},
        "groups": {"shared": {"attempts": 1, "lost": []}},
    }


def write(run_dir: Path, peer: int, lines: list[dict]) -> None:
    (run_dir / f"peer{peer}").mkdir(parents=True)
    (run_dir / f"peer{peer}" / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_rounds_of_a_stopped_peer_and_of_one_left_alone_are_counted_apart(tmp_path):
    """Peers 0 and 1 average rounds 1-3 and end at t = 130. Peer 2 averages round 1, is stopped from 40
    to 200 (its round 2 fails meanwhile), and runs round 3 at 210 alone: the others have ended."""
    write(tmp_path, 0, [round_line(n, "averaged", 10 + 50 * (n - 1), 20, f"d{n}") for n in (1, 2, 3)])
    write(tmp_path, 1, [round_line(n, "averaged", 10 + 50 * (n - 1), 20, f"d{n}") for n in (1, 2, 3)])
    write(
        tmp_path,
        2,
        [
            round_line(1, "averaged", 10, 20, "d1"),
            round_line(2, "failed", 60, 150, "x2"),
            round_line(3, "alone", 210, 1, "x3"),
        ],
    )
    freeze = Fault("freeze", 2, 40.0, 200.0)
    row = scale.summarize(tmp_path, 3, survivors=[0, 1, 2], faults=[freeze])
    assert row["peer_rounds"] == 9 and row["peer_rounds_applied"] == 7
    assert row["rounds_everyone_applied"] == 1  # rounds 2 and 3 had a peer that did not apply them
    assert row["peer_rounds_frozen"] == 1 and row["peer_rounds_after_others"] == 1
    assert row["rounds_everyone_running_applied"] == 3
    # peer 2's weights are its own after a round alone: left out of the sets, and said so
    assert row["ended_after_others"] == 1 and row["final_weights"] == 1


def test_a_round_alone_while_others_still_run_counts_against_the_swarm(tmp_path):
    """The same, but peer 1 runs on to t = 300: peer 2's lone round 3 is a round the swarm lost for it."""
    write(tmp_path, 0, [round_line(n, "averaged", 10 + 50 * (n - 1), 20, f"d{n}") for n in (1, 2, 3)])
    write(
        tmp_path,
        1,
        [round_line(n, "averaged", 10 + 50 * (n - 1), 20, f"d{n}") for n in (1, 2, 3)]
        + [{"step": 40, "loss": 5.0, "time": 300.0}],
    )
    write(tmp_path, 2, [round_line(1, "averaged", 10, 20, "d1"), round_line(3, "alone", 210, 1, "x3")])
    row = scale.summarize(tmp_path, 3, survivors=[0, 1, 2], faults=[Fault("freeze", 2, 40.0, 200.0)])
    assert row["peer_rounds_after_others"] == 0 and row["ended_after_others"] == 0
    assert row["rounds_everyone_running_applied"] == 2 and row["final_weights"] == 2
