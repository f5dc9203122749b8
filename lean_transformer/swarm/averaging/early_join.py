"""A slow peer joins its gradient round when the swarm's epoch ends, not when its own micro-batch does.

hivemind triggers a peer's all-reduce inside ``Optimizer.step``, that is after the micro-batch during which the
swarm's epoch ended. Its groupmates wait for it up to the sender timeout (two matchmaking windows, see
:func:`~lean_transformer.swarm.averaging.optimizer.averager_options`): a peer whose micro-batches are longer than that
(volunteers' GPUs differ by 10x) is dropped from its group, steps alone, finds itself out of sync and downloads the
whole state, epoch after epoch. Its compute is lost, and the download takes it ~30 min on a 20 Mbit/s link with a
1.3B model.

Here a thread watches the swarm's progress while the training thread computes. It pre-schedules the round (begins
matchmaking) when the epoch's end comes within the matchmaking window, which hivemind checks only inside ``step``,
one long micro-batch too late. When the swarm's epoch has ended and the micro-batch will not end within a matchmaking
window (its groupmates wait two by default; else the training thread comes in time, micro-batch included), it
triggers the round with the gradients accumulated so far (weight: their samples; none yet is weight 0). The training
thread takes the round's result and steps at its next ``step``, before it accumulates the micro-batch that ran
meanwhile: that micro-batch counts toward the next epoch, its gradient one step stale (computed at the parameters
before the step, as with hivemind's ``delay_grad_averaging``). The training thread holds :attr:`EarlyJoin.lock`
through each ``step``, so the two never touch the accumulators at once.

Only with hivemind's own gradient accumulators: with host gradients the accumulators are the averaging buffers, which
backward writes into in place; with ``reuse_grad_buffers`` (float16 loss scaling) they are the model's ``.grad``; a
delayed optimizer step reads the averaged buffers in the background (:func:`can_join_early`).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator, Optional

from hivemind.averaging.control import StepControl
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import ProgressTracker

from lean_transformer.swarm.monitoring.events import emit

logger = logging.getLogger(__name__)


def can_join_early(grad_averager: GradientAverager, host_gradients: bool, delay_optimizer_step: bool) -> bool:
    """Whether a round can start while backward runs: see the module docstring."""
    return not (host_gradients or grad_averager.reuse_grad_buffers or delay_optimizer_step)


class EarlyJoin:
    """From a thread, while the training thread computes: ``schedule()`` (pre-schedules the round when it is due) and
    triggers the pre-scheduled gradient round (``scheduled()``) once the swarm's epoch has ended and the training
    thread's micro-batch will not end within ``slack`` seconds. A micro-batch is expected to last as long as the last
    one did (from leaving ``step`` to entering it again). :meth:`take` hands the triggered round to the training
    thread."""

    def __init__(self, averager: GradientAverager, tracker: ProgressTracker, schedule: Callable[[], None],
                 scheduled: Callable[[], Optional[StepControl]], slack: float, poll: float = 0.1):
        self.averager, self.tracker, self.schedule, self.scheduled = averager, tracker, schedule, scheduled
        self.slack, self.poll = slack, poll
        self.lock = threading.RLock()
        self._joined: Optional[StepControl] = None
        self._step_left = time.monotonic()
        self._micro_batch = 0.0  # seconds the last micro-batch took
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="EarlyJoin", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def training_step(self) -> Iterator[None]:
        """Around the training thread's ``step``: the thread waits meanwhile."""
        with self.lock:
            self._micro_batch = time.monotonic() - self._step_left
            try:
                yield
            finally:
                self._step_left = time.monotonic()

    @property
    def pending(self) -> bool:
        """Whether a round was triggered and the training thread has not taken it yet."""
        return self._joined is not None

    def take(self) -> Optional[StepControl]:
        """The round triggered early, once (None if none was)."""
        with self.lock:
            joined, self._joined = self._joined, None
            return joined

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10 * self.poll + 1)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            if not self.lock.acquire(blocking=False):
                continue  # the training thread is in step: it triggers the round itself if the epoch ended
            try:
                self._maybe_join()
            except Exception as error:  # the training thread's own trigger still runs
                logger.warning(f"Could not join the gradient round early: {error!r}")
            finally:
                self.lock.release()

    def _maybe_join(self) -> None:
        if self._joined is not None:
            return
        self.schedule()
        control = self.scheduled()
        if control is None or control.triggered or control.done():
            return
        if not self.tracker.ready_to_update_epoch or self.tracker.global_progress.num_peers <= 1:
            return  # alone, hivemind skips the round at the step
        remaining = self._step_left + self._micro_batch - time.monotonic()
        if remaining < self.slack:
            return  # the training thread will be there soon enough
        epoch, samples = self.tracker.local_progress.epoch, self.averager.local_samples_accumulated
        self.averager.step(control=control, reset_accumulators=True, wait=False)
        self._joined = control
        logger.info(f"The swarm's epoch {epoch} ended during this peer's micro-batch (~{remaining:.1f} s left): joined "
                    f"the gradient round with {samples} samples; the micro-batch counts toward the next epoch")
        emit("joined_early", epoch=epoch, samples=samples, seconds_left=remaining)
