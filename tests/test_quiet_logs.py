"""Expected events are one log line, tracebacks stay for bugs and for HIVEMIND_LOGLEVEL=DEBUG
(lean_transformer.swarm.hivemind_fixes.quiet_logs), on hivemind's real logger and a real resource-sharer error."""
from __future__ import annotations

import logging
import subprocess
import sys
from multiprocessing.resource_sharer import _ResourceSharer

import pytest
from hivemind.averaging.partition import AllreduceException

from lean_transformer.swarm.hivemind_fixes import quiet_logs


@pytest.fixture
def hivemind_level(caplog):
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("in_root_logger")  # as the peers' scripts do: hivemind's records reach the root logger
    caplog.set_level(logging.INFO)
    logger = logging.getLogger("hivemind")
    level = logger.level
    yield logger.setLevel
    logger.setLevel(level)


def log_failed_round(error: BaseException, caplog) -> logging.LogRecord:
    caplog.clear()
    try:
        raise error
    except BaseException as e:
        logging.getLogger(quiet_logs.AVERAGER_LOGGER).exception(e)  # as hivemind's DecentralizedAverager._step does
    (record,) = caplog.records
    return record


def test_a_round_without_a_group_is_one_warning_line(caplog, hivemind_level):
    hivemind_level(logging.INFO)
    record = log_failed_round(AllreduceException("Averaging step failed: could not find a group"), caplog)
    assert (record.levelno, record.exc_info) == (logging.WARNING, None)
    assert record.getMessage() == ("Averaging round ended without averaging: AllreduceException: Averaging step "
                                   "failed: could not find a group")
    assert "Traceback" not in caplog.text


def test_debug_keeps_the_traceback_and_bugs_keep_theirs(caplog, hivemind_level):
    hivemind_level(logging.DEBUG)
    record = log_failed_round(AllreduceException("could not find a group"), caplog)
    assert record.levelno == logging.ERROR and record.exc_info is not None
    hivemind_level(logging.INFO)
    record = log_failed_round(KeyError("a bug"), caplog)
    assert record.levelno == logging.ERROR and record.exc_info is not None


def test_importing_the_fixes_installs_the_hook():
    """In a fresh process: in this one, libraries imported by other tests (wandb's exit hooks) wrap the hook."""
    code = ("import sys; import lean_transformer.swarm.hivemind_fixes; "
            "from lean_transformer.swarm.hivemind_fixes import quiet_logs; "
            "assert sys.excepthook is quiet_logs._excepthook, sys.excepthook")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_resource_sharer_that_is_gone_is_one_info_line(caplog, capsys, hivemind_level):
    hivemind_level(logging.INFO)
    try:
        _ResourceSharer.get_connection(("/nonexistent/resource-sharer-socket", b""))  # a peer's sharer that left
    except FileNotFoundError:
        quiet_logs._excepthook(*sys.exc_info())  # what the sharer's thread does through sys.excepthook
    assert "Traceback" not in capsys.readouterr().err
    assert [record.levelno for record in caplog.records] == [logging.INFO]
    assert "FileNotFoundError" in caplog.records[0].getMessage()
    try:
        raise FileNotFoundError("not from the resource sharer")
    except FileNotFoundError:
        quiet_logs._excepthook(*sys.exc_info())
    assert "Traceback" in capsys.readouterr().err


def test_the_dhts_resource_sharer_error_is_one_info_line(caplog, hivemind_level):
    """hivemind's DHT loop logs a sharer that left as an ERROR traceback (``logger.exception``): one INFO line."""
    hivemind_level(logging.INFO)
    quiet_logs.install()
    try:
        _ResourceSharer.get_connection(("/nonexistent/resource-sharer-socket", b""))
    except FileNotFoundError as error:
        logging.getLogger(quiet_logs.DHT_LOGGER).exception(error)  # as hivemind.dht.dht.DHT._run does
    (record,) = caplog.records
    assert record.levelno == logging.INFO and record.exc_info is None and "FileNotFoundError" in record.getMessage()
    caplog.clear()
    try:
        raise FileNotFoundError("not from the resource sharer")
    except FileNotFoundError as error:
        logging.getLogger(quiet_logs.DHT_LOGGER).exception(error)
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None


def test_a_connection_reset_while_receiving_a_request_is_one_info_line(caplog, hivemind_level):
    """hivemind's p2p handler logs a peer's reset mid-request as a WARNING traceback: one INFO line; another error
    there keeps its traceback."""
    hivemind_level(logging.INFO)
    quiet_logs.install()
    for error in ConnectionResetError(104, "Connection reset by peer"), ValueError("a bug"):
        caplog.clear()
        try:
            raise error
        except Exception:
            logging.getLogger(quiet_logs.P2P_LOGGER).warning("Exception while receiving requests:", exc_info=True)
        (record,) = caplog.records
        if isinstance(error, ConnectionResetError):
            assert (record.levelno, record.exc_info) == (logging.INFO, None)
            assert record.getMessage() == ("A peer reset its connection during a request: [Errno 104] Connection "
                                           "reset by peer")
        else:
            assert record.levelno == logging.WARNING and record.exc_info is not None
