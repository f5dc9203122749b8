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

The same answers are lost when the averager leaves too early. A reducer's own round ends as soon as its share is
averaged, while its handler may still be sending that share's answers to the groupmates; hivemind 1.1.12's averager
shutdown then stops its event loop with the handler half-way, and a groupmate keeps its own values for the answers
it never got. A peer that reaches ``--max_epochs`` leaves right after its last state-averaging round, so its partner
saved parameters that differed from its own on part of the reducer's share (CI, ``tests/test_trainer_swarm.py``).
Here the averager's shutdown first waits for its handlers to finish, for at most ``LEAVE_TIMEOUT`` s and half the
shutdown's time. ``tests/test_averagers.py`` (case ``leave``) reproduces the loss with hivemind's averager, its
reducer's answers slowed. Drop with the rest of this module.

And the answers are lost when the handler's end closes first. p2pd (go-libp2p-daemon as shipped with hivemind 1.1.12)
closes a stream, both ways, as soon as the handler's socket ends; go-yamux's ``Close`` first closes the read side,
which wakes the goroutine that copies the caller's data; it sees a reset stream and calls ``Reset``, and if it wins
the race with the ``CloseWrite`` that follows, the caller receives RST instead of FIN. A caller that has not yet read
the answers in its p2pd's buffer loses them: an empty stream (CI: a stranger's refusal) or an all-reduce share one
part short (CI: "Averaging: received 99.8% results", a pair whose final parameters differed). The race is inside
p2pd: the more answers a caller's daemon still holds, the more likely (0 in 30,000 streams of small answers on the
2-core box; 23 of 600 streams of 200 answers of 20 kB each, all of them cut at the tail, with hivemind's own P2P). It
is avoided: the caller closes first, once it holds every answer it expects
(:class:`CallerClosesFirst`: one answer per tensor part it sent, or a refusal), and the handler, having answered and
drained, waits for that close (hivemind cancels the handler when the caller's end closes) for at most
``LINGER_TIMEOUT`` s. Whatever the caller's close does to the stream, it has nothing left to receive.
``tests/test_stream_answers.py`` checks the order: the handler is cancelled by the caller's close, and the caller
waits for no timeout. The same race loses matchmaking's answers (a join request is one message, its answers a
stream): CI saw an empty stream instead of a join answer (``tests/test_auth_averaging.py``: a token holder asking an
idle averager), so those handlers also wait, after their last answer, for the caller to close (:func:`lingering`;
hivemind's matchmaking closes its request stream once it has read what it needs). And it cut served states: a
state's answers are megabytes, and a downloader that got 96 of 154 tensors rejected its only donor and joined the
swarm alone (CI, ``tests/test_diloco_swarm.py``); DiLoCo's outer histories travel the same way. A state's answers
end with an empty message (:func:`ending_state`), after which its handler waits for the caller's close, and a
downloader reads up to that end and closes (:class:`UntilStateEnd`); a stream that ends without it was cut.
``tests/test_stream_answers.py`` checks the order (each handler is ended by its reader's close) and that 60 streams
of 4 MB arrive whole (hivemind's own P2P cut the tail of 3 of 200 such streams, and of 23 of 600 in another run).
Drop with the rest of this module.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Optional, Set, TypeVar

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, as_aiter

DRAIN_TIMEOUT = 10.0  # seconds a caller may go on sending after it was answered
LINGER_TIMEOUT = 10.0  # seconds a handler that has answered waits for its caller to close the stream first
LEAVE_TIMEOUT = 10.0  # seconds a leaving averager waits for its handlers to finish answering
Answer = TypeVar("Answer")
_PART_ANSWERS = (averaging_pb2.AVERAGED_PART, averaging_pb2.NO_CODE)  # any other code ends the answers


async def answer_then_drain(answers: AsyncIterator[Answer], requests: AsyncIterator[Any],
                            timeout: float = DRAIN_TIMEOUT, linger: float = LINGER_TIMEOUT) -> AsyncIterator[Answer]:
    """Yield ``answers``, then read ``requests`` to their end (at most ``timeout`` s), then wait for the caller to
    close the stream (at most ``linger`` s; hivemind cancels this handler then), so that the caller receives every
    answer."""
    async for answer in answers:
        yield answer
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(_read_to_end(requests), timeout)
    await asyncio.sleep(linger)


async def lingering(answers: AsyncIterator[Answer], linger: float = LINGER_TIMEOUT) -> AsyncIterator[Answer]:
    """Yield ``answers``, then wait for the caller to close the stream (at most ``linger`` s; hivemind cancels this
    handler then): for handlers of one-message requests, whose caller has nothing left to send."""
    async for answer in answers:
        yield answer
    await asyncio.sleep(linger)


async def ending_state(answers: AsyncIterator[averaging_pb2.DownloadData], linger: float = LINGER_TIMEOUT
                       ) -> AsyncIterator[averaging_pb2.DownloadData]:
    """A served state's ``answers``, then an empty message that ends it, then wait for the caller to close the
    stream (:func:`lingering`)."""
    async for answer in lingering(achain(answers, as_aiter(averaging_pb2.DownloadData())), linger):
        yield answer


class UntilStateEnd:
    """The answers of a state's stream (``rpc_download_state``) up to the empty message that ends it
    (:func:`ending_state`), at which this end closes the stream, first. ``whole``: the end arrived; a stream that
    stopped before it was cut (or its donor runs an older version, which sends none)."""

    def __init__(self, answers: AsyncIterator[averaging_pb2.DownloadData]):
        self._answers, self.whole = answers, False

    def __aiter__(self) -> UntilStateEnd:
        return self

    async def __anext__(self) -> averaging_pb2.DownloadData:
        if self.whole:
            raise StopAsyncIteration
        answer = await self._answers.__anext__()
        if answer.metadata or answer.HasField("tensor_part"):
            return answer
        self.whole = True
        await self.aclose()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Close the stream (hivemind's caller closes its end of the p2pd stream)."""
        await self._answers.aclose()


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


class AnswersBeforeLeaving:
    """Mixed in front of a hivemind averager: its shutdown first lets the all-reduce handlers still answering finish
    (see above). Its methods run in the averager's process."""

    _answering: Optional[Set[asyncio.Task]] = None  # the streams still being answered (in the averager's process)

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if self._answering is None:
            self._answering = set()
        handler = asyncio.current_task()  # hivemind's task for this stream, which then closes it
        self._answering.add(handler)
        handler.add_done_callback(self._answering.discard)
        async for answer in super().rpc_aggregate_part(stream, context):
            yield answer

    async def _shutdown(self, timeout: Optional[float]) -> None:
        answering = set(self._answering or ())
        if answering:
            budget = LEAVE_TIMEOUT if timeout is None else min(LEAVE_TIMEOUT, timeout / 2)
            await asyncio.wait(answering, timeout=budget)
        await super()._shutdown(timeout)


class _Sent:
    """Counts the requests a caller's stream has taken, and whether they have ended."""

    def __init__(self):
        self.count, self.ended, self._changed = 0, False, asyncio.Event()

    async def counted(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        try:
            async for request in requests:
                self.count += 1
                self._changed.set()
                yield request
        finally:
            self.ended = True
            self._changed.set()

    async def changed(self) -> None:
        self._changed.clear()
        await self._changed.wait()


async def _until_answered(answers: AsyncIterator[averaging_pb2.AveragingData], sent: _Sent
                          ) -> AsyncIterator[averaging_pb2.AveragingData]:
    """``answers`` up to the one for the last part sent (or a refusal), then close the stream: the caller's end
    closes first."""
    received = 0
    try:
        async for answer in answers:
            yield answer
            received += 1
            if answer.code not in _PART_ANSWERS:
                return
            while received >= sent.count and not sent.ended:
                await sent.changed()  # the next part is being sent, or that was the last one
            if received >= sent.count:
                return
    finally:
        await answers.aclose()


class CallerClosesFirst:
    """A stub whose ``rpc_aggregate_part`` stream ends, closed by the caller, at its last expected answer: one per
    message sent (hivemind's all-reduce answers each tensor part; the sparse all-reduce answers its two messages
    with two), or a refusal. Its other RPCs are the stub's own."""

    def __init__(self, stub: Any):
        self._stub = stub

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)

    async def rpc_aggregate_part(self, requests: AsyncIterator[averaging_pb2.AveragingData]
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        sent = _Sent()
        return _until_answered(await self._stub.rpc_aggregate_part(sent.counted(requests)), sent)


class AnswersDelivered(AnswersBeforeLeaving):
    """Mixed in front of a hivemind averager: its all-reduce, matchmaking and state answers reach the caller, also
    when this averager shuts down right after its round (see above). As a caller (its stubs), it closes first once
    answered; a state's reader closes first with :class:`UntilStateEnd`."""

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for answer in answer_then_drain(super().rpc_aggregate_part(stream, context), stream):
            yield answer

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        async for answer in lingering(super().rpc_join_group(request, context)):
            yield answer

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        async for answer in ending_state(super().rpc_download_state(request, context)):
            yield answer

    @classmethod
    def get_stub(cls, p2p: P2P, peer: PeerID, *, namespace: Optional[str] = None) -> CallerClosesFirst:
        return CallerClosesFirst(super().get_stub(p2p, peer, namespace=namespace))
