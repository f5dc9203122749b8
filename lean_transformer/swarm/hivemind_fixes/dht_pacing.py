"""A peer asks the swarm's DHT as often as the answers can matter, not as fast as the DHT answers.

What hivemind 1.1.12 does wrong, twice. The two keys involved (a group's matchmaking key, the run's progress key)
are each stored on the same few DHT nodes for the whole swarm, so every peer's requests for them land there, and
at 16 trainers the DHT that everything waits for (progress, matchmaking, state downloads) is flooded by its own
peers:

- **Leader search.** While an averager matchmakes, its search for a leader (``PotentialLeaders.pop_next_leader``)
  asks for a fresh list of the group's averagers whenever it knows no better leader than itself, and the lookup
  loop starts the next ``get`` as soon as the last one answers. The peer that leads its group (the usual case: the
  first to declare) looks the key up back to back for its whole window: 366 lookups per second on loopback
  (``tests/test_dht_pacing.py``), and 8577 in 100 s by one trainer of a pair (matchmaking 3 s), its DHT process
  then busy 13% of the time. Here a search's lookups start at least ``matchmaking_time / LOOKUPS_PER_WINDOW``
  apart. A leader needs no lookups to be found (followers find its declaration), so the cost is that a peer learns
  of a better leader up to that much later, while that leader's declaration has most of its window to live.
- **Progress reports.** The progress tracker stores this peer's record (a signed DHT store) on every
  ``report_local_progress``, i.e. every micro-batch: 5-8 stores per second for a tiny model on one CPU thread. Other
  peers read the records at most every ``min_refresh_period`` (hivemind's default 0.5 s, ours) and extrapolate
  them at the reported speed, so the records in between are overwritten unread. Here a tracker stores at most one
  report per :func:`report_interval`, always the latest: :data:`REPORT_INTERVAL`, longer in a swarm of more than
  :data:`SWARM_REPORTS_PER_SECOND` / 2 peers, whose reports all land on the progress key's few DHT nodes.

Together (2 tiny trainers, 20 epochs, this 2-core box): the trainers' CPU, their DHT and averager processes
included, fell from 128 s to 73 s. Reproduced by ``tests/test_dht_pacing.py``. Drop when hivemind paces its
``_update_queue_periodically`` and its progress reporter (neither in its master, checked 2026-11-29).
"""
from __future__ import annotations

import asyncio
import functools
import math
import threading
import time
from typing import Any, Callable, Coroutine, List, Optional, Tuple

from hivemind.averaging.key_manager import GroupKey, GroupKeyManager
from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import DHTExpiration

LOOKUPS_PER_WINDOW = 4  # at most this many lookups of the group's averagers per matchmaking time, plus the first
REPORT_INTERVAL = 0.5  # seconds between two progress reports of a peer: hivemind's default min_refresh_period
# the whole swarm's reports per second, at most: 6 DiLoCo trainers on loopback stored 4.2 per second with 0.5 s
# reports (their DHT processes 0.04 cores each), while 16 on this box's links waited 12-18 s for a lookup
SWARM_REPORTS_PER_SECOND = 8.0


class PacedLookups:
    """A group key manager whose ``get_averagers`` calls start at least ``interval`` seconds apart; everything else
    is the wrapped manager's."""

    def __init__(self, key_manager: GroupKeyManager, interval: float):
        self._key_manager, self._interval = key_manager, interval
        self._next_start = -math.inf

    def __getattr__(self, name: str) -> Any:
        return getattr(self._key_manager, name)

    async def get_averagers(self, group_key: GroupKey, only_active: bool) -> List[Tuple[PeerID, DHTExpiration]]:
        delay = self._next_start - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        self._next_start = time.monotonic() + self._interval
        return await self._key_manager.get_averagers(group_key, only_active)


def _paced(update_queue: Callable[..., Coroutine]) -> Callable[..., Coroutine]:
    @functools.wraps(update_queue)
    async def update_queue_paced(self: PotentialLeaders, key_manager: GroupKeyManager) -> None:
        return await update_queue(self, PacedLookups(key_manager, self.min_matchmaking_time / LOOKUPS_PER_WINDOW))

    update_queue_paced.paced = True
    return update_queue_paced


def install() -> None:
    """Pace every leader search of this process and of the averager processes it forks later (idempotent)."""
    if not getattr(PotentialLeaders._update_queue_periodically, "paced", False):
        PotentialLeaders._update_queue_periodically = _paced(PotentialLeaders._update_queue_periodically)


class PacedEvent(threading.Event):
    """A ``threading.Event`` whose ``wait`` returns a set flag at most once per ``interval`` seconds: a waiter that
    wakes earlier sleeps out the rest of the interval first (whatever sets the flag meanwhile is the same wake-up)."""

    def __init__(self, interval: float):
        super().__init__()
        self.interval, self._last_wake = interval, -math.inf

    def wait(self, timeout: Optional[float] = None) -> bool:
        if not super().wait(timeout):
            return False
        time.sleep(max(0.0, self._last_wake + self.interval - time.monotonic()))
        self._last_wake = time.monotonic()
        return True


def report_interval(num_peers: int) -> float:
    """Seconds between two progress reports of a peer in a swarm of ``num_peers``: others extrapolate a report at its
    reported speed, so a longer interval costs them little accuracy, while the swarm's reports per second are what
    the progress key's nodes serve."""
    return max(REPORT_INTERVAL, num_peers / SWARM_REPORTS_PER_SECOND)


class PacedReports:
    """Mixed in front of hivemind's ``ProgressTracker``: its reporter wakes for a report at most once per
    :func:`report_interval` of the swarm it last read (it then stores the latest one)."""

    @property
    def should_report_progress(self) -> PacedEvent:
        event = self.__dict__["_paced_report"]
        progress = self.__dict__.get("global_progress")  # hivemind sets it after the event
        event.interval = report_interval(progress.num_peers if progress is not None else 1)
        return event

    @should_report_progress.setter
    def should_report_progress(self, event: threading.Event) -> None:  # hivemind's __init__ sets a plain Event
        self.__dict__["_paced_report"] = PacedEvent(REPORT_INTERVAL)
