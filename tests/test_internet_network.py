"""benchmarks/internet.py's network pieces: the delay relay gives a TCP round trip close to the one asked for across two
namespaces, a NAT'ed namespace refuses inbound connections but still dials out, and closing the network leaves no
namespace, link or CPU cgroup behind; a peer's helper processes leave its CPU quota when asked. Needs root, `ip`,
`tc` and `nft`."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.internet import DEFAULT_SHARES, STARTUP_SHARES, InternetNetwork, check_requirements

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(check_requirements() is not None, reason=str(check_requirements()))
PORT = 7300


def start(network: InternetNetwork, peer: int, *argv: str) -> subprocess.Popen:
    process = subprocess.Popen(network.command(peer, [sys.executable, str(REPO / "benchmarks" / "latency.py"), *argv]),
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def measure(network: InternetNetwork, peer: int, host: str, port: int) -> float:
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from benchmarks.latency import tcp_round_trip; "
            f"print(tcp_round_trip({host!r}, {port}, count=5, timeout=2))")
    result = subprocess.run(network.command(peer, [sys.executable, "-c", code]), capture_output=True, text=True,
                            timeout=30, check=True)
    return float(result.stdout)


def test_relay_gives_the_round_trip_asked_for_and_nat_refuses_inbound():
    with InternetNetwork(3, tag=f"i{os.getpid() % 10000}") as network:
        network.limit_cpu(1, 0.5)
        start(network, 1, "--echo", f"127.0.0.1:{PORT}")
        start(network, 1, "--rtt_ms", "80", "--forward", f"{network.peer_ips[1]}:{PORT}", f"127.0.0.1:{PORT}")
        start(network, 2, "--echo", f"{network.peer_ips[2]}:{PORT}")
        network.block_inbound(2)
        relayed = measure(network, 0, network.peer_ips[1], PORT)
        with pytest.raises(subprocess.CalledProcessError):  # the NAT'ed namespace drops the connection's SYN
            measure(network, 0, network.peer_ips[2], PORT)
        start(network, 2, "--echo", f"127.0.0.1:{PORT + 1}")
        start(network, 2, "--rtt_ms", "0", "--forward", f"127.0.0.1:{PORT + 2}", f"{network.peer_ips[1]}:{PORT}")
        outbound = measure(network, 2, "127.0.0.1", PORT + 2)  # the NAT'ed peer dials out through the relay
        cgroup = network.cgroup(1)
        assert cgroup.exists() and (cgroup / "cpu.cfs_quota_us").read_text().strip() == "50000"
        network.lift_cpu_limit(1)  # a peer told to stop
        assert (cgroup / "cpu.cfs_quota_us").read_text().strip() == "-1"
    assert 0.078 <= relayed <= 0.110, relayed
    assert 0.078 <= outbound <= 0.110, outbound
    assert network.leftovers() == []
    assert not cgroup.exists()


def test_requirements_name_what_is_missing(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "nft" else f"/usr/sbin/{tool}")
    assert check_requirements() == "needs the 'nft' command (nftables)"


def cpu_cgroup(pid: int) -> str:
    """The v1 cpu cgroup ``pid`` is in, as /proc/PID/cgroup names it."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return next(line.split(":", 2)[2] for line in lines if "cpu" in line.split(":", 2)[1].split(","))


def test_spare_processes_leave_the_quota():
    """benchmarks/internet.py's --quota training: the trainer process keeps the quota, its helpers (here a child
    process) move to the peer's cgroup without one; until its quota, a peer starting up takes precedence."""
    with InternetNetwork(2, tag=f"q{os.getpid() % 10000}") as network:
        network.limit_cpu(1, None)
        assert (network.cgroup(1) / "cpu.shares").read_text().strip() == str(STARTUP_SHARES)  # starting up first
        parent = subprocess.Popen(network.command(1, [sys.executable, "-c", (
            "import subprocess, sys; child = subprocess.Popen(['sleep', '30']); print(child.pid, flush=True); "
            "sys.stdin.read()")]), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            child = int(parent.stdout.readline())
            network.limit_cpu(1, 0.5, spare_pids=[child])
            root = "/" + str(network.cgroup_root.relative_to("/sys/fs/cgroup/cpu"))
            assert cpu_cgroup(parent.pid) == f"{root}/peer1"
            assert cpu_cgroup(child) == f"{root}/peer1_spare"
            assert (network.cgroup(1) / "cpu.shares").read_text().strip() == str(DEFAULT_SHARES)
            spare = network.cgroup_root / "peer1_spare"
            assert (spare / "cpu.cfs_quota_us").read_text().strip() == "-1"
        finally:
            os.kill(child, 9)
            parent.kill()
            parent.wait()
    assert network.leftovers() == [] and not spare.exists()
