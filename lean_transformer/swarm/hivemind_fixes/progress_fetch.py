"""hivemind's progress tracker holds ``lock_global_progress`` for the whole DHT lookup of the swarm's progress
(``ProgressTracker._progress_fetcher``), and the training thread takes that lock at every epoch end
(``Optimizer._update_global_epoch`` runs inside ``tracker.pause_updates()``) and for every state download. The
fetcher looks the records up one lookup after another, so an epoch end waits, on average, for half a lookup and at
worst for a whole one. On loopback a lookup takes milliseconds; across the internet, with dozens of peers, it takes
seconds: benchmarks/internet.py (16 DiLoCo trainers, 20-150 ms round trips, 2 cores), lookups of 7.6 s median
and 21.8 s p90, and each trainer's epoch end stood 4-12 s between its outer step and hivemind's "Transitioning to
epoch" line: 6.5% of its wall time waiting for the swarm.

:class:`FetchesUnlocked`, mixed in front of the tracker, looks the records up without the lock and takes it only to
install what the lookup found. A lookup that began before this peer's epoch changed may count records from before
the change: it updates the swarm's progress as any fetch does (the parse counts only records at the swarm's epoch,
which the new local epoch bounds from below), but does not mark the progress fetched this epoch, which hivemind's
once-per-epoch synchronization check waits for (``fetched_global_progress_this_epoch``): that check reads the next
lookup's records. Reproduced by ``tests/test_progress_fetch.py``. Drop when hivemind fetches outside the lock (not
in 1.1.12, nor in its master, checked 2026-11-30).

DiLoCo's tracker only. In gradient-averaging mode the epoch end holds the lock through the whole all-reduce anyway,
and there tests/test_slow_peer.py failed with the unlocked fetch in 4 of 7 runs beside another swarm test (0 of 6
with hivemind's fetch), and in 2 of 3 again with hivemind's 3 s DHT wait (0 of 5 with the 10 s one): the slow trainer,
one epoch behind and taking its group's label, joined the next round early (``EarlyJoin``) 0.05-0.6 s after its epoch
changed, with no samples, 6-10 s before the others began that round, and missed every other round. The progress it
acted on likely came from a lookup that ran during its all-reduce (hivemind's fetcher waits for the round), not
verified; nor why it read the round as due: left as hivemind's until that is known.
"""
from __future__ import annotations

import asyncio

from hivemind.utils.asyncio import enter_asynchronously
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time


class FetchesUnlocked:
    """Mixed in front of hivemind's ``ProgressTracker``: its fetches hold ``lock_global_progress`` only to install
    the records they found."""

    async def _progress_fetcher(self) -> None:
        loop = asyncio.get_running_loop()
        stopping = asyncio.ensure_future(loop.run_in_executor(None, self.shutdown_triggered.wait))
        try:
            while not self.shutdown_triggered.is_set():
                delay = max(0.0, self.global_progress.next_fetch_time - get_dht_time())
                if await loop.run_in_executor(None, self.global_state_updated.wait, delay):
                    self.global_state_updated.clear()  # the training thread set the progress itself
                    continue
                epoch = self.local_progress.epoch
                lookup = asyncio.ensure_future(self.dht.get(self.training_progress_key, latest=True,
                                                            return_future=True))
                await asyncio.wait({lookup, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if self.shutdown_triggered.is_set():
                    lookup.cancel()
                    break
                found = lookup.result()
                metadata = found.value if isinstance(found, ValueWithExpiration) else None
                async with enter_asynchronously(self.lock_global_progress):
                    self.global_progress = self._parse_swarm_progress_data(metadata)
                    if self.local_progress.epoch == epoch:
                        self.fetched_global_progress_this_epoch.set()
        finally:
            stopping.cancel()  # its thread ends with the shutdown that set the event
