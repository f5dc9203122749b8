"""A progress tracker's lookups of the swarm's records, slow as across the internet, and the training thread's epoch
end (lean_transformer.swarm.hivemind_fixes.progress_fetch), on a real DHT in its own process: hivemind's tracker
holds its lock for the whole lookup, so ``pause_updates`` (every epoch end) waits for it; ours takes the lock only
to install what the lookup found, and a lookup that began before the epoch changed does not count as this epoch's
fetch."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import hivemind
import pytest
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils.crypto import RSAPrivateKey

from lean_transformer.swarm.hivemind_fixes.progress_fetch import FetchesUnlocked
from lean_transformer.swarm.peers.processes import wait_until

LOOKUP = 3.0  # seconds each of the tracker's lookups takes


class SlowLookups:
    """``dht`` whose lookups by future (the tracker's fetches) answer ``LOOKUP`` s late; ``started``: how many
    began."""

    def __init__(self, dht: hivemind.DHT):
        self._dht, self.started = dht, 0

    def get(self, *args: Any, return_future: bool = False, **kwargs: Any) -> Any:
        if not return_future:  # the tracker's constructor
            return self._dht.get(*args, **kwargs)

        async def late() -> Any:
            self.started += 1
            await asyncio.sleep(LOOKUP)
            return await self._dht.get(*args, return_future=True, **kwargs)

        return late()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dht, name)


class Ours(FetchesUnlocked, ProgressTracker):
    pass


@pytest.fixture(scope="module")
def dht():
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield dht
    dht.shutdown()


def tracker_on(dht: hivemind.DHT, tracker_class: type) -> tuple[ProgressTracker, SlowLookups]:
    lookups = SlowLookups(dht)
    tracker = tracker_class(lookups, tracker_class.__name__, 10 ** 6, min_refresh_period=0.1, max_refresh_period=0.2,
                            default_refresh_period=0.2, private_key=RSAPrivateKey(), start=True)
    return tracker, lookups


def seconds_to_pause(dht: hivemind.DHT, tracker_class: type) -> float:
    """How long the training thread's ``pause_updates`` waits when it comes just after a lookup began."""
    tracker, lookups = tracker_on(dht, tracker_class)
    try:
        wait_until(lambda: lookups.started >= 1, 10, "the tracker's first lookup", interval=0.01)
        started = time.monotonic()
        with tracker.pause_updates():
            return time.monotonic() - started
    finally:
        tracker.shutdown(timeout=LOOKUP + 5)


def test_an_epoch_end_does_not_wait_for_a_lookup_in_flight(dht):
    assert seconds_to_pause(dht, ProgressTracker) > LOOKUP / 2  # hivemind's: the rest of the lookup
    assert seconds_to_pause(dht, Ours) < LOOKUP / 6


def test_a_lookup_begun_before_the_epoch_changed_is_not_this_epochs_fetch(dht):
    tracker, lookups = tracker_on(dht, Ours)
    try:
        wait_until(lambda: tracker.fetched_global_progress_this_epoch.is_set(), LOOKUP + 10, "a fetch at epoch 0",
                   interval=0.01)
        wait_until(lambda: lookups.started >= 2, 10, "the next lookup", interval=0.01)
        with tracker.pause_updates():
            tracker.update_epoch(1)  # clears the flag, as hivemind's epoch update does
        wait_until(lambda: lookups.started >= 3, LOOKUP + 10, "the lookup after", interval=0.01)
        # the second lookup, begun at epoch 0, has been installed (lookups run one after the other)
        assert not tracker.fetched_global_progress_this_epoch.is_set()
        assert tracker.global_progress.epoch == 1
        wait_until(lambda: tracker.fetched_global_progress_this_epoch.is_set(), LOOKUP + 10, "a fetch at epoch 1",
                   interval=0.01)
    finally:
        tracker.shutdown(timeout=LOOKUP + 5)
