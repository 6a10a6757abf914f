"""The lab's home routers (benchmarks/lab/home_router.py): a NATed peer dials out and is seen at its
router's address; nobody dials it, not at its private address nor at its router's; its link is shaped
like a public peer's. Root only."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.lab.netlab import Lab, LinkSpec, measure_link

LISTEN = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 5300)); s.listen(8)
s.settimeout(float(sys.argv[1]))
print("ready", flush=True)
try:
    while True:
        c, addr = s.accept(); print(addr[0], flush=True); c.close()
except socket.timeout:
    pass
"""
DIAL = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 5300), timeout=3).close(); print("connected")
except OSError as e:
    print("refused" if isinstance(e, ConnectionRefusedError) else "failed")
"""


def dial(lab: Lab, source: int, address: str) -> str:
    out = subprocess.run(
        [*lab.argv_prefix(source), sys.executable, "-c", DIAL, address], capture_output=True, text=True, timeout=30
    )
    return out.stdout.strip()


@pytest.mark.slow
def test_a_natted_peer_dials_out_and_nobody_dials_it():
    ok, reason = Lab.available(nat=True)
    if not ok:
        pytest.skip(reason)
    with Lab([LinkSpec(), LinkSpec(nat=True, up_mbit=8), LinkSpec(nat=True)]) as lab:
        assert lab.address(1) == "192.168.2.2" and lab.public_address(1) == "10.47.0.2"
        listeners = [
            subprocess.Popen(
                [*lab.argv_prefix(i), sys.executable, "-c", LISTEN, "25"], stdout=subprocess.PIPE, text=True
            )
            for i in range(3)
        ]
        try:
            for listener in listeners:
                assert listener.stdout.readline().strip() == "ready"
            outbound = [dial(lab, 1, lab.address(0)), dial(lab, 2, lab.address(0))]
            inbound = [dial(lab, 0, lab.address(1)), dial(lab, 0, lab.public_address(1))]
            across = [dial(lab, 1, lab.address(2)), dial(lab, 1, lab.public_address(2))]
        finally:
            for listener in listeners:
                listener.kill()
            seen = listeners[0].communicate(timeout=10)[0].split()
            for listener in listeners[1:]:
                listener.communicate(timeout=10)
        uploaded = measure_link(lab, 1, 0, nbytes=1_500_000)  # the NATed peer's upload cap still applies
    assert outbound == ["connected", "connected"]
    assert seen == [lab.public_address(1), lab.public_address(2)]  # masqueraded: the routers' addresses
    # no route to a private address; the router answers its own address itself (nothing is forwarded)
    assert inbound == ["failed", "refused"] and across == ["failed", "refused"]
    assert 6.4 < uploaded < 8.8, uploaded
    assert lab.leftovers() == []
