"""Issue 43's first target in the lab: one public peer and two peers each behind its own home router
(``benchmarks/lab/home_router.py``: it masquerades the peer's network and forwards nothing inbound),
20 Mbit/s links, started with no NAT-specific flag. Each peer finds out at start whether it can be
dialled (``dht/reachability.py``): the NATed ones must say private, the first one public. After the
joiners' catch-up every peer must be in every round and average, none may skip steps, and all must end
with identical weights.

On the code before the dial-back and the client role (issue 43, measured with the tiny config for 150
steps), every one of the 15 peer-rounds failed: the NATed peers could not dial each other's advertised
private addresses, and the three peers ended with three different models. Root only (network
namespaces, iptables); skipped with the reason elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import SMALL

from benchmarks.lab.netlab import Lab, LinkSpec
from benchmarks.lab.wan_report import read_swarm
from p2p_spes.local_swarm import LocalSwarm

MBIT = 20.0
RUN = [
    *SMALL,
    "train.batch_size=8",
    "swarm.sync_steps=20",
    "train.log_interval=1",
    "train.eval_interval=1000",
    "train.checkpoint_interval=1000",
    "train.max_steps=120",
    "swarm.matchmaking_time=4",
    "swarm.averaging_timeout=30",
]


@pytest.mark.slow
@pytest.mark.long
def test_natted_peers_find_they_are_private_and_average_every_round(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("needs root: the lab builds network namespaces and home routers")
    ok, reason = Lab.available(nat=True)
    if not ok:
        pytest.skip(reason)
    links = [LinkSpec(up_mbit=MBIT, down_mbit=MBIT)] + [LinkSpec(up_mbit=MBIT, down_mbit=MBIT, nat=True)] * 2
    with Lab(links) as lab:
        swarm = LocalSwarm(None, RUN, peers=3, run_dir=tmp_path, run_id="nat-test", place=lab.place)
        try:
            swarm.start(stagger=1.0)
            codes = swarm.wait(timeout=420)
        finally:
            swarm.stop()
    assert lab.leftovers() == []
    assert codes == [0, 0, 0], f"exit codes {codes}; logs in {tmp_path}"
    roles = [s.get("reachability", {}) for s in swarm.summaries()]
    assert [r.get("role") for r in roles] == ["public", "private", "private"], roles
    assert roles[0]["source"] == "alone" and {r["source"] for r in roles[1:]} == {"probe"}, roles
    for i in (1, 2):
        log = (tmp_path / f"peer{i}.log").read_text()
        line = next((x for x in log.splitlines() if "reachability: private" in x), "")
        assert f"the initial peer at /ip4/{lab.public_address(0)}/tcp/" in line, line or log[-2000:]
        assert "reducing nothing" in line
    report = read_swarm(tmp_path, 3)
    after = report.rounds_after_join()
    assert all(len(rows) >= 3 for rows in after.values()), f"too few rounds after the join: {report.describe_rounds()}"
    for peer, rows in after.items():
        missed = [(r.round, r.members, r.outcome) for r in rows if r.members != 3 or r.outcome != "averaged"]
        assert not missed, f"peer {peer} missed rounds after the join {missed}: {report.describe_rounds()}"
    assert [p.steps_skipped for p in report.peers] == [0, 0, 0], report.describe_rounds()
    assert report.identical, report.differences
