"""A control message that arrives in pieces: hivemind's averager loses it, ours reads it whole
(``lean_transformer.swarm.hivemind_fixes.control_pipe``).

hivemind's averager process reads its control pipe like this: wait until the descriptor is readable, then
``Connection.recv`` on the non-blocking descriptor. Here a sender writes a 2 MB message (an averaging step carrying a
top-k payload), pausing half-way as a busy trainer does, and the reader reads it exactly that way.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import struct
import threading
import time

import pytest

from lean_transformer.swarm.hivemind_fixes.control_pipe import WholeControlMessages, WholeMessages

MESSAGE = ("_step", [], dict(gather=dict(topk=b"\x01" * 2**21)))
PAUSE = 1.0  # seconds the sender stops half-way


def _send_in_two_pieces(connection) -> threading.Thread:
    """Write MESSAGE in Connection's wire format (a 4-byte length, then the pickle), pausing half-way."""
    data = pickle.dumps(MESSAGE)
    framed = struct.pack("!i", len(data)) + data
    half = len(framed) // 2

    def write():
        for piece in (framed[:half], framed[half:]):
            view = memoryview(piece)
            while view:
                view = view[os.write(connection.fileno(), view):]
            time.sleep(PAUSE)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def _read_like_hivemind(reader, recv) -> object:
    os.set_blocking(reader.fileno(), False)  # as the averager's event loop has it
    deadline = time.monotonic() + 10
    while not reader.poll(0.01):
        assert time.monotonic() < deadline, "nothing arrived"
    return recv()


def test_hivemind_way_loses_a_message_that_arrives_in_pieces():
    reader, writer = mp.Pipe(duplex=True)
    sender = _send_in_two_pieces(writer)
    with pytest.raises(BlockingIOError):
        _read_like_hivemind(reader, reader.recv)
    deadline = time.monotonic() + 10
    while sender.is_alive() and time.monotonic() < deadline:  # drain the rest, or the sender blocks on a full pipe
        if reader.poll(0.05):
            os.read(reader.fileno(), 2**20)
    assert not sender.is_alive()


def test_whole_messages_reads_it_whole_and_leaves_the_descriptor_non_blocking():
    reader, writer = mp.Pipe(duplex=True)
    sender = _send_in_two_pieces(writer)
    whole = WholeMessages(reader)
    started = time.monotonic()
    assert _read_like_hivemind(reader, whole.recv) == MESSAGE
    assert time.monotonic() - started >= PAUSE * 0.9  # it waited for the second piece
    assert not os.get_blocking(reader.fileno())
    sender.join(10)
    writer.send("next")  # the pipe is still in step: the next message reads as itself
    assert whole.recv() == "next" and whole.poll() is False


def test_the_outer_all_reduce_averagers_read_their_control_pipe_whole():
    from hivemind.averaging import DecentralizedAverager

    from lean_transformer.swarm.averaging.diloco import pseudo_gradient_averager_class

    for gated in (False, True):
        averager_class = pseudo_gradient_averager_class(gated)
        mro = averager_class.__mro__
        assert mro.index(WholeControlMessages) < mro.index(DecentralizedAverager), mro
