"""The lab's round trips without netem (benchmarks/lab/delay_proxy.py): every connection a peer dials
takes the link's round trip per exchange, whoever dials and from behind a NAT too, and a shaped link
keeps its rate. Root only."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.lab.netlab import Lab, LinkSpec, measure_link

ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 5400)); s.listen(8)
s.settimeout(float(sys.argv[1]))
print("ready", flush=True)
try:
    while True:
        c, _ = s.accept()
        while (b := c.recv(64)):
            c.sendall(b)
        c.close()
except socket.timeout:
    pass
"""
# connects, then times 5 one-byte exchanges; prints the connect time and the median exchange, in ms
PING = """
import socket, statistics, sys, time
t0 = time.perf_counter(); c = socket.create_connection((sys.argv[1], 5400), timeout=10)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); c.sendall(b"x"); c.recv(1); t1 = time.perf_counter()
rtts = []
for _ in range(5):
    t = time.perf_counter(); c.sendall(b"y"); c.recv(1); rtts.append(time.perf_counter() - t)
c.close(); print(round((t1 - t0) * 1000, 1), round(statistics.median(rtts) * 1000, 1))
"""


def ping(lab: Lab, source: int, address: str) -> tuple[float, float]:
    out = subprocess.run(
        [*lab.argv_prefix(source), sys.executable, "-c", PING, address], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    first, median = out.stdout.split()
    return float(first), float(median)


@pytest.mark.slow
def test_every_dialled_connection_has_the_round_trip_and_the_link_keeps_its_rate():
    ok, reason = Lab.available(nat=True, rtt=True)
    if not ok:
        pytest.skip(reason)
    links = [LinkSpec(rtt_ms=100, up_mbit=20, down_mbit=20), LinkSpec(rtt_ms=100, nat=True), LinkSpec()]
    with Lab(links) as lab:
        echoes = [
            subprocess.Popen([*lab.argv_prefix(i), sys.executable, "-c", ECHO, "40"], stdout=subprocess.PIPE, text=True)
            for i in (0, 2)
        ]
        try:
            for echo in echoes:
                assert echo.stdout.readline().strip() == "ready"
            public = ping(lab, 0, lab.address(2))  # a delayed peer dials an undelayed one
            natted = ping(lab, 1, lab.address(0))  # from behind a NAT, through its router
            plain = ping(lab, 2, lab.address(0))  # the undelayed peer dials: no proxy on its side
            rate = measure_link(lab, 0, 2, nbytes=2_500_000)
        finally:
            for echo in echoes:
                echo.kill()
                echo.communicate(timeout=10)
    assert lab.leftovers() == []
    for first, median in (public, natted):
        assert 90 <= median <= 140, (public, natted)  # one round trip per exchange
        assert first >= 190, (public, natted)  # the dial and the first exchange: two round trips
    assert plain[1] < 20, plain
    assert 16 < rate < 22.5, rate  # 20 Mbit/s still holds with the proxy in the path
