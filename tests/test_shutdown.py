"""The shutdown watchdog's exit code tells a supervisor whether work was lost: 0 when it abandons a step that only
waited (the peer left cleanly enough), 1 when it abandons a critical section such as the final backup."""
from __future__ import annotations

import subprocess
import sys

import pytest

PEER = """
import os, signal, sys, time
from lean_transformer.swarm.shutdown import GracefulShutdown
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
