"""hivemind's progress tracker stores each training-progress record fire and forget: ``ProgressTracker.
_progress_reporter`` creates a task ``asyncio.wait_for(dht.store(...), metadata_expiration)`` and never reads its
outcome. A store that outlives that bound (a peer starved of CPU) ends in ``TimeoutError``, which asyncio logs as
"Task exception was never retrieved", with a traceback, when the task is collected. The record is stored again at
the next report either way. benchmarks/internet.py, 16 trainers on 2 cores at CPU quotas of 0.02-0.25 cores: 8 such
tracebacks in one run, and 14 from DiLoCo's outer averager, whose hivemind declaration loop does the same (that
averager now declares nothing: ``outer_history.ServesOuterHistory``; the state averager's own declaration loop
reads its outcomes with :func:`read_store_outcome`, :mod:`.state_download`).

:class:`ReadsStoreOutcomes`, mixed in front of the tracker, reads the outcome of every ``wait_for`` task that its
event loop creates from then on: a failure is one DEBUG line. Reproduced by ``tests/test_state_declaration.py``
(``test_a_progress_record_whose_store_times_out_logs_no_traceback``). Drop when hivemind reads the outcome of its
store tasks (not in 1.1.12).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine

logger = logging.getLogger(__name__)


def read_store_outcome(task: asyncio.Task) -> None:
    """A done-callback: the task's failure, read (so that asyncio does not report it) and logged at DEBUG."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug(f"A DHT store failed (it is renewed at the next period): {task.exception()!r}")


def _reading_wait_for(loop: asyncio.AbstractEventLoop, coro: Coroutine, **kwargs: Any) -> asyncio.Task:
    """asyncio's default task; for a ``wait_for`` coroutine, with its outcome read when it is done."""
    task = asyncio.Task(coro, loop=loop, **kwargs)
    if getattr(coro, "__qualname__", None) == "wait_for":
        task.add_done_callback(read_store_outcome)
    return task


class ReadsStoreOutcomes:
    """Mixed in front of hivemind's ``ProgressTracker``: the store tasks of its reporter have their outcome read."""

    async def _progress_reporter(self) -> None:
        asyncio.get_running_loop().set_task_factory(_reading_wait_for)
        await super()._progress_reporter()
