"""How often a peer asks the swarm's DHT (lean_transformer.swarm.hivemind_fixes.dht_pacing), on a real DHT in its
own process. The leader search of a matchmaking peer: hivemind's own loop looks the group key up back to back for
the whole window, ours a few times per window, and ours still finds a better leader that declares meanwhile. The
progress reports: hivemind stores one per micro-batch, ours at most one per REPORT_INTERVAL, the latest, and the
report of a new epoch at once."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from typing import Iterator, Optional

import hivemind
import pytest
from hivemind.averaging.control import StepControl
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.timed_storage import get_dht_time

from lean_transformer.swarm.hivemind_fixes import dht_pacing
from lean_transformer.swarm.hivemind_fixes.dht_pacing import (LOOKUPS_PER_WINDOW, REPORT_INTERVAL,
                                                               SWARM_FETCHES_PER_SECOND, SWARM_REPORTS_PER_SECOND,
                                                               PacedFetches, PacedReports)
from lean_transformer.swarm.peers.processes import wait_until

WINDOW = 2.0  # the matchmaking time, seconds
# every tracker of this module signs its records with this key: a DHT keeps the first signature validator it is given
# (hivemind's RSASignatureValidator.merge_with), so a tracker with another key would have its records refused
PRIVATE_KEY = RSAPrivateKey()


class HivemindLeaders(PotentialLeaders):
    """hivemind's own search, without the fix that importing lean_transformer.swarm installs."""

    _update_queue_periodically = PotentialLeaders._update_queue_periodically.__wrapped__


@pytest.fixture(scope="module")
def dht():
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield dht
    dht.shutdown()


def search(dht: hivemind.DHT, leaders_class: type, prefix: str, rival: Optional[PeerID] = None
           ) -> tuple[list[float], Optional[PeerID], float]:
    """One peer's leader search for one window: the start times of its lookups of the group key, the leader it
    found (None: none), and when. ``rival``: a peer declared 0.5 s into the search, expiring before this one."""
    async def run() -> tuple[list[float], Optional[PeerID], float]:
        key_manager = GroupKeyManager(dht, prefix, initial_group_bits="", target_group_size=None)
        lookups, get_averagers = [], key_manager.get_averagers

        async def counted(*args, **kwargs):
            lookups.append(time.monotonic())
            return await get_averagers(*args, **kwargs)

        key_manager.get_averagers = counted
        leaders = leaders_class(dht.peer_id, min_matchmaking_time=WINDOW, target_group_size=None)
        step = StepControl(scheduled_time=get_dht_time() + WINDOW, deadline=get_dht_time() + WINDOW,
                           allow_retries=False, weight=1.0, data_for_gather=b"")
        step.attach(MPFuture(), MPFuture())
        started, leader = time.monotonic(), None
        async with leaders.begin_search(step, key_manager):
            if rival is not None:
                await asyncio.sleep(0.5)
                await key_manager.declare_averager(key_manager.current_key, rival, get_dht_time() + WINDOW / 2)
            while leader is None and time.monotonic() < started + WINDOW:
                # as hivemind's matchmaking: a TimeoutError means "declared again", and the search goes on
                with contextlib.suppress(asyncio.TimeoutError):
                    leader = await asyncio.wait_for(leaders.pop_next_leader(), started + WINDOW - time.monotonic())
        step.allow_allreduce()  # the step is done with (hivemind warns about an untriggered one)
        return [at - started for at in lookups], leader, time.monotonic() - started

    return asyncio.run(run())


def test_a_lone_peer_looks_the_group_up_a_few_times_per_window(dht):
    hivemind_lookups, _, _ = search(dht, HivemindLeaders, "hivemind_alone")
    ours, leader, _ = search(dht, PotentialLeaders, "ours_alone")
    assert leader is None
    assert len(hivemind_lookups) > 10 * (LOOKUPS_PER_WINDOW + 1)  # hundreds per second on loopback (733 in 2 s)
    assert len(ours) <= LOOKUPS_PER_WINDOW + 1
    gaps = [later - earlier for earlier, later in zip(ours, ours[1:])]
    assert gaps and min(gaps) >= WINDOW / LOOKUPS_PER_WINDOW - 0.01


def test_a_better_leader_declared_meanwhile_is_found_within_one_interval(dht):
    rival = PeerID.from_base58("QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN")
    _, leader, found_at = search(dht, PotentialLeaders, "ours_rival", rival)
    assert leader == rival
    # declared at 0.5 s: the next lookup starts at most one interval later, and a lookup takes well under a second
    assert found_at < 0.5 + WINDOW / LOOKUPS_PER_WINDOW + 1.0


class PacedTracker(PacedReports, PacedFetches, ProgressTracker):
    """hivemind's progress tracker with our paced reports and lookups (as the swarm optimizer's trackers have them)."""


class FakeSwarm(ProgressTracker):
    """hivemind's progress tracker that reads ``FakeSwarm.peers`` peers in the swarm, whatever its DHT holds."""

    peers = 1

    def _parse_swarm_progress_data(self, metadata):
        return dataclasses.replace(super()._parse_swarm_progress_data(metadata), num_peers=self.peers)


class SwarmOf(PacedReports, PacedFetches, FakeSwarm):
    """A paced tracker that reads ``FakeSwarm.peers`` peers in the swarm."""


@contextlib.contextmanager
def progress_calls(dht: hivemind.DHT, method: str, tracker: ProgressTracker) -> Iterator[list]:
    """The calls of ``dht.<method>`` (``store`` or ``get``) for ``tracker``'s progress key while inside: each as
    (time.monotonic(), its keyword arguments)."""
    calls, original = [], getattr(dht, method)

    def recorded(*args, **kwargs):
        if kwargs.get("key", args[0] if args else None) == tracker.training_progress_key:
            calls.append((time.monotonic(), kwargs))
        return original(*args, **kwargs)

    setattr(dht, method, recorded)
    try:
        yield calls
    finally:
        delattr(dht, method)


def stores_while_reporting(dht: hivemind.DHT, tracker_class: type, seconds: float = 2.0, last_lands: bool = False
                           ) -> tuple[int, int]:
    """A tracker's progress stores while its peer reports 8 more samples every 10 ms (a fast micro-batch) for
    ``seconds``, and the samples reported. ``last_lands``: also wait until the DHT holds the last report (hivemind's
    own tracker, its stores queued in the DHT's process, had not stored it 6 s later)."""
    tracker = tracker_class(dht, tracker_class.__name__, 10 ** 6, private_key=PRIVATE_KEY, start=True)
    try:
        with progress_calls(dht, "store", tracker) as stores:
            samples, started = 0, time.monotonic()
            while time.monotonic() < started + seconds:
                samples += 8
                tracker.report_local_progress(0, samples)
                time.sleep(0.01)
        count = len([at for at, _ in stores if at <= started + seconds])

        def recorded() -> Optional[int]:
            entry = dht.get(tracker.training_progress_key, latest=True)
            records = entry.value.values() if entry is not None else ()
            return max((record.value["samples_accumulated"] for record in records), default=None)

        if last_lands:
            wait_until(lambda: recorded() == samples, 2 * REPORT_INTERVAL + 5, "the last report in the DHT",
                       interval=0.1)
        return count, samples
    finally:
        tracker.shutdown()


def test_progress_is_stored_at_most_once_per_interval_and_the_last_report_lands(dht):
    ours, _ = stores_while_reporting(dht, PacedTracker, last_lands=True)  # first: hivemind's stores queue up
    hivemind_stores, samples = stores_while_reporting(dht, ProgressTracker)
    assert hivemind_stores > samples / 8 / 4  # one store per report (of 8 samples) on this box
    assert ours <= 2.0 / REPORT_INTERVAL + 1


def test_a_peer_of_a_large_swarm_reports_less_often(dht):
    """The swarm's reports all land on the progress key's few nodes: in a swarm of 32 a peer reports every 4 s."""
    FakeSwarm.peers = 4 * SWARM_REPORTS_PER_SECOND
    large, _ = stores_while_reporting(dht, SwarmOf, seconds=4.0)
    FakeSwarm.peers = 1
    small, _ = stores_while_reporting(dht, SwarmOf, seconds=4.0)
    assert large <= 4.0 / 4.0 + 1  # one report per 4 s, and the first
    assert small >= 4.0 / REPORT_INTERVAL / 2, small  # one per 0.5 s (8), with room for a slow box


def lookups_at_epoch_end(dht: hivemind.DHT, tracker_class: type, seconds: float = 4.0) -> int:
    """A tracker's lookups of the swarm's progress in ``seconds`` while the records show the epoch's target reached
    (hivemind's estimate of the time to the next epoch is then 0: it looks up every ``min_refresh_period``)."""
    prefix = f"{tracker_class.__name__}{FakeSwarm.peers}"
    tracker = tracker_class(dht, prefix, target_batch_size=8, private_key=PRIVATE_KEY, start=True)
    try:
        get = dht.get  # not counted
        with progress_calls(dht, "get", tracker) as lookups:
            tracker.report_local_progress(0, 16)
            wait_until(lambda: get(tracker.training_progress_key, latest=True) is not None, 10.0,
                       "the record stored", interval=0.05)
            landed = time.monotonic()  # the tracker's next lookup reads the record (until then it finds none: 3 s)
            wait_until(lambda: any(at > landed for at, _ in lookups), 10.0, "a lookup of the record", interval=0.05)
            started = time.monotonic()
            time.sleep(seconds)
        return len([at for at, _ in lookups if at > started])
    finally:
        tracker.shutdown()


def test_a_peer_of_a_large_swarm_looks_the_progress_up_less_often(dht):
    """Every lookup lands on the progress key's few nodes and its answer holds every peer's record: in a swarm of 32
    a peer looks up every 4 s, in a small one as hivemind does (every min_refresh_period, 0.5 s, near an epoch's
    end)."""
    FakeSwarm.peers = 4 * SWARM_FETCHES_PER_SECOND
    hivemind_large = lookups_at_epoch_end(dht, FakeSwarm)
    large = lookups_at_epoch_end(dht, SwarmOf)
    FakeSwarm.peers = 1
    small = lookups_at_epoch_end(dht, SwarmOf)
    assert hivemind_large >= 4.0 / 0.5 / 2, hivemind_large
    assert large <= 4.0 / 4.0 + 1, large  # the lookup that read the record came just before the window
    assert small >= 4.0 / 0.5 / 2, small




class WithoutEpochWake(PacedTracker):
    """The paced tracker without its wake-up for a new epoch (the control)."""

    def update_epoch(self, new_epoch: Optional[int] = None) -> int:
        return ProgressTracker.update_epoch(self, new_epoch)


def seconds_to_store_a_new_epoch(dht: hivemind.DHT, tracker_class: type) -> float:
    """Seconds from a new epoch, 0.3 s after a stored report (reports at most 4 s apart, as in a swarm of 32), to the
    store of its record."""
    tracker = tracker_class(dht, f"{tracker_class.__name__}_epoch", 10 ** 6, private_key=PRIVATE_KEY, start=True)
    paced = tracker.__dict__["_paced_report"]
    try:
        with progress_calls(dht, "store", tracker) as stores:
            # the reporter's start-up store is not paced (hivemind's reporter wakes by its timeout, and may clear a
            # flag set meanwhile), so the interval runs from the first store the flag wakes it for: the epoch changed
            # before that store went out rode along in it, unpaced (CI: the control stored it 0.04 s after the change)
            def paced_report_out() -> bool:
                if math.isfinite(paced._last_wake) and any(at >= paced._last_wake for at, _ in stores):
                    return True
                tracker.report_local_progress(0, 8)  # (again) until the reporter wakes for it
                return False

            wait_until(paced_report_out, 10.0, "the first paced report", interval=0.05)
            time.sleep(0.3)
            with tracker.pause_updates():
                tracker.update_epoch(1)
            began = time.monotonic()
            assert began < paced._last_wake + 1.0, "the epoch changed too late to tell the control from the fix"

            def new_epoch_stored() -> Optional[float]:
                return next((at for at, call in stores if call["value"]["epoch"] == 1), None)

            wait_until(lambda: new_epoch_stored() is not None, 10.0, "the report of the new epoch", interval=0.01)
        return new_epoch_stored() - began
    finally:
        tracker.shutdown()


def test_a_new_epoch_is_reported_at_once(dht, monkeypatch):
    """A record of a new epoch carries the work of the epoch just finished: the aux peer counts it, and a peer killed
    seconds after an epoch's end took it along unreported while it waited out the report interval. The report
    interval is 4 s here (a swarm of 32), and the tracker looks nothing up after its first lookup: an epoch end waits
    for a lookup in flight (hivemind's lock), and a slow one on a loaded box (CI) let the control's interval run out
    before the epoch changed."""
    monkeypatch.setattr(dht_pacing, "report_interval", lambda num_peers: 4.0)
    monkeypatch.setattr(dht_pacing, "fetch_interval", lambda num_peers, min_refresh_period: 60.0)
    control = seconds_to_store_a_new_epoch(dht, WithoutEpochWake)
    ours = seconds_to_store_a_new_epoch(dht, PacedTracker)
    assert control > 2.0, control  # the rest of the 4 s interval
    assert ours < 1.0, ours
