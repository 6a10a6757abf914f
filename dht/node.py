"""Starting a run's DHT node: the peer id is the identity file's key, and the run's validators are installed.

Every process that joins a run (trainer peer, bootstrap, inspector, ``fetch-config``) starts its
DHT here, so they all speak as their identity (``dht/identity.py``) and all check records the same
way (``dht/validators.py``). It is the top of the package's core (keys, identity, auth, records,
validators): none of those uses it.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import hivemind
from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID

from dht.auth import RunAuth
from dht.identity import Identity, load_identity
from dht.validators import run_validators
from p2p_spes.errors import SwarmError


def sigterm_as_interrupt() -> Any:
    """SIGTERM raises KeyboardInterrupt in this process, so it leaves through its ``finally`` blocks like
    Ctrl-C; returns the previous handler. A process forked later (hivemind's DHT and averagers) inherits
    the handler; there it restores the default and dies of the signal, as it would have without us,
    instead of printing a KeyboardInterrupt traceback from inside its event loop."""
    owner = os.getpid()

    def interrupt(signum: int, frame: Any) -> None:
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def check_listen_ports(maddrs: Iterable[str]) -> None:
    """Fail early, and clearly, when a fixed TCP port we are to listen on is taken (p2pd's own error
    is a startup timeout that names nothing)."""
    for maddr in maddrs:
        parts = str(maddr).split("/")
        if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or parts[4] in ("", "0"):
            continue
        family = socket.AF_INET if parts[1] == "ip4" else socket.AF_INET6
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((parts[2], int(parts[4])))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise SwarmError(
                        f"port {parts[4]} on {parts[2]} is in use by another process; stop it or listen on another "
                        f"port (--host-maddrs /{parts[1]}/{parts[2]}/tcp/PORT, or PORT 0 for any free one)"
                    ) from None


def start_dht(
    identity_path: str | None = None, run_ids: Sequence[str] = (), auth: RunAuth | None = None, **dht_kwargs: Any
) -> tuple[hivemind.DHT, Identity]:
    """A hivemind DHT whose peer id is ``identity_path``'s key and which signs and checks records.

    Returns ``(dht, identity)``; ``dht_kwargs`` go to ``hivemind.DHT`` (initial_peers, host_maddrs,
    client_mode, use_relay, ...). An existing identity is checked to be unused by a live peer, unless
    ``check_if_identity_free=False`` (a restart of our own node, which we have just stopped).
    """
    check_listen_ports(dht_kwargs.get("host_maddrs") or [])
    identity = load_identity(identity_path)
    check_free = dht_kwargs.pop("check_if_identity_free", True) and not identity.created
    try:
        dht = hivemind.DHT(
            start=True,
            identity_path=identity.path,
            record_validators=run_validators(identity, run_ids, auth),
            check_if_identity_free=check_free,
            **dht_kwargs,
        )
    finally:
        identity.discard()
    if dht.peer_id.to_base58() != identity.peer_id:
        dht.shutdown()
        raise SwarmError(f"the DHT came up as {dht.peer_id} instead of the identity's {identity.peer_id}")
    return dht, identity


def peer_id_of(maddr: str) -> str | None:
    """The peer id a full multiaddr ends in (``.../p2p/PEER_ID``), or None."""
    parts = str(maddr).rstrip("/").split("/")
    return parts[-1] if len(parts) >= 2 and parts[-2] == "p2p" and parts[-1] else None


@dataclass(frozen=True)
class Redial:
    """Run in the DHT's process: ping ``peer_ids`` our routing table lacks, and look our neighbours up again.

    hivemind drops a neighbour from the routing table after one request it did not answer, and only
    ``initial_peers`` at start-up fill it. A peer whose own requests all timed out (it was stopped, or
    its link dropped for a while) and whom the others dropped in turn never hears of anyone again: it
    reads no records, sees itself alone and trains apart from the run for good; two such peers that
    find each other form a run of their own. Pinging peers it knew (their addresses stay in libp2p's
    peer store) puts them back, and a lookup of our own id finds their neighbours.

    With an empty table (or ``force``: a peer that reads nobody although it read others) every peer in
    ``peer_ids`` is pinged; otherwise up to ``probe`` of those the table lacks, so that a group cut off
    from the rest meets it again. Returns ``(neighbours before, neighbours after)``."""

    peer_ids: tuple[str, ...]
    timeout: float = 10.0
    force: bool = False
    probe: int = 0

    async def __call__(self, _dht: hivemind.DHT, node: DHTNode) -> tuple[int, int]:
        table = node.protocol.routing_table
        before = len(table.uid_to_peer_id)
        targets = [PeerID.from_base58(p) for p in self.peer_ids]
        if before and not self.force:
            known = set(table.uid_to_peer_id.values())
            targets = [p for p in targets if p not in known][: self.probe]
        if not targets:
            return before, before
        try:
            await asyncio.wait_for(
                asyncio.gather(*(node.protocol.call_ping(p) for p in targets), return_exceptions=True), self.timeout
            )
            if len(table.uid_to_peer_id) > before or self.force:
                await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), self.timeout)
        except asyncio.TimeoutError:
            pass
        return before, len(table.uid_to_peer_id)
