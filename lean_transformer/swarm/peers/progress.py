"""A progress line every few seconds that a person can follow: the swarm's epoch, the samples accumulated toward
the target batch and when the epoch should end, this peer's loss and speed (samples/s as hivemind measures it, and
tokens/s since the last line), the number of peers and, on a GPU, the peak GPU memory so far; then the samples this
peer has computed and its compute utilization: the fraction of the training loop's wall time spent in forward,
backward and inner optimizer steps (the rest is waiting for the swarm: averaging, matchmaking, state downloads), with
the compute and wall seconds behind it and the mean loss of the micro-batches trained on so far (cumulative since the
loop started, so that a benchmark can take the difference of two lines: compute utilization, samples and mean loss
over any window). Each progress event also names the peers whose training-progress records this peer's last DHT
fetch saw (``visible``): which peer sees which is how a benchmark tells one DHT from a split one.

Where the rest of the wall time goes, so that a benchmark on a shared box can tell the swarm's cost from the box's
(issue 23): ``waiting_seconds``, the time inside ``waiting()`` (state downloads; DiLoCo's outer rounds; in
gradient-averaging mode the epoch's all-reduce and the optimizer step that follows it), and
``compute_cpu_seconds``, the training thread's CPU time inside ``computing()``. With one torch thread, the compute
seconds it did not run were seconds the box gave to other processes."""
from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import hivemind
import torch
from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from lean_transformer.swarm.monitoring.events import emit

logger = logging.getLogger(__name__)


class ProgressLine:
    """Logs ``format_progress`` at most every ``every_seconds`` (checked by the training loop once per local step);
    ``count_tokens`` after each micro-batch feeds its tokens/s and sample count, and the training loop wraps its
    forward, backward and inner optimizer steps in ``computing()`` (time inside ``waiting()`` within it, e.g. an
    outer all-reduce inside a DiLoCo step, is not compute) and reports the losses of the micro-batches it trains on
    with ``count_losses``. Wall time counts from construction, or from ``start_clock()`` (a trainer builds this line
    before its optimizer, whose outer rounds and downloads wait in ``waiting()``, and starts it with the loop)."""

    def __init__(self, every_seconds: float, device: Optional[torch.device] = None):
        self.every_seconds, self.device = every_seconds, device
        self.last_report = self.started = time.monotonic()
        self.tokens = self.samples = 0
        self.compute_seconds = self.compute_cpu_seconds = self.waiting_seconds = 0.0
        self.loss_sum, self.losses = 0.0, 0
        self._computing_since: Optional[float] = None  # inside computing() and not inside waiting()
        self._computing_cpu_since = 0.0  # the training thread's CPU time then
        self._waiting_since: Optional[float] = None  # inside waiting()

    def start_clock(self) -> None:
        """Wall time counts from now, and so does the time waiting (a joining peer's download is before)."""
        self.last_report = self.started = time.monotonic()
        self.waiting_seconds = 0.0

    def count_tokens(self, tokens: int, samples: int = 0) -> None:
        self.tokens += tokens
        self.samples += samples

    def count_losses(self, losses: Sequence[float]) -> None:
        self.loss_sum += sum(losses)
        self.losses += len(losses)

    @contextmanager
    def computing(self) -> Iterator[None]:
        if self._computing_since is not None or self._waiting_since is not None:  # nested: the outer block counts
            yield
            return
        self._start_computing()
        try:
            yield
        finally:
            self._stop_computing()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Time inside is waiting for the swarm (``waiting_seconds``), not compute, also within ``computing()``."""
        if self._waiting_since is not None:  # nested: the outer block counts
            yield
            return
        computing = self._computing_since is not None
        if computing:
            self._stop_computing()
        self._waiting_since = time.monotonic()
        try:
            yield
        finally:
            self.waiting_seconds += time.monotonic() - self._waiting_since
            self._waiting_since = None
            if computing:
                self._start_computing()

    def _start_computing(self) -> None:
        self._computing_since, self._computing_cpu_since = time.monotonic(), time.thread_time()

    def _stop_computing(self) -> None:
        self.compute_seconds += time.monotonic() - self._computing_since
        self.compute_cpu_seconds += time.thread_time() - self._computing_cpu_since
        self._computing_since = None

    def wall_seconds(self) -> float:
        """Seconds since construction."""
        return time.monotonic() - self.started

    def utilization(self) -> float:
        """Compute seconds / wall seconds since construction (0 before any time has passed)."""
        wall = self.wall_seconds()
        return self.compute_seconds / wall if wall > 0 else 0.0

    def summary(self) -> str:
        return (f"Compute utilization {self.utilization():.1%}: {self.compute_seconds:.1f} s in forward, backward and "
                f"inner steps of {self.wall_seconds():.1f} s training ({self.samples} samples)")

    def maybe_report(self, optimizer: hivemind.Optimizer, mean_loss: float) -> None:
        now = time.monotonic()
        if now - self.last_report < self.every_seconds:
            return
        tokens_per_second = self.tokens / (now - self.last_report)
        self.last_report, self.tokens = now, 0
        peak_gpu_bytes = None
        if self.device is not None and self.device.type == "cuda":
            peak_gpu_bytes = torch.cuda.max_memory_allocated(self.device)
        line = format_progress(optimizer, mean_loss, tokens_per_second, peak_gpu_bytes)
        emit("progress", epoch=optimizer.local_epoch, peers=optimizer.tracker.global_progress.num_peers,
             samples=self.samples, compute_seconds=self.compute_seconds, compute_cpu_seconds=self.compute_cpu_seconds,
             waiting_seconds=self.waiting_seconds, wall_seconds=now - self.started,
             loss_sum=self.loss_sum, losses=self.losses, visible=visible_peers(optimizer.tracker),
             dht_lookup_seconds=optimizer.dht_lookups.recent[-1] if optimizer.dht_lookups.recent else None)
        mean_loss_text = f"{self.loss_sum / self.losses:.4f}" if self.losses else "n/a"
        logger.info(f"{line} | {self.samples} samples computed, compute {self.utilization():.1%} "
                    f"({self.compute_seconds:.2f} s of {now - self.started:.2f} s), mean loss {mean_loss_text} over "
                    f"{self.losses} micro-batches")


def visible_peers(tracker: ProgressTracker) -> list:
    """The peer IDs in the training-progress records of ``tracker``'s last fetch from the DHT (empty before one).
    hivemind keeps only their count, so the first call wraps the tracker's parser to note them."""
    if not hasattr(tracker, "visible_peers"):
        tracker.visible_peers = []
        parse = tracker._parse_swarm_progress_data

        def noting(metadata):
            if isinstance(metadata, dict):
                tracker.visible_peers = sorted(
                    str(PeerID(LocalTrainingProgress.parse_obj(record.value).peer_id))
                    for record in metadata.values() if record.value is not None)
            return parse(metadata)

        tracker._parse_swarm_progress_data = noting
    return list(tracker.visible_peers)


def format_progress(optimizer: hivemind.Optimizer, mean_loss: float, tokens_per_second: Optional[float] = None,
                    peak_gpu_bytes: Optional[int] = None) -> str:
    swarm = optimizer.tracker.global_progress
    target = optimizer.target_batch_size
    eta = max(0.0, swarm.eta_next_epoch - get_dht_time())
    eta_text = f"ETA {eta:.0f}s" if math.isfinite(eta) else "ETA unknown"
    loss_text = f"{mean_loss:.4f}" if math.isfinite(mean_loss) else "n/a"
    tokens_text = f", {tokens_per_second:.0f} tokens/s" if tokens_per_second is not None else ""
    memory_text = f" | peak GPU {peak_gpu_bytes / 2 ** 30:.2f} GiB" if peak_gpu_bytes is not None else ""
    return (f"epoch {optimizer.local_epoch} | {swarm.samples_accumulated}/{target} samples "
            f"({100 * min(1.0, swarm.samples_accumulated / target):.0f}%, {eta_text}) | loss {loss_text} | "
            f"{optimizer.tracker.performance_ema.samples_per_second:.1f} samples/s{tokens_text} | "
            f"{swarm.num_peers} peer{'s' if swarm.num_peers != 1 else ''}{memory_text}")
