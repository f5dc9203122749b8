"""Shared by the tests that run whole swarms of peer processes: watching a process tree while it runs (to check
afterwards that nothing of it is left), and reading what trainers report in their logs."""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from lean_transformer.demo.local_swarm import ProcessTracker

_EPOCH_REPORT = re.compile(r"Reached epoch (\d+): mean loss (\S+) over (\d+) mini-steps \((\d+) samples, (\d+) skipped\)")


class TreeWatcher:
    """Scans the processes below ``root_pid`` (and the hivemind sockets they hold) every ``interval`` s in a
    background thread, from ``start()`` until ``stop()``; ``tracker`` then knows every process and socket seen."""

    def __init__(self, root_pid: int, interval: float = 0.3):
        self.tracker = ProcessTracker(root_pid)
        self._interval, self._stopped = interval, threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-watcher", daemon=True)

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            self.tracker.scan()

    def start(self) -> "TreeWatcher":
        self.tracker.scan()
        self._thread.start()
        return self

    def stop(self) -> ProcessTracker:
        self._stopped.set()
        self._thread.join(10)
        return self.tracker


@dataclass(frozen=True)
class EpochReport:
    """What a trainer logged (and published as its metrics record) when it reached ``epoch``."""

    epoch: int
    mean_loss: float
    mini_steps: int
    samples: int
    skipped: int


def epoch_reports(log: str) -> Dict[int, EpochReport]:
    """The trainer's reports by epoch (a restarted trainer's log may hold an epoch twice: the later one wins)."""
    return {int(match[0]): EpochReport(int(match[0]), float(match[1]), int(match[2]), int(match[3]), int(match[4]))
            for match in _EPOCH_REPORT.findall(log)}


def transitions(log: str) -> List[int]:
    """The epochs a peer moved to, in order (hivemind's "Transitioning to epoch N")."""
    return [int(epoch) for epoch in re.findall(r"Transitioning to epoch (\d+)", log)]


def round_in_progress(log: str, started: str) -> Optional[int]:
    """The epoch whose averaging round ``log`` shows begun and not finished (no transition to the next epoch yet), if
    any; ``started``: the regex of the round's first line, its group 1 the epoch."""
    epochs = re.findall(started, log)
    if epochs and f"Transitioning to epoch {int(epochs[-1]) + 1}\n" not in log:
        return int(epochs[-1])
    return None


def kill_during_round(peer, partner, started: str, timeout: float, min_epoch: int = 0) -> tuple[int, bool]:
    """SIGKILL ``peer`` (a ``PeerProcess``) as soon as it and ``partner`` are both in an open averaging round (see
    :func:`round_in_progress`), ``peer``'s of epoch >= ``min_epoch``. Returns the lower of the two rounds' epochs and
    whether both rounds were still open right after the kill. The epochs may differ: peers whose local epoch labels
    are apart still average together (hivemind's group key has no epoch), and waiting for equal labels once took
    two minutes of rounds (seen in tests/test_faults.py, victim two labels ahead of its partner)."""
    def in_round(process) -> Optional[int]:
        return round_in_progress(process.stderr, started)

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        epoch, partner_epoch = in_round(peer), in_round(partner)
        if epoch is not None and epoch >= min_epoch and partner_epoch is not None:
            peer.kill()
            return min(epoch, partner_epoch), in_round(peer) == epoch and in_round(partner) == partner_epoch
        if peer.process.poll() is not None:
            break
        time.sleep(0.01)
    raise AssertionError(f"{peer.name} and {partner.name} were in no averaging round >= {min_epoch} together in "
                         f"time:\n{peer.stderr[-3000:]}")
