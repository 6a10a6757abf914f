"""Can this peer be dialled? A dial-back probe over libp2p, and the role a peer takes from its answers.

A peer behind a home router or a firewall can dial out but nobody can dial it. In a group that needs
every member to accept streams it fails every round (issue 43), and its DHT record advertises addresses
nobody outside its network reaches. So at start a peer asks one or two peers of the run (its initial
peers: a bootstrap, or any live peer) to dial it back: each answers which of the addresses we listen on
answered as a libp2p host does (a TCP connection that greets with multistream-select). None did: the
peer is ``private``, takes the client role (it contributes to its groups and fetches their results but
reduces nothing, and its DHT runs in client mode); otherwise it is ``public``. A run's first peer has
nobody to ask and is public; a peer whose probes get no answer at all (older peers serve no dial-back)
assumes public and says so.

Every peer and every bootstrap serves the dial-back handler, :data:`HANDLER`. Its name is not scoped
by run: a bootstrap may serve no run or several, and a private run's key space is derived from a
secret the bootstrap need not hold. What a requester can make us do is bounded: we dial at most
:data:`MAX_TARGETS` addresses per request, only the requester's ports, at the address its connection
came from or at a globally routable address it announces (never a loopback or private address other
than its own, which would probe our own network), and each requester gets :data:`PER_PEER` probes a
minute, all requesters together :data:`PER_MINUTE`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from dht.records import PeerRecord

log = logging.getLogger(__name__)
Role = Literal["public", "private"]
Setting = Literal["auto", "public", "private"]
HANDLER = "p2p-spes.dialback"
RECORD_FIELD = "reachability"  # a peer's role in its DHT record
MAX_TARGETS = 4  # addresses dialled per request
DIAL_TIMEOUT = 3.0  # seconds one TCP connect may take, and then its greeting
GREETING = b"\x13/multistream/1.0.0\n"  # what a libp2p listener sends first on every connection
ANSWER_TIMEOUT = 12.0  # seconds a requester waits for one answer (the dials run in parallel)
PER_PEER = 3  # probes a requester gets per WINDOW
PER_MINUTE = 30  # probes all requesters together get per WINDOW
WINDOW = 60.0
ASKED = 2  # peers a starting peer asks
CLIENT_ROLE = "averaging as a client: contributing and fetching, reducing nothing"
REDUCER_ROLE = "averaging as a reducer"


@dataclass(frozen=True)
class Dial:
    """One address a prober dialled, and whether it accepted (else why not)."""

    maddr: str
    ok: bool
    error: str = ""


@dataclass(frozen=True)
class Answer:
    """What one asked peer said: the dials it made, or why there was no answer (``error``)."""

    peer: str
    where: str  # how the log names it: "the bootstrap at /ip4/...", "peer Qm..."
    dials: tuple[Dial, ...] = ()
    error: str = ""

    @property
    def conclusive(self) -> bool:
        return not self.error and bool(self.dials)

    @property
    def accepted(self) -> bool:
        return any(d.ok for d in self.dials)


@dataclass(frozen=True)
class Reachability:
    """A peer's role and why it has it (what its log, record, inspector row and summary say)."""

    role: Role
    reason: str
    source: Literal["setting", "probe", "alone", "assumed"]

    @property
    def reachable(self) -> bool:
        return self.role == "public"

    def summary(self) -> str:
        return f"reachability: {self.role} ({self.reason})"

    def describe(self) -> str:
        """A peer's one log line: role, why, and what the role means for averaging."""
        return f"{self.summary()}: {REDUCER_ROLE if self.reachable else CLIENT_ROLE}"

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "reason": self.reason, "source": self.source}


def forced(setting: str, why: str) -> Reachability:
    """The role a setting or flag gives (no probe)."""
    return Reachability("private" if setting == "private" else "public", why, "setting")


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def tcp_address(maddr: str) -> tuple[str, int] | None:
    """``(host, port)`` of an ``/ip4/H/tcp/P`` or ``/ip6/H/tcp/P`` multiaddr (more may follow), else None."""
    parts = str(maddr).split("/")
    if len(parts) < 5 or parts[0] or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    try:
        host, port = str(ipaddress.ip_address(parts[2])), int(parts[4])
    except ValueError:
        return None
    return (host, port) if 0 < port < 65536 else None


def as_maddr(host: str, port: int) -> str:
    return f"/{'ip6' if ':' in host else 'ip4'}/{host}/tcp/{port}"


def dial_targets(announced: Iterable[str], observed: Iterable[str]) -> list[tuple[str, int]]:
    """Where to dial a requester: its announced ports at the address its connection came from (what a
    NAT shows: a port forward makes it reachable there), its announced addresses at that address, and
    its globally routable announced addresses; at most :data:`MAX_TARGETS`. Another private or loopback
    address is never dialled: on our side of the internet it is a machine of our own network."""
    seen_from = {str(ipaddress.ip_address(h)) for h in observed}
    addresses = [a for a in map(tcp_address, announced) if a is not None]
    ports = list(dict.fromkeys(port for _, port in addresses))
    targets = [(h, p) for h, p in addresses if h in seen_from]
    targets += [(h, p) for h in sorted(seen_from) for p in ports]
    targets += [(h, p) for h, p in addresses if ipaddress.ip_address(h).is_global]
    return list(dict.fromkeys(targets))[:MAX_TARGETS]


async def try_connect(host: str, port: int, timeout: float = DIAL_TIMEOUT) -> Dial:
    """Dial ``host:port`` and wait for a libp2p host's greeting: a listener opens every connection by
    announcing multistream-select (:data:`GREETING`). A bare TCP accept is not enough: a transparent
    proxy on the way (a firewall, or the lab's delay proxy) accepts every connection itself and closes it
    when its own dial onward fails. Returns accepted, or the reason it was not (refused, timed out, ...)."""
    maddr = as_maddr(host, port)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except asyncio.TimeoutError:
        return Dial(maddr, False, f"no answer in {timeout:.0f} s")
    except OSError as exc:
        return Dial(maddr, False, os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__)
    try:
        greeting = await asyncio.wait_for(reader.readexactly(len(GREETING)), timeout)
        why = None if greeting == GREETING else "answered, but not as a libp2p host"
    except asyncio.IncompleteReadError:
        why = "accepted, then closed without a libp2p greeting"
    except (asyncio.TimeoutError, OSError):
        why = f"accepted, but no libp2p greeting in {timeout:.0f} s"
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return Dial(maddr, why is None, why or "")


@dataclass
class RateLimit:
    """At most ``per_peer`` requests per requester and ``total`` in all per ``window`` seconds."""

    per_peer: int = PER_PEER
    total: int = PER_MINUTE
    window: float = WINDOW
    _times: dict[str, deque[float]] = field(default_factory=dict)
    _all: deque[float] = field(default_factory=deque)

    def admit(self, peer: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        for times in (self._all, *self._times.values()):
            while times and now - times[0] >= self.window:
                times.popleft()
        self._times = {p: t for p, t in self._times.items() if t}
        mine = self._times.setdefault(peer, deque())
        if len(mine) >= self.per_peer or len(self._all) >= self.total:
            return False
        mine.append(now)
        self._all.append(now)
        return True


class DialbackServer:
    """Serves :data:`HANDLER` on a hivemind ``P2P``: dial a requester's addresses back, say which accepted."""

    def __init__(self, p2p: Any, limit: RateLimit | None = None, timeout: float = DIAL_TIMEOUT) -> None:
        self.p2p, self.limit, self.timeout = p2p, limit or RateLimit(), timeout
        self.served = 0

    async def start(self) -> None:
        await self.p2p.add_protobuf_handler(HANDLER, self._rpc, averaging_pb2.DownloadData, stream_output=True)

    async def observed(self, peer: PeerID) -> list[str]:
        """The IP addresses our connections with ``peer`` come from (libp2p's view of them)."""
        try:
            infos = await self.p2p.list_peers()
        except Exception as exc:  # a daemon error: dial only its globally routable addresses
            log.debug("could not list our connections: %s", exc)
            return []
        hosts = [tcp_address(str(a)) for info in infos if info.peer_id == peer for a in info.addrs]
        return [h for h, _ in filter(None, hosts)]

    async def answer(self, requester: PeerID, announced: Sequence[str]) -> dict[str, Any]:
        """The answer to ``requester``: ``{"dials": [[maddr, ok, error], ...]}`` or ``{"error": ...}``."""
        if not self.limit.admit(requester.to_base58()):
            return {"error": f"rate limited: at most {self.limit.per_peer} dial-backs a minute per peer"}
        targets = dial_targets(announced, await self.observed(requester))
        if not targets:
            return {"error": "none of the announced addresses can be dialled back (no ip4/ip6 tcp address)"}
        dials = await asyncio.gather(*(try_connect(h, p, self.timeout) for h, p in targets))
        self.served += 1
        return {"dials": [[d.maddr, d.ok, d.error] for d in dials]}

    async def _rpc(self, request: averaging_pb2.DownloadData, context: Any):
        try:
            value = _unpack(request.metadata)
            announced = [str(m) for m in value["maddrs"]][:64]
        except Exception:  # untrusted input: any parse failure is the requester's error
            yield averaging_pb2.DownloadData(metadata=_pack({"error": "malformed dial-back request"}))
            return
        yield averaging_pb2.DownloadData(metadata=_pack(await self.answer(context.remote_id, announced)))


def parse_answer(peer: str, where: str, value: Any) -> Answer:
    """An :class:`Answer` from what ``peer`` sent (anything malformed is an answer with an error)."""
    if not isinstance(value, Mapping):
        return Answer(peer, where, error="a malformed answer")
    if "error" in value:
        return Answer(peer, where, error=str(value["error"])[:200])
    dials = []
    for item in value.get("dials") or []:
        if isinstance(item, (list, tuple)) and len(item) == 3 and isinstance(item[1], bool):
            dials.append(Dial(str(item[0]), item[1], str(item[2])[:100]))
    return Answer(peer, where, tuple(dials[:MAX_TARGETS])) if dials else Answer(peer, where, error="no dials")


async def ask(p2p: Any, peer: str, where: str, maddrs: Sequence[str], timeout: float = ANSWER_TIMEOUT) -> Answer:
    """Ask ``peer`` to dial ``maddrs`` back; a peer that does not serve :data:`HANDLER` (an older
    version) or does not answer in ``timeout`` seconds gives an answer with an error."""

    async def call() -> Answer:
        request = averaging_pb2.DownloadData(metadata=_pack({"maddrs": list(maddrs)}))
        stream = await p2p.iterate_protobuf_handler(
            PeerID.from_base58(peer), HANDLER, request, averaging_pb2.DownloadData
        )
        async for message in stream:
            return parse_answer(peer, where, _unpack(message.metadata))
        return Answer(peer, where, error="closed the stream without answering")

    try:
        return await asyncio.wait_for(call(), timeout)
    except asyncio.TimeoutError:
        return Answer(peer, where, error=f"no answer in {timeout:.0f} s")
    except Exception as exc:  # libp2p: no such handler (an older peer), no connection, ...
        return Answer(peer, where, error=f"{type(exc).__name__}: {exc}"[:200])


def decide(answers: Sequence[Answer]) -> Reachability:
    """The role ``answers`` show: public if any prober got through to any address; private if some
    answered and none got through; public, assumed, if nobody answered (older peers)."""
    conclusive = [a for a in answers if a.conclusive]
    through = next((a for a in conclusive if a.accepted), None)
    if through is not None:
        dial = next(d for d in through.dials if d.ok)
        return Reachability("public", f"{through.where} dialled {dial.maddr} back", "probe")
    if conclusive:
        failed = [d for a in conclusive for d in a.dials]
        first = conclusive[0]
        shown = ", ".join(f"{d.maddr} ({d.error})" for d in first.dials[:2])
        return Reachability(
            "private",
            f"{first.where} could not dial {shown}; {len(failed)} of {len(failed)} dials failed",
            "probe",
        )
    if not answers:
        return Reachability("public", "no initial peers to ask for a dial-back: the run's first peer", "alone")
    why = "; ".join(f"{a.where}: {a.error}" for a in answers[:2])
    return Reachability(
        "public",
        f"assumed: none of the {len(answers)} peers asked answered a dial-back ({why}); older peers serve none",
        "assumed",
    )


def askable(initial_peers: Iterable[str], me: str) -> list[tuple[str, str]]:
    """The first :data:`ASKED` of ``initial_peers`` (full multiaddrs) but us, as ``(peer id, how the log names it)``."""
    found: dict[str, str] = {}
    for maddr in initial_peers:
        parts = str(maddr).rstrip("/").split("/p2p/")
        if len(parts) == 2 and parts[1] and parts[1] != me:
            found.setdefault(parts[1], f"the initial peer at {parts[0]}")
    return list(found.items())[:ASKED]


async def ask_all(p2p: Any, maddrs: Sequence[str], peers: Sequence[tuple[str, str]]) -> list[Answer]:
    """Ask every one of ``peers`` (``(peer id, how the log names it)``) at once to dial ``maddrs`` back."""
    return list(await asyncio.gather(*(ask(p2p, peer, where, maddrs) for peer, where in peers)))


def is_private(record_extra: Mapping[str, Any]) -> bool:
    """Whether a peer's record (its free-form fields) says it cannot be dialled; older peers say nothing
    and count as reachable."""
    return record_extra.get(RECORD_FIELD) == "private"


def private_of(records: Mapping[str, PeerRecord]) -> set[str]:
    """The peers of ``records`` that say nobody can dial them."""
    return {p for p, r in records.items() if is_private(r.extra)}


def reachable_of(records: Mapping[str, PeerRecord]) -> list[str]:
    """The peers of ``records`` that can be dialled (older peers say nothing: they could, or they failed)."""
    return sorted(p for p, r in records.items() if not is_private(r.extra))


def reachable_first(peers: Iterable[str], private: Iterable[str]) -> list[str]:
    """``peers`` in their order, those that can be dialled first: a private peer is asked last, when a
    connection it opened to us may still carry the request."""
    late = set(private)
    ordered = list(peers)
    return [p for p in ordered if p not in late] + [p for p in ordered if p in late]


class SeenReachable:
    """The reachable peers recent reads of the run's records found, and when (monotonic). One read alone
    may miss a peer (a private peer's DHT, a client of a few servers, can lose them for a moment), and a
    group of clients that finds no reachable peer to reduce for it fails its round. Thread-safe: the
    reads come from the training thread, the questions from the event loop."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}
        self._latest = 0.0  # when our latest read was
        self._lock = threading.Lock()

    def update(self, live: Mapping[str, PeerRecord], raw: Mapping[str, Any], now: float, us: str = "") -> None:
        """Note the reachable peers of ``live`` as seen at ``now``; forget those whose ``raw`` record value
        (the same read, unchecked) says they left. A read that found no peer but ``us`` says more about our
        DHT (cut off for a while) than about the others: it does not move the clock they age by."""
        with self._lock:
            if any(p != us for p in live):
                self._latest = max(self._latest, now)
            self._seen.update(dict.fromkeys(reachable_of(live), now))
            for peer, value in raw.items():
                if isinstance(value, dict) and value.get("left"):
                    self._seen.pop(peer, None)

    def within(self, seconds: float, exclude: str = "") -> list[str]:
        """The reachable peers our latest read found, and those reads in the ``seconds`` before it found
        (but ``exclude``: ourselves). Counted from the latest read, not from now: reads come once or twice
        a round, and a round can last longer than a record lives."""
        with self._lock:
            return sorted(p for p, t in self._seen.items() if t >= self._latest - seconds and p != exclude)
