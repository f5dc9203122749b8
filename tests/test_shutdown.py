"""The shutdown watchdog's exit code tells a supervisor whether work was lost: 0 when it abandons a step that only
waited (the peer left cleanly enough), 1 when it abandons a critical section such as the final backup."""
from __future__ import annotations

import subprocess
import sys

import pytest

PEER = """
import os, signal, sys, time
from lean_transformer.swarm.peers.shutdown import GracefulShutdown
shutdown = GracefulShutdown(timeout=0.5)
os.kill(os.getpid(), signal.SIGTERM)
if sys.argv[1] == "critical":
    with shutdown.critical("final backup"):
        time.sleep(30)  # a save that outlasts the budget
else:
    time.sleep(30)  # a step waiting for an averaging round
"""


@pytest.mark.parametrize("section, code, message", [("critical", 1, "Abandoning the final backup unfinished"),
                                                    ("waiting", 0, "Abandoning the current step")])
def test_an_abandoned_critical_section_exits_non_zero(section, code, message):
    run = subprocess.run([sys.executable, "-c", PEER, section], capture_output=True, text=True, timeout=60)
    assert run.returncode == code and message in run.stderr, run.stderr[-2000:]


EXITING = """
import atexit, sys, threading, time
import torch
from lean_transformer.swarm.peers.shutdown import exit_after_clean_shutdown

def torch_forever():  # like hivemind's daemon thread that copies this peer's state for a downloading peer
    tensor = torch.randn(20_000_000)
    while True:
        tensor.clone()

def finish_late():
    time.sleep(0.5)
    print("non-daemon thread finished", flush=True)

torch.set_num_threads(1)
atexit.register(print, "exit handlers ran")
threading.Thread(target=torch_forever, daemon=True).start()
threading.Thread(target=finish_late).start()
time.sleep(0.3)
print("clean shutdown done", end="")  # unflushed
if sys.argv[1] == "ours":
    exit_after_clean_shutdown(3)
sys.exit(3)
"""


def test_a_daemon_thread_in_torch_does_not_abort_a_clean_exit(report):
    runs = {variant: subprocess.run([sys.executable, "-c", EXITING, variant], capture_output=True, text=True,
                                    timeout=60) for variant in ("python", "ours")}
    ours = runs["ours"]
    assert ours.returncode == 3, ours.stderr[-2000:]
    assert ours.stdout == "clean shutdown donenon-daemon thread finished\nexit handlers ran\n", ours.stdout
    assert "terminate called" not in ours.stderr
    python = runs["python"]
    if sys.version_info < (3, 14):  # CPython < 3.14 ends such a thread with pthread_exit: the process aborts
        assert python.returncode == -6 and "terminate called without an active exception" in python.stderr, \
            (python.returncode, python.stderr[-2000:])
    report(f"daemon thread in a torch op at exit: a plain exit ended with code {python.returncode} "
           f"({python.stderr.strip().splitlines()[-1] if python.stderr.strip() else 'no message'}), "
           f"exit_after_clean_shutdown with code {ours.returncode}, its exit handlers run")


ABANDONED = """
import logging, os, signal, subprocess, sys, threading
import torch
from lean_transformer.swarm.monitoring.events import peer_events
from lean_transformer.swarm.peers.shutdown import GracefulShutdown, errors_wait_for_an_ending, exit_now

# a stand-in for hivemind's DHT process: it shares a tensor as hivemind's processes do (file_system strategy); on the
# watchdog's SIGTERM it tells the main loop, which then fails, and it outlives the grace period, so the failure comes
# while the watchdog is still ending the process
CHILD = "import os, signal, time, torch; torch.multiprocessing.set_sharing_strategy('file_system'); " \\
        "shared = torch.zeros(1000).share_memory_(); " \\
        "signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getppid(), signal.SIGUSR1)); " \\
        "print(os.getpid(), flush=True); time.sleep(60)"
torch.multiprocessing.set_sharing_strategy("file_system")
shared = torch.zeros(1000).share_memory_()  # as the averagers' tensors in a trainer's main process
terminated = threading.Event()
signal.signal(signal.SIGUSR1, lambda *_: terminated.set())
guard = errors_wait_for_an_ending() if sys.argv[2] == "ours" else open(os.devnull)
try:  # run_trainer.main's structure
    with guard, peer_events(sys.argv[1], "trainer"):
        shutdown = GracefulShutdown(timeout=0.5)
        child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
        print(os.getpid(), child.stdout.readline().strip(), flush=True)  # the processes whose shared memory must go
        os.kill(os.getpid(), signal.SIGTERM)  # the step outlasts the budget: the watchdog abandons it
        while not terminated.wait(0.01):
            pass
        raise RuntimeError("Broken pipe")  # the loop's next call into a terminated hivemind process
except Exception:
    logging.exception("Unexpected error, stopping")
    exit_now(1)
"""


def test_an_error_of_the_loop_while_the_watchdog_abandons_it_is_not_reported(tmp_path, report):
    """The watchdog abandons a step and terminates the peer's processes while the main loop runs: the loop's error is
    not reported, one shutdown event ends the stream, and no shared memory is left behind (torch's files in
    /dev/shm, which os._exit and SIGKILL leave: the averagers' tensors, GBs for a large model)."""
    from lean_transformer.swarm.monitoring.events import read_events
    from lean_transformer.swarm.peers.processes import torch_shared_memory
    runs, endings = {}, {}
    for variant in ("unguarded", "ours"):
        events = tmp_path / f"{variant}.jsonl"
        runs[variant] = subprocess.run([sys.executable, "-c", ABANDONED, str(events), variant], capture_output=True,
                                       text=True, timeout=60)
        endings[variant] = [(event["reason"], event["clean"]) for event in read_events(events, "shutdown")]
        pids = [int(pid) for pid in runs[variant].stdout.split()]
        assert len(pids) == 2, runs[variant].stdout
        assert torch_shared_memory(pids) == [], runs[variant].stderr[-2000:]
    ours = runs["ours"]
    assert ours.returncode == 0 and "Abandoning the current step" in ours.stderr, ours.stderr[-2000:]
    assert "Traceback" not in ours.stderr and "Unexpected error" not in ours.stderr, ours.stderr[-2000:]
    assert endings["ours"] == [("signal", False)]
    unguarded = runs["unguarded"]  # the error is reported as a bug, after the stream's end
    assert "Unexpected error, stopping" in unguarded.stderr and "RuntimeError: Broken pipe" in unguarded.stderr
    assert endings["unguarded"] == [("signal", False)]
    report(f"an error of the main loop while the watchdog abandons it: unguarded, a traceback and exit code "
           f"{unguarded.returncode}; ours, exit code {ours.returncode}, one shutdown event")
