"""The swarm's plumbing: one event-loop thread that owns the DHT and libp2p, and bounded DHT reads/writes.

The trainer is synchronous; hivemind is asyncio. Every network call of a peer runs on this one loop
(``call`` blocks the training thread on it), so the DHT, the RPC handlers and the all-reduce share one
thread and no lock is needed around them. A DHT request that never answers must not hang a round:
reads and writes give up after ``DHT_REQUEST_TIMEOUT``.
"""

from __future__ import annotations

import asyncio
import asyncio.subprocess as aio_subprocess
import ctypes
import logging
import os
import signal
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from dht.auth import RunAuth
from dht.node import Redial, peer_id_of, start_dht
from dht.records import signed_values
from p2p_spes.averaging.wire_meter import MeteredP2P, WireMeter
from p2p_spes.config import SwarmConfig
from p2p_spes.errors import SwarmError

log = logging.getLogger(__name__)
DHT_REQUEST_TIMEOUT = 20.0  # seconds; a DHT get/store that takes longer is given up on
_FORK_HOOK_INSTALLED = False


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this (forked) process when its parent dies, so no DHT outlives a trainer."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _patch_child_spawns() -> None:
    """In the DHT process: make the p2pd daemon it spawns die with it, too."""
    _die_with_parent()
    original = aio_subprocess.create_subprocess_exec

    async def exec_dying_with_parent(*args, **kwargs):
        kwargs.setdefault("preexec_fn", _die_with_parent)
        return await original(*args, **kwargs)

    aio_subprocess.create_subprocess_exec = exec_dying_with_parent


def check_maddrs(sw: SwarmConfig) -> None:
    """Name a malformed multiaddr before anything starts (hivemind's own error does not say which)."""
    for maddr in list(sw.initial_peers) + list(sw.host_maddrs) + list(sw.announce_maddrs):
        try:
            Multiaddr(maddr)
        except Exception:
            raise SwarmError(
                f"{maddr!r} is not a multiaddr; expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/PEER_ID"
            ) from None
    for maddr in sw.initial_peers:
        if "/p2p/" not in maddr:
            raise SwarmError(f"{maddr!r} lacks the peer id: a bootstrap address ends in /p2p/PEER_ID")


class Runtime:
    """The DHT, its libp2p handle and the loop they run on; ``run_id`` is the (key-space) prefix of every key."""

    def __init__(self, sw: SwarmConfig, auth: RunAuth) -> None:
        global _FORK_HOOK_INSTALLED
        check_maddrs(sw)
        self.auth = auth
        self.run_id = auth.keyspace(sw.run_id)  # a private run's keys live under a secret-derived name
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="p2p-spes-swarm", daemon=True)
        self._thread.start()
        if not _FORK_HOOK_INSTALLED:
            os.register_at_fork(after_in_child=_patch_child_spawns)
            _FORK_HOOK_INSTALLED = True
        try:
            self.dht, self.identity = start_dht(
                sw.identity_path,
                [self.run_id],
                auth=auth,
                initial_peers=list(sw.initial_peers) or None,
                host_maddrs=list(sw.host_maddrs),
                announce_maddrs=list(sw.announce_maddrs) or None,
                client_mode=sw.client_mode,
                use_relay=sw.use_relay,
                use_auto_relay=sw.use_auto_relay,
                startup_timeout=sw.bootstrap_timeout,
            )
        except SwarmError:
            self._stop_loop()
            raise
        except Exception as exc:
            self._stop_loop()
            peers = ", ".join(sw.initial_peers) or "(none)"
            raise SwarmError(
                f"could not join the DHT through {peers}: {type(exc).__name__}: {exc}. Check that the address is "
                "complete (/ip4/HOST/tcp/PORT/p2p/PEER_ID), that a peer of the run is listening there, and that no "
                "firewall blocks the port"
            ) from None
        self.peer_id: str = self.identity.peer_id
        self.initial_peer_ids = [p for p in map(peer_id_of, sw.initial_peers) if p and p != self.peer_id]
        self.maddrs = [str(m) for m in self.dht.get_visible_maddrs()]
        self.meter = WireMeter()  # every byte on our streams, by purpose (averaging/wire_meter.py)
        self.p2p = MeteredP2P(self.call(self.dht.replicate_p2p()), self.meter)

    def call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run ``coro`` on the loop and wait for its result (from any thread but the loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Coroutine) -> Future:
        """Start ``coro`` on the loop without waiting for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def get(self, key: str) -> dict[str, dict[str, Any]]:
        """The signed values under ``key`` (bounded: a DHT request that never answers reads as empty)."""
        try:
            found = await asyncio.wait_for(self.dht.get(key, latest=True, return_future=True), DHT_REQUEST_TIMEOUT)
        except asyncio.TimeoutError:
            log.warning("DHT read of %s timed out after %.0f s", key, DHT_REQUEST_TIMEOUT)
            return {}
        return signed_values(found)

    async def store(self, key: str, value: dict[str, Any], ttl: float) -> None:
        """Write our own record under ``key``: signed, under our owner subkey, naming our peer id."""
        now = get_dht_time()
        try:
            await asyncio.wait_for(
                self.dht.store(
                    key,
                    {**value, "peer_id": self.peer_id},
                    expiration_time=now + ttl,
                    subkey=self.identity.owner,
                    return_future=True,
                ),
                DHT_REQUEST_TIMEOUT,
            )
        except asyncio.TimeoutError:
            log.warning("DHT write of %s timed out after %.0f s", key, DHT_REQUEST_TIMEOUT)

    async def redial(self, known: list[str], force: bool = False, probe: int = 0) -> tuple[int, int]:
        """Ping ``known`` peers and our initial peers: all of them when the DHT knows no neighbour (or with
        ``force``), else up to ``probe`` of those it lacks (``dht.node.Redial``).

        Returns the neighbours before and after; a DHT that does not answer in time reads as ``(-1, -1)``."""
        peers = tuple(dict.fromkeys(p for p in [*known, *self.initial_peer_ids] if p != self.peer_id))
        try:
            return await asyncio.wait_for(
                self.dht.run_coroutine(Redial(peers, force=force, probe=probe), return_future=True), DHT_REQUEST_TIMEOUT
            )
        except asyncio.TimeoutError:
            return -1, -1

    def shutdown(self) -> None:
        """Stop the DHT, cancel what still runs on the loop, and stop the loop."""
        try:
            self.dht.shutdown()
        finally:

            async def cancel_pending() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            try:
                self.call(cancel_pending(), timeout=5)
            except Exception as exc:
                log.debug("pending swarm tasks did not stop cleanly: %s", exc)
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
