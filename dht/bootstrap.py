"""``p2p-spes bootstrap``: a long-lived DHT peer that others join through. It trains nothing.

Its identity file keeps its peer id, so with a fixed listen port its multiaddr survives restarts and
can be written once into scripts and READMEs. Any number of bootstraps may run; none is special,
and any live peer of a run serves as well. Given a config, it also publishes the run's config
(signed, with its hash) so that volunteers need nothing but its multiaddr.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hivemind.utils import get_dht_time

from dht.keys import run_config_key
from dht.node import start_dht
from dht.reachability import DialbackServer, Reachability, Setting, ask_all, askable, decide, forced
from dht.run_config import run_config_record
from p2p_spes.config import Config
from p2p_spes.errors import SwarmError

log = logging.getLogger(__name__)


@dataclass
class BootstrapOptions:
    identity_path: str = "bootstrap.key"
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/31337"])
    announce_maddrs: list[str] = field(default_factory=list)
    initial_peers: list[str] = field(default_factory=list)  # other bootstraps, so they know each other
    use_relay: bool = True
    use_auto_relay: bool = False
    run_id: str | None = None
    config: Config | None = None  # published as the run's config when given
    record_ttl: float = 60.0
    startup_timeout: float = 30.0
    reachability: Setting = "auto"  # auto: public unless its initial peers cannot dial it back


class Bootstrap:
    """Start with :meth:`start`, block in :meth:`serve` until :meth:`stop` (or SIGINT/SIGTERM)."""

    def __init__(self, options: BootstrapOptions) -> None:
        if options.config is not None and not options.run_id:
            raise SwarmError("publishing a config needs --run-id: the run the config belongs to")
        self.options = options
        self.dht = None
        self.identity = None
        self._stop = threading.Event()
        self.published: dict | None = None
        self.reachability: Reachability | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # runs the dial-back handler

    def start(self) -> list[str]:
        """Start the DHT peer; returns the multiaddrs to share."""
        o = self.options
        Path(o.identity_path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="bootstrap-dialback", daemon=True).start()
        self._start_dht(client_mode=o.reachability == "private")
        if o.reachability == "auto":
            self.reachability = self._probe()
            if not self.reachability.reachable:
                self.dht.shutdown()  # its address must not go into others' routing tables: nobody can dial it
                self._start_dht(client_mode=True, restart=True)
        else:
            self.reachability = forced(o.reachability, f"set by --reachability {o.reachability}")
        log.info(self.reachability.summary())
        self._call(DialbackServer(self._call(self.dht.replicate_p2p())).start())
        if o.config is not None:
            o.config.swarm.run_id = o.run_id
            self.published = {**run_config_record(o.config), "peer_id": self.identity.peer_id}
            self.publish()
        return self.maddrs

    def _call(self, coro: Coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _start_dht(self, client_mode: bool, restart: bool = False) -> None:
        o = self.options
        try:
            self.dht, self.identity = start_dht(
                str(Path(o.identity_path).expanduser()),
                [o.run_id] if o.run_id else [],
                initial_peers=list(o.initial_peers) or None,
                host_maddrs=list(o.host_maddrs),
                announce_maddrs=list(o.announce_maddrs) or None,
                use_relay=o.use_relay,
                use_auto_relay=o.use_auto_relay,
                startup_timeout=o.startup_timeout,
                client_mode=client_mode,
                check_if_identity_free=not restart,  # a restart: the node using it was ours, and is stopped
            )
        except SwarmError:
            raise
        except Exception as exc:
            raise SwarmError(
                f"could not start the bootstrap peer on {' '.join(o.host_maddrs)}: {type(exc).__name__}: {exc}. "
                "Is the port free? Is the identity file used by another running peer?"
            ) from None

    def _probe(self) -> Reachability:
        """Ask up to two of our initial peers (other bootstraps) to dial us back (``dht/reachability.py``)."""
        asked = askable(self.options.initial_peers, self.identity.peer_id)
        if not asked:
            return decide([])
        p2p = self._call(self.dht.replicate_p2p())
        try:
            return decide(self._call(ask_all(p2p, self.maddrs, asked)))
        finally:
            self._call(p2p.shutdown())

    @property
    def maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def publish(self) -> bool:
        """(Re)store the run's config under our signed subkey; True if the DHT accepted it."""
        if self.published is None:
            return False
        ok = self.dht.store(
            run_config_key(self.options.run_id),
            self.published,
            expiration_time=get_dht_time() + self.options.record_ttl,
            subkey=self.identity.owner,
        )
        if not ok:
            log.warning("the DHT did not accept the run config record (will retry)")
        return bool(ok)

    def serve(self, on_tick: Callable[[], None] | None = None) -> None:
        """Keep the config published until stopped; SIGINT/SIGTERM stop it (in the main thread)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: self._stop.set())
        while not self._stop.wait(self.options.record_ttl / 3):
            self.publish()
            if on_tick is not None:
                on_tick()

    def stop(self) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
