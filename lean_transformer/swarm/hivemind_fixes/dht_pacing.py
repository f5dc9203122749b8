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
  :data:`SWARM_REPORTS_PER_SECOND` / 2 peers, whose reports all land on the progress key's few DHT nodes. The
  report of a new epoch goes out at once (one per peer and epoch): its record carries the work of the epoch just
  finished, which the aux peer counts, and a peer killed seconds after an epoch's end lost it (16 trainers: 2.1 s
  between reports; an aux row counted 15 of 16 trainers, one killed 3 s after it reached the epoch).
- **Progress lookups.** The tracker looks the swarm's records up again after hivemind's estimate of the time to the
  next epoch, clipped to [``min_refresh_period``, ``max_refresh_period``]: with epochs of a few seconds, every
  ``min_refresh_period`` (0.5 s). Every lookup lands on the progress key's few nodes and each answer carries every
  peer's record, so the key's nodes serve peers^2 records per refresh. Here a tracker looks up at most once per
  :func:`fetch_interval` in a swarm of more than :data:`SWARM_FETCHES_PER_SECOND` / 2 peers; between lookups
  hivemind extrapolates the records at each peer's reported speed, as it does between any two lookups. (This alone
  did not rescue 24 DiLoCo trainers on this 2-core box, whose lookups took 23-25 s at the median either way: there
  the box's CPU ran out, see :mod:`.dht_beam`.)

Together (2 tiny trainers, 20 epochs, this 2-core box): the trainers' CPU, their DHT and averager processes
included, fell from 128 s to 73 s. Reproduced by ``tests/test_dht_pacing.py``. Drop when hivemind paces its
``_update_queue_periodically``, its progress reporter and its fetcher (none in its master, checked 2026-11-29).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import threading
import time
from typing import Any, Callable, Coroutine, List, Optional, Tuple

from hivemind.averaging.key_manager import GroupKey, GroupKeyManager
from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import DHTExpiration, get_dht_time

LOOKUPS_PER_WINDOW = 4  # at most this many lookups of the group's averagers per matchmaking time, plus the first
REPORT_INTERVAL = 0.5  # seconds between two progress reports of a peer: hivemind's default min_refresh_period
# the whole swarm's reports per second, at most: 6 DiLoCo trainers on loopback stored 4.2 per second with 0.5 s
# reports (their DHT processes 0.04 cores each), while 16 on this box's links waited 12-18 s for a lookup
SWARM_REPORTS_PER_SECOND = 8.0
# the whole swarm's progress lookups per second, at most: the same nodes serve them (each answer holds every record)
SWARM_FETCHES_PER_SECOND = 8.0


class PacedLookups:
    """A group key manager whose ``get_averagers`` calls start at least ``interval`` seconds apart (unless the
    wrapped manager's paces its own lookups: ``paces_lookups``); everything else is the wrapped manager's."""

    def __init__(self, key_manager: GroupKeyManager, interval: float):
        self._key_manager, self._interval = key_manager, interval
        self._next_start = -math.inf

    def __getattr__(self, name: str) -> Any:
        return getattr(self._key_manager, name)

    async def get_averagers(self, group_key: GroupKey, only_active: bool) -> List[Tuple[PeerID, DHTExpiration]]:
        if getattr(self._key_manager.get_averagers, "paces_lookups", False):  # averaging.direct_declarations'
            return await self._key_manager.get_averagers(group_key, only_active)
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
    wakes earlier sleeps out the rest of the interval first (whatever sets the flag meanwhile is the same wake-up),
    unless :meth:`set_now` cuts that short."""

    def __init__(self, interval: float):
        super().__init__()
        self.interval, self._last_wake = interval, -math.inf
        self._now = threading.Event()

    def set_now(self) -> None:
        """Set the flag, and let the waiter return without sleeping out the interval."""
        self._now.set()
        self.set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        if not super().wait(timeout):
            return False
        self._now.wait(max(0.0, self._last_wake + self.interval - time.monotonic()))
        self._now.clear()
        self._last_wake = time.monotonic()
        return True


def report_interval(num_peers: int) -> float:
    """Seconds between two progress reports of a peer in a swarm of ``num_peers``: others extrapolate a report at its
    reported speed, so a longer interval costs them little accuracy, while the swarm's reports per second are what
    the progress key's nodes serve."""
    return max(REPORT_INTERVAL, num_peers / SWARM_REPORTS_PER_SECOND)


class PacedReports:
    """Mixed in front of hivemind's ``ProgressTracker``: its reporter wakes for a report at most once per
    :func:`report_interval` of the swarm it last read (it then stores the latest one), and at once for a new
    epoch."""

    def update_epoch(self, new_epoch: Optional[int] = None) -> int:
        epoch = super().update_epoch(new_epoch)  # hivemind's reports the new epoch (sets the flag)
        self.__dict__["_paced_report"].set_now()
        return epoch

    @property
    def should_report_progress(self) -> PacedEvent:
        event = self.__dict__["_paced_report"]
        progress = self.__dict__.get("global_progress")  # hivemind sets it after the event
        event.interval = report_interval(progress.num_peers if progress is not None else 1)
        return event

    @should_report_progress.setter
    def should_report_progress(self, event: threading.Event) -> None:  # hivemind's __init__ sets a plain Event
        self.__dict__["_paced_report"] = PacedEvent(REPORT_INTERVAL)


def fetch_interval(num_peers: int, min_refresh_period: float) -> float:
    """Seconds between two progress lookups of a peer in a swarm of ``num_peers``, at least: hivemind's
    ``min_refresh_period``, longer once the swarm's lookups would exceed :data:`SWARM_FETCHES_PER_SECOND`."""
    return max(min_refresh_period, num_peers / SWARM_FETCHES_PER_SECOND)


class PacedFetches:
    """Mixed in front of hivemind's ``ProgressTracker``: the next lookup of the swarm's records comes at least one
    :func:`fetch_interval` of the swarm just read after this one (hivemind's own schedule when that is later)."""

    def _parse_swarm_progress_data(self, metadata: Any) -> Any:
        progress = super()._parse_swarm_progress_data(metadata)
        earliest = get_dht_time() + fetch_interval(progress.num_peers, self.min_refresh_period)
        return dataclasses.replace(progress, next_fetch_time=max(progress.next_fetch_time, earliest))
