"""hivemind's averagers lose a control message that arrives in pieces, and their caller waits for its timeout.

What is wrong upstream (hivemind 1.1.12, ``DecentralizedAverager._run_internal``): the averager's background process
watches its end of the control pipe with its event loop and, once it is readable, reads a message with
``Connection.recv`` on a non-blocking descriptor. A message larger than the socket buffer whose sender is slower
than the reader (a busy trainer pickling a DiLoCo top-k payload: 1.5 MB for a 25M-parameter model, through
``step(gather=...)``) runs dry half-way: ``recv`` raises ``BlockingIOError``, hivemind logs it and goes on, the step is
lost (its caller waits for the timeout) and the rest of the message is then read as a new one. Seen in
``benchmarks/wan.py``'s top-k mode on the 2-core box.

The fix reads one message at a time with the descriptor blocking: the pipe was readable, so the sender is mid-message
and the read ends as soon as the rest is written.

Reproduced deterministically by ``tests/test_control_pipe.py`` (a sender that pauses mid-message). Drop when hivemind
reads its control pipe blocking (not in 1.1.12). Since top-k payloads travel in the all-reduce
(:mod:`lean_transformer.swarm.averaging.sparse_allreduce`), no control message of ours comes near the socket buffer's size;
the fix stays on the pseudo-gradient averager so that a large ``gather`` cannot silently lose a round again.
"""
from __future__ import annotations

import os
from multiprocessing.connection import Connection
from typing import Any


class WholeMessages:
    """A pipe end whose ``recv`` reads a whole message even when its descriptor is non-blocking."""

    def __init__(self, connection: Connection):
        self.connection = connection

    def recv(self) -> Any:
        fd = self.connection.fileno()
        was_blocking = os.get_blocking(fd)
        os.set_blocking(fd, True)
        try:
            return self.connection.recv()
        finally:
            os.set_blocking(fd, was_blocking)

    def __getattr__(self, name: str) -> Any:
        if name == "connection":  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.connection, name)


class WholeControlMessages:
    """Mixed in front of a hivemind averager: its background process reads each control message whole."""

    def run_in_background(self, *args: Any, **kwargs: Any) -> None:
        if not isinstance(self._inner_pipe, WholeMessages):
            self._inner_pipe = WholeMessages(self._inner_pipe)
        super().run_in_background(*args, **kwargs)
