"""A progress line every few seconds that a person can follow: the swarm's epoch, the samples accumulated toward
the target batch and when the epoch should end, this peer's loss and speed, and the number of peers."""
from __future__ import annotations

import logging
import math
import time

import hivemind
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)


class ProgressLine:
    """Logs ``format_progress`` at most every ``every_seconds`` (checked by the training loop once per local step)."""

    def __init__(self, every_seconds: float):
        self.every_seconds = every_seconds
        self.last_report = time.monotonic()

    def maybe_report(self, optimizer: hivemind.Optimizer, mean_loss: float) -> None:
        if time.monotonic() - self.last_report < self.every_seconds:
            return
        self.last_report = time.monotonic()
        logger.info(format_progress(optimizer, mean_loss))


def format_progress(optimizer: hivemind.Optimizer, mean_loss: float) -> str:
    swarm = optimizer.tracker.global_progress
    target = optimizer.target_batch_size
    eta = max(0.0, swarm.eta_next_epoch - get_dht_time())
    eta_text = f"ETA {eta:.0f}s" if math.isfinite(eta) else "ETA unknown"
    loss_text = f"{mean_loss:.4f}" if math.isfinite(mean_loss) else "n/a"
    return (f"epoch {optimizer.local_epoch} | {swarm.samples_accumulated}/{target} samples "
            f"({100 * min(1.0, swarm.samples_accumulated / target):.0f}%, {eta_text}) | loss {loss_text} | "
            f"{optimizer.tracker.performance_ema.samples_per_second:.1f} samples/s | "
            f"{swarm.num_peers} peer{'s' if swarm.num_peers != 1 else ''}")
