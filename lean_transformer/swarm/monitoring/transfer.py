"""Progress of a long transfer a person waits on (a newcomer downloading the swarm's state: gigabytes over a home
link can take many minutes, and hivemind says nothing between "downloading" and "downloaded"): how much of the
expected total has arrived, the rate so far and when it should end, as one line at most every few seconds.

The caller counts the bytes and logs the line; the clock is an argument so that the arithmetic is tested without
waiting."""
from __future__ import annotations

import math
import time
from typing import Callable, Optional

MIB = 2**20


class TransferProgress:
    """``update(done_bytes)`` returns a progress line for ``what`` once ``every_seconds`` have passed since the last
    one (or the start), else None. Rate and ETA are the averages since the start."""

    def __init__(self, what: str, total_bytes: int, every_seconds: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.what, self.total_bytes, self.every_seconds, self.clock = what, total_bytes, every_seconds, clock
        self.started = self.last_line = clock()

    def update(self, done_bytes: int) -> Optional[str]:
        now = self.clock()
        if now - self.last_line < self.every_seconds:
            return None
        self.last_line = now
        return self.line(done_bytes, now)

    def line(self, done_bytes: int, now: Optional[float] = None) -> str:
        elapsed = (self.clock() if now is None else now) - self.started
        rate = done_bytes / elapsed if elapsed > 0 else 0.0
        eta = (self.total_bytes - done_bytes) / rate if rate > 0 else math.inf
        share = done_bytes / self.total_bytes if self.total_bytes else 1.0
        eta_text = f"ETA {max(0.0, eta):.0f} s" if math.isfinite(eta) else "ETA unknown"
        return (f"{self.what}: {done_bytes / MIB:.1f} of {self.total_bytes / MIB:.1f} MiB ({share:.0%}), "
                f"{rate / MIB:.2f} MiB/s, {eta_text}")
