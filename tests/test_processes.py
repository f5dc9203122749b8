"""The process harness (lean_transformer/swarm/peers/processes.py) with small real child processes: events waited
for, an early exit reported with the log's tail, a stop that has to kill, the process tree tracked and cleaned up."""
from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from lean_transformer.swarm.peers.processes import PeerExited, PeerProcess, ProcessTracker, start_time, wait_until

REPO = Path(__file__).resolve().parent.parent
ENV = {"PYTHONPATH": str(REPO)}
# a child that opens the events file it is given (--events_path PATH, last on its command line) and reports epochs
EMITTER = """
import sys, time
from lean_transformer.swarm.monitoring.events import emit, open_events
open_events(sys.argv[-1], "trainer")
for epoch in range(1, 4):
    emit("epoch", epoch=epoch, loss=None, samples=epoch, mini_steps=1, skipped=0, compute_seconds=0.0,
         wall_seconds=0.0)
    time.sleep(0.1)
print("done", file=sys.stderr)
"""


def test_events_are_waited_for_and_an_early_exit_names_the_peer_with_its_log(tmp_path: Path):
    peer = PeerProcess("emitter", ["-c", EMITTER], tmp_path, ENV)
    third = peer.wait_for_event("epoch", lambda event: event["epoch"] == 3, timeout=60)
    assert third["samples"] == 3 and peer.wait(30) == 0
    assert [event["epoch"] for event in peer.events("epoch")] == [1, 2, 3]
    assert peer.events_path == tmp_path / "emitter.events.jsonl" and "done" in peer.stderr
    with pytest.raises(PeerExited, match=r"(?s)emitter exited with code 0 before the event 'joined'.*done"):
        peer.wait_for_event("joined", timeout=60)

    silent = PeerProcess("silent", ["-c", "import time; time.sleep(60)"], tmp_path, events=False)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="silent's event 'epoch'"):
        silent.wait_for_event("epoch", timeout=0.5)
    assert time.monotonic() - started < 5
    silent.kill()
    assert silent.returncode == -signal.SIGKILL

    # a wait on a condition that needs the peer running ends as soon as it exits, not at the timeout
    crashing = PeerProcess("crashing", ["-c", "import sys; sys.exit('the outer step failed')"], tmp_path, events=False)
    started = time.monotonic()
    with pytest.raises(PeerExited, match=r"(?s)crashing exited with code 1 while waiting for 3 rounds.*outer step"):
        wait_until(lambda: False, timeout=60, what="3 rounds", peers=[crashing])
    assert time.monotonic() - started < 30
    assert wait_until(lambda: "met", timeout=1, what="a condition met when the peer has exited", peers=[crashing])


def test_a_peer_that_ignores_sigterm_is_killed_with_its_whole_session(tmp_path: Path):
    """The child ignores SIGTERM and leaves a grandchild; ``stop`` waits, kills the session and says so."""
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print('up', flush=True); "
            "time.sleep(60)")
    peer = PeerProcess("stubborn", ["-c", code], tmp_path, events=False, argv_prefix=["env", "STUBBORN=1"])
    peer.wait_for("^up$", timeout=60, stream="stdout")
    tracker = ProcessTracker(peer.pid)  # rooted at the peer: the test process has children of its own in a full run
    tracker.scan()
    descendants = [peer.pid, *tracker.processes]  # the peer (through env, which execs) and its grandchild
    assert len(descendants) == 2, tracker.processes
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="stubborn did not exit within 1 s"):
        peer.stop(timeout=1)
    assert time.monotonic() - started < 10
    wait_until(lambda: not tracker.alive(), timeout=10, what="the session to be gone")
    assert all(start_time(pid) is None for pid in descendants)


def test_the_tracker_cleans_up_what_escaped_a_peers_session(tmp_path: Path):
    """A grandchild in a session of its own survives the peer's group kill; the tracker saw it and kills it."""
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
            " start_new_session=True); print('up', flush=True); time.sleep(60)")
    peer = PeerProcess("leaky", ["-c", code], tmp_path, events=False)
    tracker = ProcessTracker(peer.pid).watch(interval=0.05)  # rooted at the peer, as above
    peer.wait_for("^up$", timeout=60, stream="stdout")
    wait_until(lambda: len(tracker.processes) >= 1, timeout=10, what="the grandchild to be seen")
    tracker.stop_watching()
    peer.kill()
    assert len(tracker.alive()) == 1  # the escaped grandchild
    tracker.clean_up(timeout=10)
    assert tracker.alive() == []
