"""benchmarks/wan.py's network: namespaces joined to a bridge, links shaped with tc tbf, byte counters read from the
interfaces; and everything it builds is gone after an error, Ctrl+C or SIGTERM. Needs root, `ip` and `tc`."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.wan import WanNetwork, check_requirements

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(check_requirements() is not None, reason=str(check_requirements()))

SEND = """
import socket, sys, time
payload = b"x" * int(sys.argv[2])
with socket.create_connection((sys.argv[1], 5001), timeout=10) as sock:
    start = time.monotonic(); sock.sendall(payload); sock.shutdown(socket.SHUT_WR); sock.recv(1)
    print(time.monotonic() - start)
"""
RECEIVE = """
import socket
with socket.create_server(("0.0.0.0", 5001)) as server:
    print("listening", flush=True)
    connection, _ = server.accept()
    with connection:
        while connection.recv(1 << 16):
            pass
        connection.sendall(b"k")
"""


def send_between(wan: WanNetwork, size: int) -> float:
    """Send ``size`` bytes over TCP from the first peer's namespace to the second's; seconds until acknowledged."""
    receiver = subprocess.Popen(wan.command(1, [sys.executable, "-c", RECEIVE]), stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout.readline().strip() == "listening"
        sender = subprocess.run(wan.command(0, [sys.executable, "-c", SEND, wan.peer_ips[1], str(size)]),
                                capture_output=True, text=True, timeout=30, check=True)
        assert receiver.wait(timeout=10) == 0
        return float(sender.stdout)
    finally:
        receiver.kill()


def test_shaped_link_limits_the_rate_and_counts_the_bytes():
    with WanNetwork(2, tag=f"t{os.getpid() % 10000}") as wan:
        before = wan.sent_bytes()
        fast = send_between(wan, 1_000_000)
        wan.shape(20)
        shaped = send_between(wan, 1_000_000)
        sent = [after - first for after, first in zip(wan.sent_bytes(), before)]
    assert 2_000_000 <= sent[0] < 2_200_000  # payload + TCP/IP headers, twice
    assert sent[1] < 200_000  # the receiver only acknowledged
    assert shaped >= 0.35 and shaped > 3 * fast  # 1 MB at 20 Mbit/s is 0.4 s
    assert wan.leftovers() == []


def test_an_error_inside_removes_the_network_and_its_processes():
    wan = WanNetwork(2, tag=f"e{os.getpid() % 10000}")
    with pytest.raises(RuntimeError, match="boom"), wan:
        sleeper = subprocess.Popen(wan.command(1, ["sleep", "60"]), start_new_session=True)
        wan.shape(100)
        assert sleeper.pid in wan.pids() and os.getpid() not in wan.pids()  # the namespaces' processes only
        raise RuntimeError("boom")
    assert sleeper.wait(timeout=5) == -signal.SIGKILL
    assert wan.leftovers() == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_benchmark_removes_everything(signum):
    process = subprocess.Popen([sys.executable, "benchmarks/wan.py", "--network_check"], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()  # the benchmark builds within a few seconds or fails (then prints nothing)
        assert line.startswith("network ready: "), process.stderr.read()
        *namespaces, bridge = line.split(": ")[1].split()
        sleepers = [int(pid) for namespace in namespaces
                    for pid in subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                                              text=True).stdout.split()]
        assert len(sleepers) == 2
        process.send_signal(signum)
        assert process.wait(timeout=30) == 130
    finally:
        if process.poll() is None:
            process.kill()
    assert "interrupted; the network and the peers are removed" in process.stderr.read()
    assert not set(namespaces) & set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                    text=True).stdout.split())
    assert subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode != 0
    for pid in sleepers:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
