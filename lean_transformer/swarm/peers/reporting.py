"""The trainer's metrics record, built once per epoch: this epoch's work, the epochs before it (so that an aux peer
that refreshes less often than the epochs change misses none of them), and what the aux peer's table of contributors
shows about this peer (client mode, peer ID, the share of its epochs in which it averaged with others)."""
from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Deque, Optional

from lean_transformer.swarm.monitoring.events import EventReader
from lean_transformer.swarm.protocol.metrics import HISTORY_LENGTH, LocalMetrics, PastEpoch

# the rounds that make an epoch's (or DiLoCo outer round's) update: see lean_transformer.swarm.averaging.round_events
_UPDATE_ROUNDS = ("gradients", "outer")


class MetricsReporter:
    """Counts the epochs this peer trained in and those in which it averaged with at least one other peer. The
    averagers run in their own processes and report rounds as ``averaged`` events in this peer's event stream
    (``events_path``), which the reporter reads as it grows; without a stream the counts stay unknown (``None``)."""

    def __init__(self, peer_id: str, client_mode: bool, events_path: Optional[Path] = None):
        self.peer_id, self.client_mode = peer_id, client_mode
        self._history: Deque[PastEpoch] = deque(maxlen=HISTORY_LENGTH)
        self._events = EventReader(events_path) if events_path is not None else None
        if self._events is not None:
            list(self._events.new())  # earlier runs' rounds are not this run's
        self.rounds_attempted = self.rounds_averaged = 0

    def record(self, epoch: int, samples_per_second: float, samples: int, loss_sum: float,
               mini_steps: int) -> LocalMetrics:
        """The record of reaching ``epoch`` after this work; call once per epoch, in order."""
        counts = {}
        if self._events is not None:
            # a round's event may land just after the epoch it belongs to: counted then, never above the epochs
            averaged = sum(event.get("kind") in _UPDATE_ROUNDS and (event.get("group_size") or 0) >= 2
                           for event in self._events.new("averaged"))
            self.rounds_attempted += 1
            self.rounds_averaged = min(self.rounds_attempted, self.rounds_averaged + averaged)
            counts = dict(rounds_attempted=self.rounds_attempted, rounds_averaged=self.rounds_averaged)
        while self._history and self._history[-1][0] >= epoch:  # restored from a backup of an earlier epoch
            self._history.pop()
        metrics = LocalMetrics(epoch=epoch, samples_per_second=samples_per_second, samples_accumulated=samples,
                               loss_sum=loss_sum, mini_steps=mini_steps, history=tuple(self._history),
                               client_mode=self.client_mode, peer_id=self.peer_id, **counts)
        self._history.append((epoch, samples, loss_sum, mini_steps, samples_per_second))
        return metrics
