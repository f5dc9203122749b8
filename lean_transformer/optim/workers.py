"""Runs per-tile optimizer kernels on worker threads.

The kernels are compiled with numba and release the GIL, so plain Python threads run them in parallel. Each
worker takes the next tile whenever it is free: on a busy machine (other processes, data loaders, hivemind's
threads) a descheduled worker delays only its own tile, not every operation as an OpenMP barrier would. A tile's
result does not depend on which thread computes it, so the step does not depend on the number of threads.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import numpy as np
import torch


class TileWorkers:
    """``run(fn, items)`` calls ``fn`` on every item, on as many threads as the caller's torch thread count."""

    def __init__(self):
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
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool, self._pool_size = ThreadPoolExecutor(num_threads, thread_name_prefix="lamb8bit"), num_threads
            weakref.finalize(self, self._pool.shutdown, wait=False)
        pending, lock = iter(items), threading.Lock()

        def drain() -> None:  # each worker takes the next item whenever it is free
            while True:
                with lock:
                    item = next(pending, None)
                if item is None:
                    return
                fn(item)

        for future in [self._pool.submit(drain) for _ in range(num_threads)]:
            future.result()  # re-raises a worker's exception here

    def buffer(self, size: int) -> np.ndarray:
        """The calling thread's own float32 scratch array of at least ``size`` elements (kept for reuse)."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or buffer.size < size:
            buffer = self._local.buffer = np.empty(size, np.float32)
        return buffer
