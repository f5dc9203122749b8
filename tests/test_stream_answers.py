"""lean_transformer.swarm.hivemind_fixes.stream_answers: an early answer to a streamed request reaches its caller.

Run as a script, this file is one variant of the scenario, in its own process with two real P2P daemons on 127.0.0.1:
a handler answers a streamed request at once without reading it (as an averager refusing a tensor part does) while
the caller is still sending ``PART_BYTES`` of parts; the caller reads its answer only after it has sent everything.
Variant ``hivemind``: the handler returns right after answering. Variant ``lean_transformer``: the handler's answers
go through :func:`answer_then_drain`. Variants ``caller_closes`` and ``caller_reads_to_end``: which end of an answered
stream closes first (:class:`CallerClosesFirst` against hivemind's own caller, which reads until the handler closes).
Variants ``state`` and ``state_hivemind``: many state downloads, with and without the end that lets the reader close
first.
"""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

import preloaded
from swarm_utils import p2p_pair

REPO = Path(__file__).resolve().parent.parent
CALLS = 6
PARTS, PART_BYTES = 4, 2_000_000  # 8 MB in flight when the answer is sent
READ_DELAY = 0.5  # seconds between the caller's last part and its first read


async def _scenario(variant: str) -> dict:
    from hivemind.proto import averaging_pb2, runtime_pb2
    from hivemind.utils.asyncio import anext, as_aiter

    from lean_transformer.swarm.hivemind_fixes.stream_answers import answer_then_drain

    async def refuse(stream, context):
        refusal = as_aiter(averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION))
        answers = refusal if variant == "hivemind" else answer_then_drain(refusal, stream)
        async for answer in answers:
            yield answer

    async with p2p_pair() as (server, client):
        await server.add_protobuf_handler("part", refuse, averaging_pb2.AveragingData, stream_input=True,
                                          stream_output=True)
        part = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"group",
                                           tensor_part=runtime_pb2.Tensor(buffer=b"\0" * PART_BYTES))
        outcomes = []
        for _ in range(CALLS):
            answers = await client._iterate_protobuf_stream_handler(
                server.peer_id, "part", as_aiter(*[part] * PARTS), averaging_pb2.AveragingData)
            await asyncio.sleep(READ_DELAY)
            try:
                answer = await asyncio.wait_for(anext(answers), 10)
                outcomes.append(averaging_pb2.MessageCode.Name(answer.code))
            except StopAsyncIteration:
                outcomes.append("empty stream")
            except ConnectionError as e:
                outcomes.append(type(e).__name__)
            finally:
                await answers.aclose()
        return dict(outcomes=outcomes)


def _run_side_by_side(*variants: str) -> list:
    """Each variant's outcomes, the variants run at the same time, each in its own process."""
    return [result for result, _ in preloaded.run_side_by_side(__file__, variants)]


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_a_refusal_reaches_a_caller_that_is_still_sending(report):
    upstream, fixed = (result["outcomes"] for result in _run_side_by_side("hivemind", "lean_transformer"))
    lost = [outcome for outcome in upstream if outcome != "PROTOCOL_VIOLATION"]
    # when hivemind delivers these answers itself, this fails: drop stream_answers (see its docstring)
    assert len(lost) >= CALLS // 2, f"hivemind 1.1.12 lost only {len(lost)} of {CALLS} answers: {upstream}"
    assert fixed == ["PROTOCOL_VIOLATION"] * CALLS, fixed
    report(f"a refusal sent while {PARTS * PART_BYTES / 1e6:g} MB of request were in flight: hivemind's handler "
           f"lost {len(lost)} of {CALLS} ({sorted(set(lost))}); with answer_then_drain, {CALLS} of {CALLS} arrived")


ANSWERS, LINGER = 3, 4.0  # answers per call; the handler's bound on waiting for its caller to close (seconds)


async def _noting_end(answers, ended: asyncio.Future):
    """A handler's ``answers``; ``ended`` says how the handler ended: "linger" (it closed first, after its bound) or
    "cancelled" (the caller's close ended it)."""
    try:
        async for answer in answers:
            yield answer
        ended.set_result("linger")
    except asyncio.CancelledError:
        ended.set_result("cancelled")
        raise


async def _close_order(variant: str) -> dict:
    """One call answered with ``ANSWERS`` parts: how the handler ended ("cancelled": the caller's close ended it;
    "linger": it closed first, after ``LINGER`` s), the caller's answers and the seconds its call took."""
    import time

    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import as_aiter

    from lean_transformer.swarm.hivemind_fixes.stream_answers import CallerClosesFirst, answer_then_drain

    ended = asyncio.get_running_loop().create_future()

    async def averaged(stream, context):
        async def answers():
            async for _ in stream:  # one answer per part, as hivemind's reducer
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART)
        async for answer in _noting_end(answer_then_drain(answers(), stream, linger=LINGER), ended):
            yield answer

    async with p2p_pair() as (server, client):
        await server.add_protobuf_handler("part", averaged, averaging_pb2.AveragingData, stream_input=True,
                                          stream_output=True)

        class Stub:  # what ServicerBase.get_stub returns, for this one handler
            async def rpc_aggregate_part(self, requests):
                return await client.iterate_protobuf_handler(server.peer_id, "part", requests,
                                                             averaging_pb2.AveragingData)

        stub = CallerClosesFirst(Stub()) if variant == "caller_closes" else Stub()
        part = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"group")
        start = time.monotonic()
        answers = [averaging_pb2.MessageCode.Name(answer.code)
                   async for answer in await stub.rpc_aggregate_part(as_aiter(*[part] * ANSWERS))]
        seconds = time.monotonic() - start
        return dict(ended=await asyncio.wait_for(ended, 2 * LINGER), answers=answers, seconds=seconds)


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_the_caller_closes_an_answered_stream_first(report):
    closes, reads = _run_side_by_side("caller_closes", "caller_reads_to_end")
    assert closes["answers"] == reads["answers"] == ["AVERAGED_PART"] * ANSWERS, (closes, reads)
    # the handler's end stays open until the caller, holding every answer, closes its own
    assert closes["ended"] == "cancelled" and closes["seconds"] < LINGER / 2, closes
    # hivemind's caller reads until the handler closes: the handler closes first, after its bound
    assert reads["ended"] == "linger" and reads["seconds"] >= LINGER, reads
    report(f"{ANSWERS} answers: a caller that closes once answered ended the handler's wait in "
           f"{closes['seconds']:.2f} s; hivemind's caller waited {reads['seconds']:.1f} s for the handler to close")


async def _join_answered() -> dict:
    """A join request (one message) answered with a refusal through :func:`lingering`, called as hivemind's
    matchmaking does (it reads the answer it needs, then closes): how the handler ended, the answer, the seconds."""
    import time

    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import anext, as_aiter

    from lean_transformer.swarm.hivemind_fixes.stream_answers import lingering

    ended = asyncio.get_running_loop().create_future()

    async def refuse(request, context):
        refusal = as_aiter(averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP))
        async for answer in _noting_end(lingering(refusal, linger=LINGER), ended):
            yield answer

    async with p2p_pair() as (server, client):
        await server.add_protobuf_handler("join", refuse, averaging_pb2.JoinRequest, stream_output=True)
        start = time.monotonic()
        stream = await client.iterate_protobuf_handler(server.peer_id, "join", averaging_pb2.JoinRequest(),
                                                       averaging_pb2.MessageFromLeader)
        try:
            answer = averaging_pb2.MessageCode.Name((await anext(stream)).code)
        finally:
            await stream.aclose()
        seconds = time.monotonic() - start
        return dict(ended=await asyncio.wait_for(ended, 2 * LINGER), answer=answer, seconds=seconds)


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_a_join_answer_waits_for_the_caller_to_close_first():
    (result, _), = preloaded.run_side_by_side(__file__, ["join"])
    # the handler's end stays open after the refusal until hivemind's caller, holding it, closes its own
    assert result == dict(ended="cancelled", answer="NOT_LOOKING_FOR_GROUP", seconds=result["seconds"]), result
    assert result["seconds"] < LINGER / 2, result


STATES, STATE_PARTS, STATE_PART_BYTES = 60, 200, 20_000  # streams of one state each: 4 MB in 200 answers


async def _states(variant: str) -> dict:
    """``STATES`` state downloads, one after the other, each served as ``STATE_PARTS`` answers: how many arrived
    whole, how many were cut (with how many answers), and how each handler ended. Variant ``state``: served through
    :func:`ending_state` and read with :class:`UntilStateEnd`, as the averagers do; ``state_hivemind``: hivemind's
    handler and caller, which reads until the handler closes (run by hand: it shows the loss)."""
    from hivemind.proto import averaging_pb2, runtime_pb2
    from hivemind.utils.asyncio import aiter_with_timeout

    from lean_transformer.swarm.hivemind_fixes.stream_answers import UntilStateEnd, ending_state

    endings = []

    async def serve(request, context):
        async def answers():
            for index in range(STATE_PARTS):
                yield averaging_pb2.DownloadData(tensor_part=runtime_pb2.Tensor(buffer=b"\0" * STATE_PART_BYTES,
                                                                                 size=[index]))
        if variant == "state_hivemind":
            async for answer in answers():
                yield answer
            return
        endings.append(asyncio.get_running_loop().create_future())
        async for answer in _noting_end(ending_state(answers(), linger=LINGER), endings[-1]):
            yield answer

    async with p2p_pair() as (server, client):
        await server.add_protobuf_handler("state", serve, averaging_pb2.DownloadRequest, stream_output=True)
        whole, cut = 0, []
        for _ in range(STATES):
            stream = await client.iterate_protobuf_handler(server.peer_id, "state", averaging_pb2.DownloadRequest(),
                                                           averaging_pb2.DownloadData)
            reader = UntilStateEnd(stream) if variant == "state" else stream
            indices = [answer.tensor_part.size[0] async for answer in aiter_with_timeout(reader, LINGER / 2)]
            if indices == list(range(STATE_PARTS)) and getattr(reader, "whole", True):
                whole += 1
            else:
                cut.append(len(indices))
        ended = [await asyncio.wait_for(ending, 2 * LINGER) for ending in endings]
        return dict(whole=whole, cut=cut, ended=sorted(set(ended)))


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_a_served_state_arrives_whole_and_its_reader_closes_first(report):
    (result, _), = preloaded.run_side_by_side(__file__, ["state"])
    # every handler's end stayed open until the reader, holding the whole state, closed its own (with hivemind's
    # handler closing first, p2pd's close cut 3 of 200 such streams at the tail: variant state_hivemind); all whole
    assert result == dict(whole=STATES, cut=[], ended=["cancelled"]), result
    report(f"{STATES} states of {STATE_PARTS * STATE_PART_BYTES / 1e6:g} MB in {STATE_PARTS} answers: all whole, "
           f"each handler ended by its reader's close")


if __name__ == "__main__":
    scenarios = dict(hivemind=_scenario, lean_transformer=_scenario, join=lambda _: _join_answered(), state=_states,
                     state_hivemind=_states)
    scenario = scenarios.get(sys.argv[1], _close_order)
    print(json.dumps(asyncio.run(scenario(sys.argv[1]))))


def test_draining_a_request_stream_that_the_handler_still_reads_is_quiet():
    """hivemind's all-reduce reads a caller's parts in a task of its own; when its answers end first (a reducer that
    finalized without a late part), draining the same stream must leave it to that task, not raise."""
    from lean_transformer.swarm.hivemind_fixes.stream_answers import answer_then_drain

    async def scenario() -> list:
        release = asyncio.Event()

        async def requests():
            yield 1
            await release.wait()  # the caller is still sending
            yield 2

        stream = requests()

        async def reader():  # the handler's own task, reading the stream
            return [item async for item in stream]

        async def answers():
            yield "answer"

        reading = asyncio.create_task(reader())
        await asyncio.sleep(0.01)  # the reader is inside the generator, waiting for the next part
        answered = [answer async for answer in answer_then_drain(answers(), stream, timeout=1.0, linger=0.0)]
        release.set()
        return [answered, await reading]

    assert asyncio.run(scenario()) == [["answer"], [1, 2]]
