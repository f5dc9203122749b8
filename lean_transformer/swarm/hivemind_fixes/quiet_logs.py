"""Expected events as one line: hivemind 1.1.12 logs them as ERROR tracebacks, which tell a volunteer that something
broke when nothing did.

- An averaging round that found no group, was cancelled or whose all-reduce a groupmate left
  (``AllreduceException`` "could not find a group", ``MatchmakingException`` "Unable to run All-Reduce",
  ``CancelledError``, ``TimeoutError``): hivemind's averager calls ``logger.exception`` and the optimizer goes on with
  local gradients, as it should. Here: one WARNING line naming the round's averager and the reason; the peer's
  ``round_missed`` event carries the same (:mod:`lean_transformer.swarm.averaging.round_events`).
- A peer process that exits while another still fetches a tensor it shared (torch shares tensors between hivemind's
  processes through ``multiprocessing.resource_sharer``): the sharer's thread prints ``ConnectionResetError`` /
  ``FileNotFoundError`` / ``EOFError`` tracebacks through ``sys.excepthook`` at the DHT's shutdown, and the DHT's own
  loop logs them as ERROR tracebacks (``hivemind.dht.dht._run``: a peer that left while a trainer stopped, in
  benchmarks/internet.py). Here: one INFO line.

- A peer that resets a connection while this peer's p2p handler reads a request from it (a peer killed, or its
  round cancelled, mid-request): ``hivemind.p2p.p2p_daemon._handle_stream`` logs "Exception while receiving
  requests" as a WARNING with a ``ConnectionResetError`` traceback (it is quiet for a stream closed cleanly,
  ``IncompleteReadError``). In benchmarks/internet.py's 16-trainer DiLoCo run a groupmate's reset counted as a crash.
  Here: one INFO line.

With ``HIVEMIND_LOGLEVEL=DEBUG`` all keep their tracebacks. Anything else is left as it is: a traceback still means a
bug. Reproduced by the logs of ``tests/test_large_swarm.py`` (8 trainers) and of a DiLoCo journey with top-k and
``--outer_overlap`` (``tests/test_diloco_swarm.py``), which assert that healthy runs hold no traceback. Drop when
hivemind logs expected round failures without a traceback (not in 1.1.12).
"""
from __future__ import annotations

import asyncio
import logging
import sys
import traceback
from types import TracebackType
from typing import Optional

from hivemind.averaging.partition import AllreduceException
from hivemind.averaging.matchmaking import MatchmakingException

AVERAGER_LOGGER = "hivemind.averaging.averager"
DHT_LOGGER = "hivemind.dht.dht"
P2P_LOGGER = "hivemind.p2p.p2p_daemon"
EXPECTED_ROUND_ERRORS = (AllreduceException, MatchmakingException, asyncio.CancelledError, asyncio.TimeoutError,
                         TimeoutError)
SHUTDOWN_ERRORS = (ConnectionResetError, BrokenPipeError, FileNotFoundError, EOFError)
RECEIVING = "Exception while receiving requests:"  # hivemind.p2p.p2p_daemon.P2P._handle_stream's message


def _debugging() -> bool:
    return logging.getLogger("hivemind").isEnabledFor(logging.DEBUG)


class ExpectedRoundFailures(logging.Filter):
    """On hivemind's averager logger: a failed round's ERROR traceback becomes one WARNING line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if record.levelno >= logging.ERROR and isinstance(error, EXPECTED_ROUND_ERRORS) and not _debugging():
            record.msg, record.args = f"Averaging round ended without averaging: {type(error).__name__}: {error}", ()
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
            record.exc_info, record.exc_text = None, None
        return True


def _from_resource_sharer(trace: Optional[TracebackType]) -> bool:
    return any("multiprocessing/resource_sharer.py" in frame.filename for frame in traceback.extract_tb(trace))


class SharerShutdown(logging.Filter):
    """On hivemind's DHT logger: a resource sharer's shutdown error (see the module's docstring) as one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error, trace = (record.exc_info[1], record.exc_info[2]) if record.exc_info else (None, None)
        if isinstance(error, SHUTDOWN_ERRORS) and _from_resource_sharer(trace) and not _debugging():
            record.msg, record.args = (f"A process left while a tensor it shared was being fetched "
                                       f"({type(error).__name__}): expected when peers shut down"), ()
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            record.exc_info, record.exc_text = None, None
        return True


class ResetWhileReceiving(logging.Filter):
    """On hivemind's p2p logger: a connection reset while a handler reads a request, as one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, ConnectionResetError) and record.msg == RECEIVING and not _debugging():
            record.msg, record.args = f"A peer reset its connection during a request: {error}", ()
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            record.exc_info, record.exc_text = None, None
        return True


def _excepthook(kind: type, error: BaseException, trace: Optional[TracebackType]) -> None:
    if isinstance(error, SHUTDOWN_ERRORS) and _from_resource_sharer(trace) and not _debugging():
        logging.getLogger(__name__).info(f"A process left while a tensor it shared was being fetched "
                                         f"({type(error).__name__}): expected when peers shut down")
        return
    _previous_excepthook(kind, error, trace)


_previous_excepthook = sys.excepthook


def install() -> None:
    global _previous_excepthook
    for name, kind in ((AVERAGER_LOGGER, ExpectedRoundFailures), (DHT_LOGGER, SharerShutdown),
                       (P2P_LOGGER, ResetWhileReceiving)):
        logger = logging.getLogger(name)
        if not any(isinstance(existing, kind) for existing in logger.filters):
            logger.addFilter(kind())
    if sys.excepthook is not _excepthook:
        _previous_excepthook, sys.excepthook = sys.excepthook, _excepthook
