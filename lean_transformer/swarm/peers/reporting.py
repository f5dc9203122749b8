"""The trainer's metrics record, built once per epoch: this epoch's work, the epochs before it (so that an aux peer
that refreshes less often than the epochs change misses none of them), and what the aux peer's table of contributors
shows about this peer (client mode, peer ID, the share of its epochs in which it averaged with others)."""
from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Deque, Dict, Optional

from lean_transformer.swarm.monitoring.events import EventReader
from lean_transformer.swarm.protocol.metrics import HISTORY_LENGTH, MAX_EXCLUDED, LocalMetrics, PastEpoch

# the rounds that make an epoch's (or DiLoCo outer round's) update: see lean_transformer.swarm.averaging.round_events
_UPDATE_ROUNDS = ("gradients", "outer")


class MetricsReporter:
    """Counts the epochs this peer trained in and those in which it averaged with at least one other peer. The
    averagers run in their own processes and report rounds as ``averaged`` events in this peer's event stream
    (``events_path``), which the reporter reads as it grows; without a stream the counts stay unknown (``None``).
    The peers they exclude (``peer_excluded`` events, until their ``until``) go in the record's ``excluded``."""

    def __init__(self, peer_id: str, client_mode: bool, events_path: Optional[Path] = None):
        self.peer_id, self.client_mode = peer_id, client_mode
        self._history: Deque[PastEpoch] = deque(maxlen=HISTORY_LENGTH)
        self._events = EventReader(events_path) if events_path is not None else None
        if self._events is not None:
            list(self._events.new())  # earlier runs' rounds are not this run's
        self.rounds_attempted = self.rounds_averaged = 0
        self._excluded: Dict[str, float] = {}  # peer ID -> until (Unix time)

    def joined(self, epoch: int) -> LocalMetrics:
        """The record of joining the swarm at ``epoch``, before any work (``LocalMetrics.joined``)."""
        counts = {} if self._events is None else dict(rounds_attempted=0, rounds_averaged=0, excluded=())
        return LocalMetrics(epoch=epoch, samples_per_second=0.0, samples_accumulated=0, loss_sum=0.0, mini_steps=0,
                            client_mode=self.client_mode, peer_id=self.peer_id, joined=True, **counts)

    def record(self, epoch: int, samples_per_second: float, samples: int, loss_sum: float,
               mini_steps: int) -> LocalMetrics:
        """The record of reaching ``epoch`` after this work; call once per epoch, in order."""
        counts = {}
        if self._events is not None:
            # a round's event may land just after the epoch it belongs to: counted then, never above the epochs
            events = list(self._events.new())
            averaged = sum(event["event"] == "averaged" and event.get("kind") in _UPDATE_ROUNDS
                           and (event.get("group_size") or 0) >= 2 for event in events)
            self.rounds_attempted += 1
            self.rounds_averaged = min(self.rounds_attempted, self.rounds_averaged + averaged)
            counts = dict(rounds_attempted=self.rounds_attempted, rounds_averaged=self.rounds_averaged,
                          excluded=self._excluded_now(events))
        while self._history and self._history[-1][0] >= epoch:  # restored from a backup of an earlier epoch
            self._history.pop()
        metrics = LocalMetrics(epoch=epoch, samples_per_second=samples_per_second, samples_accumulated=samples,
                               loss_sum=loss_sum, mini_steps=mini_steps, history=tuple(self._history),
                               client_mode=self.client_mode, peer_id=self.peer_id, **counts)
        self._history.append((epoch, samples, loss_sum, mini_steps, samples_per_second))
        return metrics

    @property
    def excluded(self) -> Dict[str, float]:
        """The peers this peer's averagers exclude now, as of the last record: peer ID -> Unix time it ends."""
        return dict(self._excluded)

    def _excluded_now(self, events: list) -> tuple:
        for event in events:
            if event["event"] == "peer_excluded" and isinstance(event.get("source"), str):
                self._excluded[event["source"]] = max(self._excluded.get(event["source"], 0.0),
                                                      float(event.get("until") or 0.0))
        now = time.time()
        self._excluded = {peer_id: until for peer_id, until in self._excluded.items() if until > now}
        return tuple(sorted(self._excluded, key=self._excluded.get, reverse=True)[:MAX_EXCLUDED])
