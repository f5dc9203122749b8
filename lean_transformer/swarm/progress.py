"""A progress line every few seconds that a person can follow: the swarm's epoch, the samples accumulated toward
the target batch and when the epoch should end, this peer's loss and speed (samples/s as hivemind measures it, and
tokens/s since the last line), the number of peers and, on a GPU, the peak GPU memory so far."""
from __future__ import annotations

import logging
import math
import time
from typing import Optional

import hivemind
import torch
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)


class ProgressLine:
    """Logs ``format_progress`` at most every ``every_seconds`` (checked by the training loop once per local step);
    ``count_tokens`` after each local step feeds its tokens/s."""

    def __init__(self, every_seconds: float, device: Optional[torch.device] = None):
        self.every_seconds, self.device = every_seconds, device
        self.last_report = time.monotonic()
        self.tokens = 0

    def count_tokens(self, tokens: int) -> None:
        self.tokens += tokens

    def maybe_report(self, optimizer: hivemind.Optimizer, mean_loss: float) -> None:
        now = time.monotonic()
        if now - self.last_report < self.every_seconds:
            return
        tokens_per_second = self.tokens / (now - self.last_report)
        self.last_report, self.tokens = now, 0
        peak_gpu_bytes = None
        if self.device is not None and self.device.type == "cuda":
            peak_gpu_bytes = torch.cuda.max_memory_allocated(self.device)
        logger.info(format_progress(optimizer, mean_loss, tokens_per_second, peak_gpu_bytes))


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
