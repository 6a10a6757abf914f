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
import random
import signal
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from dht.auth import RunAuth
from dht.keys import peers_key
from dht.node import Redial, peer_id_of, start_dht
from dht.reachability import ASKED, DialbackServer, Reachability, ask_all, askable, decide, forced, is_private
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
        self._sw = sw
        self.dht, self.identity = self._start(client_mode=sw.client_mode or sw.reachability == "private")
        self.initial_peer_ids = [p for p in map(peer_id_of, sw.initial_peers) if p and p != self.identity.peer_id]
        self.meter = WireMeter()  # every byte on our streams, by purpose (averaging/wire_meter.py)
        try:
            self.p2p = MeteredP2P(self.call(self.dht.replicate_p2p()), self.meter)
            self.maddrs = [str(m) for m in self.dht.get_visible_maddrs()]
            self.reachability = self._find_role()
            if not self.reachability.reachable and not (sw.client_mode or sw.reachability == "private"):
                # a DHT in server mode puts our address into others' routing tables, where nobody can dial it
                self.call(self._close_replica())
                self.dht.shutdown()
                self.dht, self.identity = self._start(client_mode=True, restart=True)
                self.p2p = MeteredP2P(self.call(self.dht.replicate_p2p()), self.meter)
                self.maddrs = [str(m) for m in self.dht.get_visible_maddrs()]
            log.info(self.reachability.describe())
            self.peer_id: str = self.identity.peer_id
            self.dialback = DialbackServer(self.p2p)  # every peer answers others' probes (the rate is bounded)
            self.call(self.dialback.start())
        except BaseException:
            self.dht.shutdown()
            self._stop_loop()
            raise

    def _start(self, client_mode: bool, restart: bool = False) -> tuple[Any, Any]:
        """Start our DHT node (and its libp2p daemon); a failure is a :class:`SwarmError` naming the cause.
        A ``restart`` of the node we just stopped skips the check that no live peer uses our identity."""
        sw = self._sw
        try:
            return start_dht(
                sw.identity_path,
                [self.run_id],
                auth=self.auth,
                initial_peers=list(sw.initial_peers) or None,
                host_maddrs=list(sw.host_maddrs),
                announce_maddrs=list(sw.announce_maddrs) or None,
                client_mode=client_mode,
                use_relay=sw.use_relay,
                use_auto_relay=sw.use_auto_relay,
                startup_timeout=sw.bootstrap_timeout,
                check_if_identity_free=not restart,
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

    async def _close_replica(self) -> None:
        """Stop our handle on the daemon before the daemon goes (its tasks must end on this loop, not be
        collected while pending)."""
        await self.p2p.shutdown()
        await asyncio.sleep(0.1)

    def _find_role(self) -> Reachability:
        """Our role: the one ``swarm.reachability`` forces, else the dial-back probe's (``dht/reachability.py``):
        one or two of our initial peers are asked, then, if none of them answered, peers of the run's records."""
        sw = self._sw
        if sw.reachability != "auto":
            return forced(sw.reachability, f"set by swarm.reachability={sw.reachability}")
        if sw.client_mode:
            return forced("private", "set by swarm.client_mode")
        me = self.identity.peer_id
        asked = askable(sw.initial_peers, me)
        if not asked:
            return decide([])  # the run's first peer: nobody to ask
        answers = self.call(ask_all(self.p2p, self.maddrs, asked))
        if not any(a.conclusive for a in answers):
            others = self._reachable_records(exclude={me, *(p for p, _ in asked)})
            answers += self.call(ask_all(self.p2p, self.maddrs, others[:ASKED])) if others else []
        return decide(answers)

    def _reachable_records(self, exclude: set[str]) -> list[tuple[str, str]]:
        """Peers of the run whose records say they can be dialled, as ``(peer id, how the log names it)``."""
        try:
            records = self.call(self.get(peers_key(self.run_id)))
        except Exception as exc:  # a DHT that does not answer: nobody more to ask
            log.info("could not read the run's peers to ask for a dial-back: %s", exc)
            return []
        found = [
            (peer, f"peer {peer[:12]}")
            for peer, value in records.items()
            if peer not in exclude and isinstance(value, dict) and not value.get("left") and not is_private(value)
        ]
        random.shuffle(found)
        return found

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
