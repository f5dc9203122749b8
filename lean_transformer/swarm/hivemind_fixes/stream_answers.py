"""An answer to a streamed request must reach the caller even when the handler answers before reading it all.

hivemind 1.1.12's P2P server closes its end of a stream as soon as a stream-input handler returns. If the caller is
still sending (a tensor part for all-reduce is megabytes), its messages lie unread in the server's socket; p2pd then
resets the stream instead of closing it, and the reset throws away the answer the handler had just sent. The caller
sees an empty stream or a broken pipe instead of the answer. The averagers answer early whenever they refuse a part:
hivemind's ``BAD_GROUP_ID`` to a peer of a group that has ended, our gate's ``PROTOCOL_VIOLATION`` to a stranger
(:mod:`lean_transformer.swarm.auth.averaging_gate`), so a refused caller could not tell a refusal from a crash.

Here the handler's answers are sent first, then what the caller still sends is read and discarded up to its end of
stream, for at most ``DRAIN_TIMEOUT`` s; only then does hivemind close the stream, and it closes it cleanly.
``tests/test_stream_answers.py`` reproduces the loss with hivemind's own P2P (a refusal sent while 8 MB of request
are in flight is lost every time) and checks the fix. Drop when hivemind's stream handler reads a request to its end
before closing (not in 1.1.12).
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, TypeVar

from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

DRAIN_TIMEOUT = 10.0  # seconds a caller may go on sending after it was answered
Answer = TypeVar("Answer")


async def answer_then_drain(answers: AsyncIterator[Answer], requests: AsyncIterator[Any],
                            timeout: float = DRAIN_TIMEOUT) -> AsyncIterator[Answer]:
    """Yield ``answers``, then read ``requests`` to their end (at most ``timeout`` s) so that the stream closes
    cleanly and the caller receives every answer."""
    async for answer in answers:
        yield answer
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(_read_to_end(requests), timeout)


async def _read_to_end(requests: AsyncIterator[Any]) -> None:
    try:
        async for _ in requests:
            pass
    except RuntimeError as error:
        # hivemind's all-reduce reads the parts in a task of its own, which may still be reading when a reducer that
        # finalized early (a late sender) has answered: that task drains the stream, there is nothing left to do
        # (seen as "anext(): asynchronous generator is already running" tracebacks in an 8-trainer swarm)
        if "already running" not in str(error):
            raise


class AnswersDelivered:
    """Mixed in front of a hivemind averager: its all-reduce handler's answers reach the caller (see above)."""

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for answer in answer_then_drain(super().rpc_aggregate_part(stream, context), stream):
            yield answer
