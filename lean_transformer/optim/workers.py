"""Runs per-tile optimizer work on single-threaded worker threads.

A quantized step is ~25 elementwise torch ops per tile. Letting each op fork/join its own OpenMP team costs a
barrier per op, and on a busy machine (other processes, data loaders, hivemind's threads) a barrier waits
for whichever core was descheduled. Instead each worker runs whole tiles with intra-op parallelism off (torch
ops release the GIL, and ``torch.set_num_threads`` is per thread), so workers never wait for each other
inside a tile, and the per-tile result does not depend on how many workers there are.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import torch


def _make_single_threaded(started: threading.Barrier) -> None:
    torch.get_num_threads()  # let torch initialize this thread's OpenMP settings first, so that they stick
    torch.set_num_threads(1)
    started.wait()


class TileWorkers:
    """``run(fn, items)`` calls ``fn`` on every item using as many threads as the caller's torch thread count."""

    def __init__(self, num_buffers: int):
        self.num_buffers = num_buffers
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    def run(self, fn: Callable[[int], None], items: Iterable[int]) -> None:
        num_threads = torch.get_num_threads()
        if num_threads == 1:
            for item in items:
                fn(item)
            return
        if self._pool_size != num_threads:
            self._start_pool(num_threads)
        grad_enabled = torch.is_grad_enabled()  # grad mode is per thread: carry the caller's over
        pending, lock = iter(items), threading.Lock()

        def drain() -> None:  # each worker takes the next item whenever it is free: no straggler waits for work
            with torch.set_grad_enabled(grad_enabled):
                while True:
                    with lock:
                        item = next(pending, None)
                    if item is None:
                        return
                    fn(item)

        for future in [self._pool.submit(drain) for _ in range(num_threads)]:
            future.result()  # re-raises a worker's exception here

    def buffers(self, size: int) -> list[torch.Tensor]:
        """The calling thread's own float32 scratch buffers, of at least ``size`` elements (kept for reuse)."""
        buffers = getattr(self._local, "buffers", [])
        if not buffers or buffers[0].numel() < size:
            buffers = self._local.buffers = [torch.empty(size) for _ in range(self.num_buffers)]
        return buffers

    def _start_pool(self, num_threads: int) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        started = threading.Barrier(num_threads + 1)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="lamb8bit")
        weakref.finalize(self, self._pool.shutdown, wait=False)
        for _ in range(num_threads):  # each blocks until all have started, so every worker gets one
            self._pool.submit(_make_single_threaded, started)
        started.wait()
        # torch.set_num_threads also sets the default that threads started later pick up: restore the caller's
        torch.set_num_threads(num_threads)
        self._pool_size = num_threads
