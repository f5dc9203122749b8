"""Ctrl+C / SIGTERM for a long-running peer: stop gracefully, but always within a bounded time.

The first signal asks the loop to stop after the current step (the peer then leaves the swarm cleanly) and arms a
watchdog. A fifth of the time budget later, if the peer is still busy (typically waiting in an averaging round whose
partners are gone), the watchdog calls ``on_overdue`` (the trainer cancels the rounds in flight). If the graceful
exit has not finished when the budget is spent, or if a second signal arrives, the step is abandoned: this process's
children (hivemind's DHT and averager processes and their p2p daemons) are terminated, the torch shared memory of
the peer's processes is removed, and the process exits with code 0, or with code 1 if it was inside a
:meth:`GracefulShutdown.critical` section (e.g. writing its final backup), whose work is then lost: a supervisor
(Docker's ``--stop-timeout``, systemd) must give a peer more time than ``--shutdown_timeout``. The abandoning thread
ends the peer's event stream with its ``shutdown`` event; what the main loop raises meanwhile (its calls into the
hivemind processes being terminated under it: "Broken pipe") is a consequence of that ending, not an error:
:func:`errors_wait_for_an_ending` lets the ending thread's exit stand.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, List, NoReturn, Optional

from lean_transformer.swarm.monitoring.events import close_events, emit
from lean_transformer.swarm.peers.processes import descendant_pids, torch_shared_memory

logger = logging.getLogger(__name__)


def terminate_descendants(grace: float = 2.0) -> List[int]:
    """SIGTERM every descendant of this process, then SIGKILL those still alive after ``grace`` seconds; returns
    their pids."""
    pids = descendant_pids(os.getpid())
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.05)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


class GracefulShutdown:
    """Install with ``GracefulShutdown(timeout)`` in the main thread; poll ``.requested`` in the loop; optionally set
    ``.on_overdue`` (called from the watchdog's thread)."""

    def __init__(self, timeout: float, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)):
        self.timeout = timeout
        self.requested = threading.Event()
        self.on_overdue: Optional[Callable[[], None]] = None
        self._critical: Optional[str] = None
        self._owner_pid = os.getpid()
        for signum in signals:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        if os.getpid() != self._owner_pid:  # a forked child inherited the handler: behave as if it had none
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        name = signal.Signals(signum).name
        if self.requested.is_set():
            self.abandon(f"second {name}")
        self.requested.set()
        logger.info(f"Caught {name}: finishing the current step and leaving the swarm (at most {self.timeout:g} s; "
                    f"send it again to stop at once)")
        threading.Thread(target=self._watchdog, name="shutdown-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        time.sleep(self.timeout / 5)
        if self.on_overdue is not None:
            self.on_overdue()
        time.sleep(self.timeout * 4 / 5)
        self.abandon(f"graceful shutdown took longer than {self.timeout:g} s")

    @contextlib.contextmanager
    def critical(self, what: str) -> Iterator[None]:
        """Work whose abandonment loses data: if the watchdog or a second signal abandons it, the exit code is 1."""
        self._critical = what
        try:
            yield
        finally:
            self._critical = None

    def abandon(self, reason: str) -> None:
        emit("shutdown", reason="signal", epoch=None, clean=False)
        close_events()  # the stream ends here: not with the errors of a loop whose processes are stopped under it
        if self._critical is not None:
            logger.error(f"Abandoning the {self._critical} unfinished ({reason}); it is lost. Give the peer more "
                         f"time to stop (--shutdown_timeout, and a supervisor's stop timeout above it)")
            exit_now(1)
        logger.warning(f"Abandoning the current step ({reason}); stopping hivemind's processes")
        exit_now(0)


_ENDING = threading.Lock()  # held by the thread that ends this process at once (exit_now)


def exit_now(code: int) -> NoReturn:
    """Stop this process's children and exit at once, whatever the other threads are doing (hivemind's threads can
    keep an interpreter from exiting after an error in the main thread), removing their torch shared-memory files. If
    another thread is already doing so, wait for its exit: its code stands."""
    if not _ENDING.acquire(blocking=False):
        threading.Event().wait()
    stopped = terminate_descendants()
    # torch unlinks a shared tensor's file (hivemind's file_system strategy: /dev/shm/torch_PID_*) only as the tensor
    # is freed, which neither this exit nor a SIGKILL does: left, the averagers' tensors would hold RAM until reboot
    for path in torch_shared_memory([os.getpid(), *stopped]):
        with contextlib.suppress(OSError):
            path.unlink()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def errors_wait_for_an_ending() -> Iterator[None]:
    """Around a peer's main loop: an exception that escapes it while another thread ends the process at once
    (:func:`exit_now`; the shutdown watchdog terminating this peer's hivemind processes under the loop) waits for that
    exit instead of being reported: seen in benchmarks/internet.py, where a trainer abandoned after 25 s logged
    "Unexpected error, stopping" with a traceback ending in "RuntimeError: Broken pipe", and could exit with 1."""
    try:
        yield
    except BaseException:
        if _ENDING.locked():
            threading.Event().wait()
        raise


def exit_after_clean_shutdown(code: int) -> NoReturn:
    """End a peer's process as a normal exit does (non-daemon threads joined, exit handlers run, streams flushed),
    but without the interpreter's finalization, whatever daemon threads are doing.

    What is wrong upstream: CPython before 3.14 ends a daemon thread that wants the GIL back once finalization has
    begun with ``pthread_exit``; if that thread is inside C++ code (a torch op of hivemind's thread that serves this
    peer's state, say), the unwinding meets a ``noexcept`` frame and the process aborts ("terminate called without an
    active exception", exit code -6) after a clean shutdown. Seen once in the local demo's test, a trainer leaving
    after SIGTERM; reproduced by ``tests/test_shutdown.py`` with a daemon thread in a torch loop. Fixed in CPython
    3.14 (gh-87135: such threads hang instead); this can go when 3.14 is the oldest Python we support.
    """
    threading._shutdown()  # the interpreter's first exit step: join the non-daemon threads
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
