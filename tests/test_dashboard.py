"""The dashboard: its state from the inspector's snapshots, its server, and the page in a real browser.

The browser test loads the page in headless Chromium (Debian's ``chromium``; ``.ci/run`` installs it when
it can, and the test says why it skips when it cannot) against a live 2-peer loopback run, waits until the
coverage map and the peers table show both peers, checks what they show and keeps a screenshot in the run
directory. The same page against an unreachable address and a wrong run id must say so in words.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import P2P, SMALL, group_alive, stop, wait_for

from dht.dashboard import DashboardServer, RunWatch
from p2p_spes.local_swarm import LocalSwarm


def snapshot(peers: dict[str, list[int]], experts: int = 4, step: int = 10, rounds=()) -> dict:
    rows = [
        {
            "peer_id": p,
            "maddrs": [],
            "experts": e,
            "step": step,
            "round": 1,
            "loss": 5.0 + i,
            "tokens": 100 * step,
            "tokens_per_s": 50.0,
            "bytes_sent": 1,
            "bytes_received": 2,
            "rounds_joined": 1,
            "rounds_failed": 0,
        }
        for i, (p, e) in enumerate(sorted(peers.items()))
    ]
    holders = {x: [p for p, e in peers.items() if x in e] for x in range(experts)}
    return {
        "run_id": "r",
        "time": 0.0,
        "peers": rows,
        "replicas": 1,
        "rounds": list(rounds),
        "coverage": [
            {"expert": x, "holders": len(h), "peers": h, "status": "ok" if h else "missing"} for x, h in holders.items()
        ],
        "run": {
            "config_hashes": [],
            "fingerprints": ["f"],
            "peers": len(rows),
            "total_tokens": 0,
            "tokens_per_s": 50.0 * len(rows),
            "bytes_sent": 0,
            "bytes_received": 0,
        },
    }


def test_the_watch_keeps_history_from_the_moment_it_started_and_says_when_the_run_is_empty():
    watch = RunWatch(["/ip4/127.0.0.1/tcp/1"], "run", label="run")
    round1 = {"round": 1, "step": 10, "participants": 2}
    watch.take(snapshot({"A": [0, 1], "B": [2]}, step=10, rounds=[round1]), now=100.0)
    watch.take(snapshot({"A": [0, 1], "B": [2]}, step=10), now=105.0)  # no new step: no new point
    watch.take(
        snapshot({"A": [0, 1], "B": [2]}, step=20, rounds=[{"round": 2, "step": 20, "participants": 2}]), now=110.0
    )
    state = watch.snapshot_json()
    assert state["status"] == "live" and state["message"] == ""
    assert [p["step"] for p in state["history"]["A"]] == [10, 20]
    assert [r["round"] for r in state["rounds"]] == [1, 2]  # round 1 kept after peers stopped reporting it
    assert [t["t"] for t in state["throughput"]] == [100.0, 105.0, 110.0]
    watch.take(snapshot({}), now=120.0)
    state = watch.snapshot_json()
    assert state["status"] == "empty" and "no live peer publishes under run id 'run'" in state["message"]
    assert "--run-id" in state["message"] and "--secret-file" in state["message"]


def test_a_restarted_dashboard_shows_the_curves_and_rounds_it_saw_before(tmp_path):
    first = RunWatch(["/ip4/127.0.0.1/tcp/1"], "run", label="my run", state_dir=tmp_path)
    first.take(
        snapshot({"A": [0, 1], "B": [2]}, step=10, rounds=[{"round": 1, "step": 10, "participants": 2}]), now=100.0
    )
    first.take(
        snapshot({"A": [0, 1], "B": [2]}, step=20, rounds=[{"round": 2, "step": 20, "participants": 2}]), now=110.0
    )
    before = first.snapshot_json()
    first.stop()  # the dashboard process ends; its history stays in the state directory
    assert [p.name for p in tmp_path.iterdir()] == ["my_run.sqlite"]

    second = RunWatch(["/ip4/127.0.0.1/tcp/1"], "run", label="my run", state_dir=tmp_path)
    server = DashboardServer(second, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        state = json.loads(urllib.request.urlopen(server.url + "api/state", timeout=10).read())
        second.take(snapshot({"A": [0, 1]}, step=30, rounds=[{"round": 3, "step": 30, "participants": 1}]), now=120.0)
        csv_text = urllib.request.urlopen(server.url + "api/curves.csv", timeout=10).read().decode()
    finally:
        server.shutdown()
        server.server_close()
        second.stop()
    assert [r["round"] for r in state["rounds"]] == [1, 2] and state["rounds"] == before["rounds"]
    assert state["history"] == before["history"] and state["throughput"] == before["throughput"]
    rows = [line.split(",") for line in csv_text.strip().splitlines()]
    assert rows[0] == ["peer", "t", "step", "tokens", "loss", "tokens_per_s"]
    assert [(r[0], r[2]) for r in rows[1:]] == [("A", "10"), ("B", "10"), ("A", "20"), ("B", "20"), ("A", "30")]
    assert RunWatch(["/ip4/127.0.0.1/tcp/1"], "run", label="my run").curves_csv().count("\n") == 1  # no state dir


def test_the_server_serves_the_page_its_assets_and_the_state_and_nothing_else():
    watch = RunWatch(["/ip4/127.0.0.1/tcp/1"], "run", label="run")
    watch.take(snapshot({"A": [0]}), now=1.0)
    server = DashboardServer(watch, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        page = urllib.request.urlopen(server.url, timeout=10).read().decode()
        assert (
            'id="coverage"' in page
            and 'src="/dashboard.js"' in page
            and "http" not in page.split("<body>")[1].split("api/state")[0]
        )
        script = urllib.request.urlopen(server.url + "dashboard.js", timeout=10).read().decode()
        assert "innerHTML" not in script  # run data goes in as text only
        state = json.loads(urllib.request.urlopen(server.url + "api/state", timeout=10).read())
        assert state["snapshot"]["peers"][0]["peer_id"] == "A"
        for method in ("POST", "PUT", "DELETE"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(
                    urllib.request.Request(server.url + "api/state", data=b"x", method=method), timeout=10
                )
            assert err.value.code == 405
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(server.url + "etc/passwd", timeout=10)
        assert err.value.code == 404
    finally:
        server.shutdown()
        server.server_close()


# In a browser ------------------------------------------------------------------------------------
def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; .ci/run installs it when it can)")


def browse(url: str, profile: Path, screenshot: Path | None = None) -> str:
    """The page's DOM after its scripts ran for a few (virtual) seconds, and optionally a screenshot."""
    args = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=8000",
        "--window-size=1280,1700",
    ]
    args += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    done = subprocess.run([*args, url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def section(dom: str, element_id: str) -> str:
    """The markup inside the element with ``element_id`` (up to the next section)."""
    start = dom.index(f'id="{element_id}"')
    return dom[start : dom.find("</section>", start)]


def start_dashboard(tmp_path: Path, name: str, initial_peers: list[str], run_id: str) -> tuple[subprocess.Popen, str]:
    """A dashboard process whose history goes to ``tmp_path/state`` (one file per run id)."""
    with open(tmp_path / f"{name}.log", "w") as log:
        proc = subprocess.Popen(
            [
                *P2P,
                "dashboard",
                "--initial-peers",
                *initial_peers,
                "--run-id",
                run_id,
                "--port",
                "0",
                "--interval",
                "1",
                "--bootstrap-timeout",
                "5",
                "--state-dir",
                str(tmp_path / "state"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    text = wait_for(
        lambda: re.search(r"(http://127\.0\.0\.1:\d+/) ", (tmp_path / f"{name}.log").read_text()),
        60,
        f"the {name} dashboard's address",
        proc,
    )
    return proc, text.group(1)


def state(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "api/state", timeout=10).read())


@pytest.mark.slow  # a 2-peer swarm, three dashboards and a browser: about a minute
def test_the_dashboard_in_a_browser_shows_a_live_run_and_explains_a_wrong_address_or_run_id(tmp_path):
    chromium()
    run_dir = tmp_path / "swarm"
    swarm = LocalSwarm(None, [*SMALL, "train.max_steps=2000"], 2, run_dir, run_id="dash")
    procs = []
    try:
        swarm.start(stagger=1.0)
        maddrs = swarm.wait_for_maddrs(0)
        live, live_url = start_dashboard(tmp_path, "live", maddrs, "dash")
        wrong, wrong_url = start_dashboard(tmp_path, "wrong-id", maddrs, "not-this-run")
        peer_id = maddrs[0].rsplit("/", 1)[1]
        gone, gone_url = start_dashboard(tmp_path, "unreachable", [f"/ip4/127.0.0.1/tcp/9/p2p/{peer_id}"], "dash")
        procs = [live, wrong, gone]

        # both peers publish their experts and have averaged a round together (the first peer may have
        # run round 1 alone while the second was starting)
        def both_peers_and_a_round() -> dict | None:
            s = state(live_url)
            together = any(r["participants"] == 2 for r in s["rounds"] or [])
            return s if s["snapshot"] and len(s["snapshot"]["peers"]) == 2 and together else None

        ready = wait_for(both_peers_and_a_round, 180, "both peers and a round in the dashboard's state", live)
        peers = {p["peer_id"]: p["experts"] for p in ready["snapshot"]["peers"]}
        experts = len(ready["snapshot"]["coverage"])

        dom = ""
        for _ in range(5):  # the page shows both peers once its first read of /api/state has been drawn
            dom = browse(live_url, tmp_path / "profile")
            if all(pid[-10:] in section(dom, "coverage") and pid[-10:] in section(dom, "peers") for pid in peers):
                break
            time.sleep(2)
        coverage, table = section(dom, "coverage"), section(dom, "peers")
        for pid in peers:
            assert pid[-10:] in coverage and pid[-10:] in table, f"peer {pid} not on the page"
        assert coverage.count("data-expert=") == experts
        assert coverage.count('class="held"') == sum(
            len(e) for e in peers.values()
        )  # one cell per expert a peer trains
        assert "live: 2 peer(s)" in dom and "run dash" in dom
        assert table.count(">public</td>") == 2  # loopback peers: each can be dialled (its reach column)
        assert re.search(r"<td>\d+</td><td>\d+</td><td>2</td>", section(dom, "rounds"))  # a round with 2 participants
        shot = run_dir / "dashboard.png"
        browse(live_url, tmp_path / "profile", screenshot=shot)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 30_000

        # restarted mid-run, the dashboard shows what it saw before from its state directory at once
        seen = state(live_url)
        stop(live)
        live, live_url = start_dashboard(tmp_path, "live-again", maddrs, "dash")
        procs[0] = live
        again = state(live_url)
        assert {r["round"] for r in seen["rounds"]} <= {r["round"] for r in again["rounds"]}
        for pid, points in seen["history"].items():
            assert points[0] in again["history"][pid]  # the first point, read before the restart

        wait_for(lambda: state(wrong_url)["status"] == "empty", 60, "the wrong run id's message", wrong)
        page = browse(wrong_url, tmp_path / "profile")
        assert "no live peer publishes under run id 'not-this-run'" in page and "check --run-id" in page
        wait_for(lambda: state(gone_url)["status"] == "unreachable", 90, "the unreachable address's message", gone)
        page = browse(gone_url, tmp_path / "profile")
        assert "cannot reach the run" in page and "could not reach the run through /ip4/127.0.0.1/tcp/9" in page
        assert "Traceback" not in page
    finally:
        for proc in procs:
            stop(proc)
        swarm.stop()
    assert not any(group_alive(p.pid) for p in procs)  # each dashboard stopped its DHT process too
    for name in ("live", "live-again", "wrong-id", "unreachable"):
        assert "Traceback" not in (tmp_path / f"{name}.log").read_text()
