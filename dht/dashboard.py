"""``p2p-spes dashboard``: a read-only web page of a live run, built on the inspector's validated records.

A :class:`RunWatch` thread joins the run as a client-only DHT peer (like ``p2p-spes inspect``: it stores
and serves nothing, and only signed, schema-checked records reach it), reads the run every few seconds
with :func:`dht.inspector.collect`, and keeps what it saw since it started: each peer's step, loss and
throughput over time, every sync round any peer reported (peers publish their last rounds, so rounds
from before the dashboard started show too) and the run's total throughput. A
:class:`DashboardServer` serves the page (``dht/static``: plain HTML, CSS and JavaScript shipped in the
package, nothing from a CDN), the same data as JSON at ``/api/state`` and the curves as CSV at
``/api/curves.csv``; it answers GET only. With a state directory, what it saw is also kept on disk
(``dashboard_store.py``) and shown again after a restart; with a W&B project every read is logged to
one W&B run too (``p2p_spes/wandb_log.py``).

When the run cannot be reached (a wrong address, the bootstrap down) or nobody publishes under the run
id (a wrong ``--run-id``, or a private run without its ``--secret-file``), the page says so and the
watcher keeps trying: the dashboard can be started before the run.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from dht.auth import RunAuth
from dht.dashboard_store import HistoryStore, curves_csv, store_path
from dht.inspector import collect, open_dht
from dht.node import sigterm_as_interrupt

log = logging.getLogger(__name__)


class ViewLog(Protocol):
    """Somewhere each read of the run also goes (the trainer's W&B ``RunViewLog``): given by the caller,
    so the DHT side does not depend on the trainer's loggers."""

    def write(self, snapshot: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


STATIC = {
    "/": ("dashboard.html", "text/html"),
    "/dashboard.js": ("dashboard.js", "text/javascript"),
    "/dashboard.css": ("dashboard.css", "text/css"),
}
HISTORY = 2000  # points kept per peer
ROUNDS = 500  # rounds kept


@dataclass
class WatchState:
    """What the page shows: the watcher's status and everything it has seen."""

    status: str = "connecting"  # connecting | unreachable | empty | live
    message: str = ""
    updated: float | None = None  # wall time of the last successful read
    snapshot: dict[str, Any] | None = None  # the last collect()
    history: dict[str, deque] = field(default_factory=dict)  # peer id -> points {t, step, tokens, loss, tokens_per_s}
    rounds: dict[int, dict[str, Any]] = field(default_factory=dict)  # round -> the merged row (inspector)
    throughput: deque = field(default_factory=lambda: deque(maxlen=HISTORY))  # {t, peers, tokens_per_s}

    def to_json(self, run_id: str) -> dict[str, Any]:
        return {
            "run_id": run_id,
            "status": self.status,
            "message": self.message,
            "updated": self.updated,
            "snapshot": self.snapshot,
            "history": {p: list(h) for p, h in self.history.items()},
            "rounds": [self.rounds[r] for r in sorted(self.rounds)],
            "throughput": list(self.throughput),
        }


class RunWatch(threading.Thread):
    """Reads the run every ``interval`` seconds into a :class:`WatchState` (see the module docstring)."""

    def __init__(
        self,
        initial_peers: list[str],
        run_id: str,
        auth: RunAuth | None = None,
        interval: float = 5.0,
        startup_timeout: float = 15.0,
        label: str | None = None,
        state_dir: str | Path | None = None,
        wandb_log: ViewLog | None = None,
    ) -> None:
        """With ``state_dir`` what the watch sees is also kept on disk (``dashboard_store.py``) and what an
        earlier dashboard of the same run kept there is shown from the start. With ``wandb_log`` every read
        of the run is also logged to a W&B run (``p2p_spes/wandb_log.py``), finished when the watch stops."""
        super().__init__(daemon=True, name="dashboard-watch")
        self.initial_peers, self.run_id, self.auth = list(initial_peers), run_id, auth
        self.label = label or run_id  # the run id as the user gave it (a private run's keyspace is hashed)
        self.interval, self.startup_timeout = interval, startup_timeout
        self.state = WatchState()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.dht = None
        self.wandb_log = wandb_log
        self.store = HistoryStore(store_path(state_dir, self.label)) if state_dir is not None else None
        if self.store is not None:
            self._restore(self.store)

    def _restore(self, store: HistoryStore) -> None:
        s = self.state
        for peer, points in store.points(HISTORY).items():
            s.history[peer] = deque(points, maxlen=HISTORY)
        s.rounds = {int(r["round"]): r for r in store.rounds(ROUNDS)}
        s.throughput.extend(store.throughput(HISTORY))
        if s.rounds or s.history:
            log.info("restored %d rounds and %d peers' curves from %s", len(s.rounds), len(s.history), store.path)

    def curves_csv(self) -> str:
        """The peers' curves as CSV: every point kept on disk, else those in memory."""
        with self.lock:
            if self.store is not None:
                return curves_csv(self.store.all_points())
            return curves_csv(
                sorted(((p, x) for p, h in self.state.history.items() for x in h), key=lambda i: i[1]["t"])
            )

    def snapshot_json(self) -> dict[str, Any]:
        with self.lock:
            return self.state.to_json(self.label)

    def stop(self) -> None:
        self.stopped.set()
        if self.is_alive():
            self.join(timeout=self.startup_timeout + 10)
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
        if self.store is not None:
            with self.lock:
                self.store.close()
                self.store = None
        if self.wandb_log is not None:
            self.wandb_log.close()
            self.wandb_log = None

    def run(self) -> None:
        while not self.stopped.is_set():
            self.poll()
            self.stopped.wait(self.interval)

    def poll(self) -> None:
        """One read of the run (connecting first if needed); every failure becomes the page's message."""
        if self.dht is None:
            try:
                self.dht = open_dht(self.initial_peers, self.run_id, self.startup_timeout, auth=self.auth)
            except Exception as exc:  # any failure to join (bad address, nobody there) is shown, then retried
                self._set(
                    "unreachable",
                    f"could not reach the run through {' '.join(self.initial_peers)}: "
                    f"{str(exc).strip() or type(exc).__name__}. Check the address (a live peer's or "
                    f"the bootstrap's multiaddr); retrying every {self.interval:.0f} s.",
                )
                return
        try:
            snapshot = collect(self.dht, self.run_id)
        except Exception as exc:  # a DHT read that failed: keep what we had, say why, try again
            self._set("unreachable", f"reading the run's records failed: {exc}; retrying every {self.interval:.0f} s.")
            return
        self.take(snapshot, time.time())

    def _set(self, status: str, message: str) -> None:
        with self.lock:
            if message != self.state.message:
                log.warning("%s", message)
            self.state.status, self.state.message = status, message

    def take(self, snapshot: dict[str, Any], now: float) -> None:
        """Record one :func:`collect` snapshot taken at wall time ``now``."""
        with self.lock:
            s = self.state
            s.snapshot, s.updated = snapshot, now
            if snapshot["peers"]:
                s.status, s.message = "live", ""
            else:
                s.status = "empty"
                s.message = (
                    f"the DHT answers, but no live peer publishes under run id {self.label!r}: check --run-id "
                    "(the run's swarm.run_id) and, for a private run, --secret-file; or the run has not "
                    "started yet, or has ended."
                )
            added = []
            for p in snapshot["peers"]:
                points = s.history.setdefault(p["peer_id"], deque(maxlen=HISTORY))
                point = {
                    "t": now,
                    "step": p["step"],
                    "tokens": p["tokens"],
                    "loss": p["loss"],
                    "tokens_per_s": p["tokens_per_s"],
                }
                if not points or points[-1]["step"] != p["step"]:
                    points.append(point)
                    added.append((p["peer_id"], point))
            throughput = {"t": now, "peers": len(snapshot["peers"]), "tokens_per_s": snapshot["run"]["tokens_per_s"]}
            s.throughput.append(throughput)
            for r in snapshot["rounds"]:
                s.rounds[r["round"]] = r  # the newest view of a round: more peers may have reported it
            for old in sorted(s.rounds)[:-ROUNDS]:
                del s.rounds[old]
            if self.store is not None:
                self.store.add(added, snapshot["rounds"], throughput)
        if self.wandb_log is not None and snapshot["peers"]:
            try:
                self.wandb_log.write(snapshot)
            except Exception as exc:  # W&B failing (its service gone) must not stop the page
                log.warning("could not log to W&B: %s", exc)


class _Handler(BaseHTTPRequestHandler):
    server: DashboardServer

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path == "/api/state":
            self._send(HTTPStatus.OK, "application/json", json.dumps(self.server.watch.snapshot_json()).encode())
        elif path == "/api/curves.csv":
            self._send(HTTPStatus.OK, "text/csv; charset=utf-8", self.server.watch.curves_csv().encode())
        elif path in STATIC:
            name, kind = STATIC[path]
            body = resources.files("dht").joinpath("static", name).read_bytes()
            self._send(HTTPStatus.OK, f"{kind}; charset=utf-8", body)
        else:
            self._send(
                HTTPStatus.NOT_FOUND,
                "text/plain",
                b"not found: the dashboard serves /, /api/state and /api/curves.csv\n",
            )

    def _refuse(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, "text/plain", b"the dashboard is read-only\n")

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

    def _send(self, status: HTTPStatus, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


class DashboardServer(ThreadingHTTPServer):
    """Serves the page and ``/api/state`` from a :class:`RunWatch`."""

    daemon_threads = True

    def __init__(self, watch: RunWatch, host: str = "127.0.0.1", port: int = 8080) -> None:
        self.watch = watch
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"

    def run(self, title: str) -> None:
        """Watch the run and serve until Ctrl-C or SIGTERM, then stop both (the watcher's DHT process too)."""

        sigterm_as_interrupt()
        self.watch.start()
        print(f"{title}: {self.url} (JSON at {self.url}api/state); Ctrl-C stops it", flush=True)
        if self.server_address[0] not in ("127.0.0.1", "::1"):
            print(
                f"serving on {self.server_address[0]}: anyone who can reach this machine can read the run's status",
                flush=True,
            )
        try:
            self.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            self.server_close()
            self.watch.stop()
