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
does for one whose call has left the table. Reproduced by ``tests/test_unary_calls.py``. Drop when hivemind's reader
skips answers to calls that are done.
"""
from __future__ import annotations

import asyncio
import functools
from typing import Any, Callable

from hivemind.p2p.p2p_daemon_bindings.control import ControlClient


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


def install() -> None:
    """Every p2p client this process (and the processes it forks later) creates keeps its calls in
    :class:`PendingCalls` (idempotent)."""
    if not getattr(ControlClient.__init__, "fixed", False):
        ControlClient.__init__ = _with_pending_calls(ControlClient.__init__)
