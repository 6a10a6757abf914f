"""A home router for one lab peer: the peer sits on a private network behind a namespace that
masquerades it and forwards nothing inbound, like a home NAT or a campus firewall.

The peer can dial out (its connections leave with the router's public address, and their replies come
back), but no one outside can dial it: a connection to its private address has no route, and one to
the router's public address finds nothing forwarded. The router's WAN side takes the peer's place on
the lab's bridge, so the lab's shaping (``tbf`` on the bridge port and on the peer's interface) is the
same as for a public peer. Not emulated: hairpinning, port-preserving or full-cone NATs, UPnP and
NAT-PMP (the router answers none), and the timeouts of a real router's connection table.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Run = Callable[[Sequence[str]], str]


@dataclass(frozen=True)
class RouterPlan:
    """The addresses of one home network: the router's public one on the lab's subnet, the private /24."""

    namespace: str
    public: str  # the router's WAN address (what others see the peer's connections come from)
    private_net: str  # e.g. 192.168.3 (the peer is .2, the router .1)

    @property
    def peer_address(self) -> str:
        return f"{self.private_net}.2"

    @property
    def gateway(self) -> str:
        return f"{self.private_net}.1"


def plan(lab_name: str, index: int, public: str) -> RouterPlan:
    """Peer ``index``'s router: its own private /24 (peer i behind 192.168.<i+1>.0/24)."""
    return RouterPlan(f"{lab_name}-r{index}", public, f"192.168.{index + 1}")


def iptables_missing() -> str | None:
    """Why a router cannot be built here (None if it can): it needs ``iptables``."""
    return None if shutil.which("iptables") else "needs `iptables` (Debian: apt-get install iptables) for NATed peers"


def build(run: Run, hub: str, peer_ns: str, bridge_port: str, router: RouterPlan) -> None:
    """Wire ``peer_ns`` behind ``router``: bridge port -> router WAN (``wan0``), router LAN (``lan0``) ->
    the peer's ``lab0``; masquerade outbound, drop new inbound. The router namespace must exist."""
    ns = router.namespace
    run(["ip", "-n", hub, "link", "add", bridge_port, "type", "veth", "peer", "name", "wan0", "netns", ns])
    run(["ip", "-n", ns, "addr", "add", f"{router.public}/24", "dev", "wan0"])
    run(["ip", "-n", ns, "link", "set", "wan0", "up"])
    run(["ip", "-n", ns, "link", "add", "lan0", "type", "veth", "peer", "name", "lab0", "netns", peer_ns])
    run(["ip", "-n", ns, "addr", "add", f"{router.gateway}/24", "dev", "lan0"])
    run(["ip", "-n", ns, "link", "set", "lan0", "up"])
    run(["ip", "-n", peer_ns, "addr", "add", f"{router.peer_address}/24", "dev", "lab0"])
    run(["ip", "-n", peer_ns, "link", "set", "lab0", "up"])
    run(["ip", "-n", peer_ns, "route", "add", "default", "via", router.gateway])
    inside = ["ip", "netns", "exec", ns]
    run([*inside, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
    run([*inside, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE"])
    run([*inside, "iptables", "-P", "FORWARD", "DROP"])
    run([*inside, "iptables", "-A", "FORWARD", "-i", "lan0", "-o", "wan0", "-j", "ACCEPT"])
    established = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
    run([*inside, "iptables", "-A", "FORWARD", "-i", "wan0", "-o", "lan0", *established])
