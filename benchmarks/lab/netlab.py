"""A small wide-area network on one machine: peers in network namespaces behind shaped links, with CPU caps.

Loopback hides what a real swarm meets: a joiner's catch-up download that takes seconds while the
others train on, a round whose transfers take longer than its compute, a peer on a slow CPU. A
:class:`Lab` builds, for N peers,

* a *hub* namespace holding a bridge ``br0`` (the "internet"), and for each peer a namespace with a
  veth ``lab0`` (address ``10.47.0.<i+1>/24``) whose other end ``p<i>`` is a port of the bridge.
  Everything, the bridge included, is inside namespaces the lab creates: the root namespace gets no
  interface, address or route, so no lab traffic can reach the host, its firewall or other labs, and
  parallel labs can use the same addresses and interface names. Namespace names carry the PID and a
  random suffix, so parallel runs never clash;
* with ``LinkSpec(nat=True)``, a peer behind its own home router instead (``home_router.py``): the
  bridge port leads to the router's WAN side, the peer sits on a private /24 behind it;
* ``tbf`` on both ends of each veth: egress of ``lab0`` is the peer's upload cap, egress of ``p<i>``
  (towards the peer) its download cap (see :func:`tbf_params` for the burst and queue sizes);
* with ``LinkSpec(rtt_ms=...)``, a round trip on every TCP connection the peer dials, through a delaying
  transparent proxy in its namespace (``delay_proxy.py`` says what that emulates and what not); give
  every peer the same value and every connection has it, whoever dials;
* a cgroup v1 ``cpu`` group per peer (``/sys/fs/cgroup/cpu/<lab>/peer<i>``) with
  ``cpu.cfs_quota_us`` = fraction x ``cpu.cfs_period_us`` for a peer given a CPU cap (unlimited
  otherwise: the group still tracks every process the peer starts, for cleanup).

:meth:`Lab.place` gives :class:`~p2p_spes.local_swarm.LocalSwarm` a peer's place: an argv prefix that
enters the peer's cgroup and namespace (``sh -c 'echo $$ > cgroup.procs && exec ip netns exec NS
"$@"'``: the process keeps its id, so the swarm still stops it by its process group) and the address
to listen on. Everything is removed on exit, on an exception and on SIGINT/SIGTERM (handlers are
installed while the lab is up and restored after): processes left in a peer's cgroup or namespace
are killed by id, then the namespaces (and with them the veths and the bridge) and the cgroups go.
Needs root, ``ip`` and ``tc`` (iproute2) and the cgroup v1 ``cpu`` controller; :meth:`Lab.available`
says which is missing. :func:`measure_link` times a TCP transfer between two peers (to check the
caps). Used by ``benchmarks/wan.py`` and ``tests/test_wan.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.lab import delay_proxy, home_router
from p2p_spes.local_swarm import PeerPlace

if TYPE_CHECKING:
    from typing_extensions import Self

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
SUBNET = "10.47.0"  # /24; peer i is .i+1 (the lab's namespaces are private, so every lab may use it)
PROXY_PORT = 7999  # the delay proxy's port on each peer's loopback
REPO = Path(__file__).resolve().parents[2]  # where ``python -m benchmarks.lab.delay_proxy`` imports from
MTU_FRAME = 1514  # bytes of a full Ethernet frame as tbf counts it
CFS_PERIOD_US = 100_000


class LabError(RuntimeError):
    """The lab could not be built or removed (the command and its error are in the message)."""


@dataclass(frozen=True)
class LinkSpec:
    """One peer's access link and CPU: caps in Mbit/s (None: unshaped) and a share of one core (None: no cap)."""

    up_mbit: float | None = None
    down_mbit: float | None = None
    cpu: float | None = None
    nat: bool = False  # behind its own home router (home_router.py): it can dial out, nobody can dial it
    rtt_ms: float = 0.0  # round trip added to every connection this peer dials (delay_proxy.py)


@dataclass(frozen=True)
class TbfParams:
    """A token bucket: ``rate`` bit/s, ``burst`` bytes at line rate, a queue of ``limit`` bytes."""

    rate_bit: int
    burst: int
    limit: int

    def args(self) -> list[str]:
        return ["tbf", "rate", f"{self.rate_bit}bit", "burst", str(self.burst), "limit", str(self.limit)]


def tbf_params(mbit: float) -> TbfParams:
    """Bucket and queue sizes that hold a ``mbit`` Mbit/s cap from 0.5 to 1000 Mbit/s.

    * burst: 2 ms at the rate, at least 6 full frames (9 kB). It must hold one frame (tbf drops or
      splits larger packets), and a few so that the hrtimer and softirq jitter (~1 ms) does not cost
      throughput at 100 Mbit/s; at 1 Mbit/s 9 kB is 72 ms at line rate, < 1% of a megabyte transfer.
    * limit (the queue): 50 ms at the rate plus the burst, at least 20 frames (30 kB). The lab's RTT
      is well below 1 ms, so TCP needs little queue to keep the link busy, but too short a queue makes
      a single flow lose packets at every window increase and fall well below the cap at low rates;
      a longer one only adds queueing delay (bufferbloat) the lab does not mean to model.

    Measured with :func:`measure_link` (one TCP flow of 1-3 s): 96.0%, 95.7%, 95.6% and 95.7% of 1, 8,
    20 and 100 Mbit/s arrive as payload (earlier, counting the first read: 96-98% of 1 to 1000); 95.6%
    is the cap less TCP/IP headers (1448 of 1514 bytes per frame), so the caps hold without loss of
    throughput from the bucket or the queue.
    """
    if mbit <= 0:
        raise LabError(f"a link cap must be positive, got {mbit} Mbit/s")
    rate = int(mbit * 1e6)
    burst = max(int(rate / 8 * 0.002), 6 * MTU_FRAME)
    limit = max(int(rate / 8 * 0.05) + burst, 20 * MTU_FRAME)
    return TbfParams(rate, burst, limit)


def cpu_quota_us(cpu: float | None) -> int:
    """``cpu.cfs_quota_us`` for a share of one core (``-1``: no cap); the kernel's minimum is 1 ms."""
    if cpu is None:
        return -1
    if cpu <= 0:
        raise LabError(f"a CPU cap must be positive, got {cpu}")
    return max(int(cpu * CFS_PERIOD_US), 1000)


def _run(argv: Sequence[str], timeout: float = 30.0) -> str:
    try:
        out = subprocess.run(list(argv), check=False, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LabError(f"{' '.join(argv)}: {exc}") from exc
    if out.returncode != 0:
        raise LabError(f"{' '.join(argv)}: exit {out.returncode}: {out.stderr.strip()}")
    return out.stdout


def _kill(pid: int) -> None:
    """SIGKILL ``pid``; if it is already a zombie and our child, reap it (a zombie keeps its cgroup busy)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return
    if state != "Z":
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # someone else's child: its parent reaps it


def _remove_cgroup(group: Path, timeout: float = 5.0) -> bool:
    """rmdir ``group``, retrying while it is busy (a killed process leaves it a moment after SIGKILL)."""
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / 0.1) + 1):
        try:
            group.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
    return False


@dataclass(frozen=True)
class InterfaceCounts:
    """Bytes and packets through an interface (Ethernet frames: their IP and TCP headers included)."""

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, other: InterfaceCounts) -> InterfaceCounts:
        return InterfaceCounts(
            self.tx_bytes - other.tx_bytes,
            self.rx_bytes - other.rx_bytes,
            self.tx_packets - other.tx_packets,
            self.rx_packets - other.rx_packets,
        )


class Lab:
    """N peers in network namespaces on one bridge, shaped per :class:`LinkSpec`; a context manager."""

    def __init__(self, links: Sequence[LinkSpec], name: str | None = None) -> None:
        if not 1 <= len(links) <= 250:
            raise LabError(f"a lab holds 1 to 250 peers, not {len(links)}")
        self.links = list(links)
        self.name = name or f"p2plab-{os.getpid()}-{secrets.token_hex(2)}"
        self.hub = f"{self.name}-hub"
        self.namespaces = [f"{self.name}-p{i}" for i in range(len(links))]
        self.cgroup = CPU_CGROUP / self.name
        self._created: list[str] = []  # namespaces made so far, in order (what close() removes)
        self._cgroups: list[Path] = []
        self._proxies: list[subprocess.Popen] = []
        self._previous: dict[int, Any] = {}
        self._closing = False
        self._deferred: int | None = None  # a signal that arrived while closing, re-raised after

    # Where peers run ------------------------------------------------------------------------------
    def address(self, index: int) -> str:
        """Where peer ``index`` listens: its public address, or its private one behind its router."""
        return self.router(index).peer_address if self.links[index].nat else self.public_address(index)

    def public_address(self, index: int) -> str:
        """Peer ``index``'s address on the bridge: its own, or its router's."""
        return f"{SUBNET}.{index + 1}"

    def router(self, index: int) -> home_router.RouterPlan:
        return home_router.plan(self.name, index, self.public_address(index))

    def argv_prefix(self, index: int) -> list[str]:
        """Prefix a command with this to run it in peer ``index``'s cgroup and namespace (same process id)."""
        procs = str(self.cgroup / f"peer{index}" / "cgroup.procs")
        script = 'echo $$ > "$1" && ns="$2" && shift 2 && exec ip netns exec "$ns" "$@"'
        return ["sh", "-c", script, "sh", procs, self.namespaces[index]]

    def place(self, index: int) -> PeerPlace:
        """Peer ``index``'s place for :class:`~p2p_spes.local_swarm.LocalSwarm` (``place=lab.place``)."""
        return PeerPlace(argv_prefix=tuple(self.argv_prefix(index)), host=self.address(index))

    def describe(self) -> dict[str, Any]:
        """What a result file should say about the network: names, addresses, caps and tbf parameters."""
        peers = []
        for i, link in enumerate(self.links):
            peers.append(
                {
                    "namespace": self.namespaces[i],
                    "address": self.address(i),
                    "public_address": self.public_address(i),
                    "router": self.router(i).namespace if link.nat else None,
                    **asdict(link),
                    "cpu_quota_us": cpu_quota_us(link.cpu),
                    "cpu_period_us": CFS_PERIOD_US,
                    "tbf_up": None if link.up_mbit is None else asdict(tbf_params(link.up_mbit)),
                    "tbf_down": None if link.down_mbit is None else asdict(tbf_params(link.down_mbit)),
                }
            )
        return {"lab": self.name, "hub": self.hub, "subnet": f"{SUBNET}.0/24", "peers": peers}

    # Building and removing --------------------------------------------------------------------------
    def __enter__(self) -> Self:
        self._install_handlers()
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def build(self) -> None:
        """Create the hub, every peer's namespace, veth, address, shaping and cgroup."""
        atexit.register(self.close)
        self._add_namespace(self.hub)
        _run(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge", "forward_delay", "0"])
        _run(["ip", "-n", self.hub, "link", "set", "br0", "up"])
        self.cgroup.mkdir()
        self._cgroups.append(self.cgroup)
        for i, link in enumerate(self.links):
            ns = self.namespaces[i]
            self._add_namespace(ns)
            if link.nat:
                self._add_namespace(self.router(i).namespace)
                home_router.build(_run, self.hub, ns, f"p{i}", self.router(i))
            else:
                _run(
                    ["ip", "-n", self.hub, "link", "add", f"p{i}", "type", "veth", "peer", "name", "lab0", "netns", ns]
                )
                _run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "lab0"])
                _run(["ip", "-n", ns, "link", "set", "lab0", "up"])
            _run(["ip", "-n", self.hub, "link", "set", f"p{i}", "master", "br0"])
            _run(["ip", "-n", self.hub, "link", "set", f"p{i}", "up"])
            if link.up_mbit is not None:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", "lab0", "root", *tbf_params(link.up_mbit).args()])
            if link.down_mbit is not None:
                _run(["tc", "-n", self.hub, "qdisc", "add", "dev", f"p{i}", "root", *tbf_params(link.down_mbit).args()])
            if link.rtt_ms > 0:
                self._start_delay(i, link.rtt_ms)
            group = self.cgroup / f"peer{i}"
            group.mkdir()
            self._cgroups.append(group)
            (group / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(cpu_quota_us(link.cpu)))

    def _start_delay(self, index: int, rtt_ms: float) -> None:
        """Peer ``index``'s delay proxy and the rule that sends its dials through it; the proxy lives in
        the namespace, so :meth:`close` kills it with the rest."""
        ns = self.namespaces[index]
        for rule in delay_proxy.redirect_rules(PROXY_PORT, f"{SUBNET}.0/24"):
            _run(["ip", "netns", "exec", ns, *rule])
        proxy = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "benchmarks.lab.delay_proxy"]
            + ["--port", str(PROXY_PORT), "--one-way-ms", str(rtt_ms / 2)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._proxies.append(proxy)
        ready, _, _ = select.select([proxy.stdout], [], [], 30.0)
        if not ready or proxy.stdout.readline().strip() != "ready":
            proxy.kill()
            _, err = proxy.communicate(timeout=10)
            raise LabError(f"the delay proxy of peer {index} did not start within 30 s: {err.strip()[-500:]}")

    def interface_counts(self, index: int) -> InterfaceCounts:
        """What went through peer ``index``'s network interface so far, as its kernel counted it."""
        out = json.loads(_run(["ip", "-n", self.namespaces[index], "-s", "-j", "link", "show", "dev", "lab0"]))
        stats = out[0]["stats64"]
        return InterfaceCounts(
            stats["tx"]["bytes"], stats["rx"]["bytes"], stats["tx"]["packets"], stats["rx"]["packets"]
        )

    def set_cpu(self, index: int, cpu: float | None) -> None:
        """Change peer ``index``'s CPU cap while it runs (``None``: no cap); e.g. once it has started, so
        that a slow peer is slow at training, not at importing its libraries."""
        (self.cgroup / f"peer{index}" / "cpu.cfs_quota_us").write_text(str(cpu_quota_us(cpu)))

    def _add_namespace(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._created.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def pids(self) -> set[int]:
        """Every process in one of the lab's cgroups or namespaces."""
        found: set[int] = set()
        for group in self._cgroups:
            try:
                found |= {int(p) for p in (group / "cgroup.procs").read_text().split()}
            except OSError:
                pass
        for ns in self._created:
            try:
                found |= {int(p) for p in _run(["ip", "netns", "pids", ns], timeout=10).split()}
            except LabError:
                pass
        return found

    def close(self, timeout: float = 10.0) -> None:
        """Kill what is left in the lab (by id), remove its namespaces and cgroups; idempotent.

        What could not be removed stays listed (and registered to be retried at exit) and is named in
        the :class:`LabError` raised at the end.
        """
        if self._closing:
            return
        self._closing = True
        errors: list[str] = []
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                left = self.pids() - {os.getpid()}
                if not left:
                    break
                for pid in left:
                    _kill(pid)
                time.sleep(0.1)
            for proxy in self._proxies:  # killed with the rest of their namespace above: reaped here
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proxy.wait(5)
            self._proxies = [p for p in self._proxies if p.poll() is None]
            for ns in reversed(list(self._created)):  # peers first: deleting one removes its veth pair
                try:
                    _run(["ip", "netns", "del", ns])
                    self._created.remove(ns)
                except LabError as exc:
                    errors.append(str(exc))
            for group in reversed(list(self._cgroups)):
                if _remove_cgroup(group):
                    self._cgroups.remove(group)
                else:
                    errors.append(f"could not remove {group}")
            if not self._created and not self._cgroups:
                atexit.unregister(self.close)
        finally:
            self._restore_handlers()
            self._closing = False
        if errors:
            raise LabError("lab cleanup incomplete: " + "; ".join(errors))
        if self._deferred is not None:
            signum, self._deferred = self._deferred, None
            signal.raise_signal(signum)

    def leftovers(self) -> list[str]:
        """What of this lab still exists (namespaces, cgroups): empty after :meth:`close`."""
        listed = {line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()}
        left = sorted(ns for ns in listed if ns.startswith(f"{self.name}-"))
        return left + ([str(self.cgroup)] if self.cgroup.exists() else [])

    # Signals ------------------------------------------------------------------------------------------
    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; the caller's own handling applies
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._closing:
            self._deferred = signum  # finish removing the lab first
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    # Checks ------------------------------------------------------------------------------------------
    @staticmethod
    def available(nat: bool = False, rtt: bool = False) -> tuple[bool, str]:
        """Whether a lab (with home routers, given ``nat``; with round trips, given ``rtt``) can be built
        here, and if not, why (for a test's skip reason or a CLI's error)."""
        if os.geteuid() != 0:
            return False, "needs root (network namespaces, tc and cgroups)"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return False, f"needs `{tool}` (iproute2) on PATH"
        if (missing := home_router.iptables_missing()) is not None and (nat or rtt):
            return False, missing
        if not (CPU_CGROUP / "cgroup.procs").exists():
            return False, f"needs the cgroup v1 cpu controller at {CPU_CGROUP}"
        probe = Lab(
            [LinkSpec(up_mbit=10, down_mbit=10, cpu=0.5, nat=nat, rtt_ms=10.0 if rtt else 0.0)],
            name=f"p2plab-{os.getpid()}-probe{secrets.token_hex(2)}",
        )
        try:
            probe.build()
        except (LabError, OSError) as exc:
            return False, f"cannot build a lab here: {exc}"
        finally:
            try:
                probe.close()
            except LabError as exc:
                return False, f"cannot remove a lab here: {exc}"
        return True, "root, iproute2, network namespaces, tbf and the cgroup v1 cpu controller are available"


_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 5201)); s.listen(1)
print("listening", flush=True)
s.settimeout(30); c, _ = s.accept(); c.settimeout(30); n, t0 = 0, None
while True:
    b = c.recv(1 << 16)
    if not b:
        break
    if t0 is None:  # the first read's bytes came before t0 (all that queued, when this process ran late)
        t0 = time.perf_counter()
    else:
        n += len(b)
print(n, time.perf_counter() - t0)
"""
_SOURCE = """
import socket, sys
s = socket.create_connection((sys.argv[1], 5201), timeout=30)
s.sendall(b"x" * int(sys.argv[2])); s.close()
"""


def measure_link(lab: Lab, sender: int, receiver: int, nbytes: int = 1_000_000, timeout: float = 60.0) -> float:
    """Mbit/s of one TCP transfer of ``nbytes`` from peer ``sender`` to peer ``receiver``: the bytes after
    the first read over the time from it to the last (counting the first read's, a sink scheduled late
    on a loaded machine read 2% above an 8 Mbit/s cap)."""
    sink = subprocess.Popen(
        [*lab.argv_prefix(receiver), sys.executable, "-c", _SINK, lab.address(receiver)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        # the source starts once the sink listens: on loaded cores a sink can take seconds to start
        ready, _, _ = select.select([sink.stdout], [], [], timeout)
        if not ready or sink.stdout.readline().strip() != "listening":
            raise LabError(f"the link measurement's sink did not start listening within {timeout:.0f} s")
        _run(
            [*lab.argv_prefix(sender), sys.executable, "-c", _SOURCE, lab.address(receiver), str(nbytes)],
            timeout=timeout,
        )
        out, err = sink.communicate(timeout=timeout)
    finally:
        if sink.poll() is None:
            os.killpg(sink.pid, signal.SIGKILL)
            sink.wait(5)
    if sink.returncode != 0:
        raise LabError(f"link measurement failed: {err.strip()}")
    received, seconds = out.split()
    return int(received) * 8 / float(seconds) / 1e6
