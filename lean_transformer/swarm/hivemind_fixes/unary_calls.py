"""A unary call cancelled while its answer is on the way no longer makes the peer deaf; installed on import of
``lean_transformer.swarm.hivemind_fixes``.

What hivemind 1.1.12 does wrong (its master too): its p2p client keeps each unary call it makes (every DHT request,
averager requests) in ``ControlClient._pending_calls`` (call id -> future) until the call's coroutine ends, and one
reader task of the daemon's connection sets the future of each answer that arrives. A call that is cancelled (a
timeout, a straggler that the DHT's searches cancel) has its future cancelled at once but leaves the table only when
its coroutine runs again, a loop iteration later; an answer read in between is set on the cancelled future. That
raises ``InvalidStateError`` in the reader and ends it, silently (asyncio logs it only when the task is collected).
From then on the process answers no unary request and none of its own calls is answered: a DHT node goes deaf while
its process looks idle. ``benchmarks/internet.py`` (16 DiLoCo trainers, a starved box): in 3 of 22 runs the aux
peer, every trainer's entry peer, went deaf as the trainers joined; 12 of 16 could not join, the aux peer counted
nobody, and its DHT then hung at shutdown.

The fix: the table counts a call as pending only while its future is not done, which is what every branch of the
reader asks before it sets a future, so an answer to a call that stopped waiting is dropped, as hivemind already
does for one whose call has left the table. And a reader that fails for any other reason says so in one ERROR line
instead of leaving a deaf process behind without a word. Reproduced by ``tests/test_unary_calls.py``. Drop when
hivemind's reader skips answers to calls that are done and reports its own failure.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Callable, Coroutine

from hivemind.p2p.p2p_daemon_bindings.control import ControlClient

logger = logging.getLogger(__name__)


class PendingCalls(dict):
    """hivemind's table of a client's unary calls in flight (call id -> future), in which a call whose future is done
    (cancelled) is no longer pending."""

    def __contains__(self, call_id: object) -> bool:
        future: asyncio.Future | None = self.get(call_id)
        return future is not None and not future.done()


def _with_pending_calls(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def init_with_pending_calls(self: ControlClient, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._pending_calls = PendingCalls(self._pending_calls)

    init_with_pending_calls.fixed = True
    return init_with_pending_calls


def _report_reader_failure(reader: asyncio.Task) -> None:
    if not reader.cancelled() and reader.exception() is not None:
        logger.error(f"This process's p2p client stopped reading its daemon ({reader.exception()!r}): from now on it "
                     f"answers no peer's request and gets no answer to its own")


def _with_watched_reader(connect: Callable[[ControlClient], Coroutine]) -> Callable[[ControlClient], Coroutine]:
    @functools.wraps(connect)
    async def connect_with_watched_reader(self: ControlClient) -> None:
        await connect(self)
        self._read_task.add_done_callback(_report_reader_failure)

    connect_with_watched_reader.fixed = True
    return connect_with_watched_reader


def install() -> None:
    """Every p2p client this process (and the processes it forks later) creates keeps its calls in
    :class:`PendingCalls` and reports a failure of its reader (idempotent)."""
    if not getattr(ControlClient.__init__, "fixed", False):
        ControlClient.__init__ = _with_pending_calls(ControlClient.__init__)
    if not getattr(ControlClient._ensure_persistent_conn, "fixed", False):
        ControlClient._ensure_persistent_conn = _with_watched_reader(ControlClient._ensure_persistent_conn)
