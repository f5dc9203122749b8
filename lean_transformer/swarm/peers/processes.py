"""Peers as processes on this machine, for the programs that run swarms: the local demo, the benchmarks, the tests.

:class:`PeerProcess` starts a peer command in its own session (so that stopping it stops hivemind's children and the
p2p daemon too), with its output in files and its events (:mod:`lean_transformer.swarm.monitoring.events`) in
``NAME.events.jsonl`` beside them; :meth:`PeerProcess.wait_for_event` waits for what the peer reports, failing early
with the log's tail if it exits. :class:`ProcessTracker` remembers every process below a root and the hivemind
sockets and torch shared-memory files they leave, so that nothing of a swarm outlives its run. :func:`wait_until` is the
one bounded wait. Process trees come from psutil.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TypeVar

import psutil

from lean_transformer.swarm.monitoring.events import EventReader, read_events

HIVEMIND_SOCKET_PREFIX = "/tmp/hivemind-"  # where hivemind's p2p daemon and clients put their unix sockets
TORCH_SHM_DIR = "/dev/shm"  # torch's shared-memory tensors (hivemind's averagers share theirs): torch_PID_*

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.2,
               peers: Sequence["PeerProcess"] = ()) -> T:
    """Poll ``condition`` until it returns something truthy (returned); TimeoutError after ``timeout`` seconds, or
    PeerExited (with its log's tail) as soon as one of ``peers``, which the condition needs running, has exited."""
    deadline = time.monotonic() + timeout
    while True:
        exited = next((peer for peer in peers if peer.process.poll() is not None), None)  # before the condition
        result = condition()
        if result:
            return result
        if exited is not None:
            raise PeerExited(f"{exited.name} exited with code {exited.process.returncode} while waiting for {what}:"
                             f"\n{exited.log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


class PeerExited(RuntimeError):
    """The peer exited while something waited for it."""


class PeerProcess:
    """``[*argv_prefix, this Python, *argv]`` in its own session, cwd ``cwd``, stderr in ``LOG_DIR/NAME.err`` and stdout
    in ``LOG_DIR/NAME.out`` (or both in ``LOG_DIR/NAME.log`` with ``merge_output``). With ``events`` (a trainer or
    an aux peer), ``--events_path LOG_DIR/NAME.events.jsonl`` is appended to ``argv``. ``argv_prefix`` runs it
    through another command, e.g. ``ip netns exec NS``. With ``stdin``, :meth:`send` writes lines to its stdin.
    ``popen`` starts it (the tests fork theirs from a Python that has the peers' imports done: tests/preloaded.py)."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path, env: Optional[Mapping[str, str]] = None, *,
                 cwd: Optional[Path] = None, argv_prefix: Sequence[str] = (), events: bool = True,
                 merge_output: bool = False, stdin: bool = False, popen: Callable[..., Any] = subprocess.Popen):
        self.name, log_dir = name, Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        if merge_output:
            self.stdout_path = self.stderr_path = log_dir / f"{name}.log"
        else:
            self.stdout_path, self.stderr_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
        self.events_path = log_dir / f"{name}.events.jsonl"
        argv = [*argv, "--events_path", str(self.events_path)] if events else list(argv)
        with self.stdout_path.open("ab") as stdout, self.stderr_path.open("ab") as stderr:
            self.process = popen([*argv_prefix, sys.executable, *argv], cwd=cwd,
                                 stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                 stdout=stdout, stderr=subprocess.STDOUT if merge_output else stderr,
                                 env={**os.environ, **(env or {})}, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self.process.poll()

    @property
    def stdout(self) -> str:
        return _read(self.stdout_path)

    @property
    def stderr(self) -> str:
        return _read(self.stderr_path)

    def log_tail(self, characters: int = 3000) -> str:
        return self.stderr[-characters:]

    def events(self, name: Optional[str] = None) -> List[dict]:
        """Every event the peer has written so far (or those named ``name``), oldest first."""
        return read_events(self.events_path, name)

    def wait_for_event(self, name: str, predicate: Callable[[dict], bool] = lambda _: True, timeout: float = 60,
                       ) -> dict:
        """The first event ``name`` that satisfies ``predicate``; PeerExited (with the log's tail) if the peer exits
        first, TimeoutError after ``timeout`` seconds."""
        reader = EventReader(self.events_path)

        def find() -> Optional[dict]:
            exited = self.process.poll() is not None  # before reading: a last event is read after the exit
            found = next((event for event in reader.new(name) if predicate(event)), None)
            if found is None and exited:
                raise PeerExited(f"{self.name} exited with code {self.process.returncode} before the event "
                                 f"{name!r}:\n{self.log_tail()}")
            return found

        return wait_until(find, timeout, f"{self.name}'s event {name!r}", interval=0.05)

    def wait_for(self, pattern: str, timeout: float, stream: str = "stderr") -> re.Match:
        """The first match of ``pattern`` in the output (for what is written for people: errors, the --initial_peers
        line); PeerExited if the peer exits first."""

        def find() -> Optional[re.Match]:
            exited = self.process.poll() is not None
            match = re.search(pattern, getattr(self, stream), re.MULTILINE)
            if match is None and exited:
                raise PeerExited(f"{self.name} exited with code {self.process.returncode} before printing "
                                 f"{pattern!r}:\n{self.log_tail()}")
            return match

        return wait_until(find, timeout, f"{self.name} to print {pattern!r}")

    def initial_peers(self, timeout: float = 60) -> List[str]:
        """The addresses other peers join through (its ``joined`` event)."""
        return self.wait_for_event("joined", timeout=timeout)["initial_peers"]

    def send(self, line: str) -> None:
        """Write ``line`` to the peer's stdin (started with ``stdin=True``); OSError if it has exited."""
        self.process.stdin.write(line.encode() + b"\n")
        self.process.stdin.flush()

    def terminate(self) -> None:
        """SIGTERM to the peer itself (not its group): it leaves the swarm and stops its hivemind processes."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        """The exit code; if the peer does not exit in time, its whole session is killed and TimeoutError raised."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"{self.name} did not exit within {timeout:g} s:\n{self.log_tail()}") from None
        finally:
            self.kill_leftovers()

    def stop(self, timeout: float = 40) -> int:
        """SIGTERM, then wait for a graceful exit (see :meth:`wait`); returns the exit code."""
        self.terminate()
        return self.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the peer's main process, then whatever it left behind in its session."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.kill_leftovers()

    def kill_leftovers(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def stop_all(peers: Sequence[PeerProcess], timeout: float = 40) -> List[int]:
    """SIGTERM every peer at once, then collect their exit codes."""
    for peer in peers:
        peer.terminate()
    return [peer.wait(timeout) for peer in peers]


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


# ---------------------------------------------------------------- process trees


def descendant_pids(pid: int) -> List[int]:
    """All processes below ``pid`` (children first; none if ``pid`` is gone)."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def start_time(pid: int) -> Optional[float]:
    """The start time of a living (not zombie) process ``pid``, which tells it apart from a later one with its pid."""
    try:
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
    except psutil.NoSuchProcess:
        return None


def hivemind_sockets(pids: Sequence[int]) -> set[str]:
    """Paths of the hivemind unix sockets that ``pids`` hold open, each read in its own network namespace (from
    /proc/PID/net/unix: psutil reads only this process's namespace)."""
    paths = set()
    for pid in pids:
        try:
            inodes = {os.readlink(entry.path)[len("socket:["):-1] for entry in os.scandir(f"/proc/{pid}/fd")
                      if os.readlink(entry.path).startswith("socket:[")}
            rows = [line.split() for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]]
        except OSError:
            continue  # exited meanwhile, or not ours to read
        paths |= {row[7] for row in rows
                  if len(row) >= 8 and row[6] in inodes and row[7].startswith(HIVEMIND_SOCKET_PREFIX)}
    return paths


def torch_shared_memory(pids: Sequence[int]) -> List[Path]:
    """The torch shared-memory files that processes ``pids`` created (a killed peer leaves its averagers' tensors,
    hundreds of MB, in /dev/shm)."""
    return [path for pid in pids for path in Path(TORCH_SHM_DIR).glob(f"torch_{pid}_*")]


class ProcessTracker:
    """Remembers every process below ``root_pid`` (default: this one) and the hivemind socket files they hold, at
    each :meth:`scan` (or every ``interval`` s between :meth:`watch` and :meth:`stop_watching`), so that afterwards
    nothing of them is left: no process that escaped its group, no socket file in /tmp (hivemind leaves its clients'
    sockets behind even when it shuts down cleanly), no torch shared-memory file of theirs."""

    def __init__(self, root_pid: Optional[int] = None):
        self.root_pid = os.getpid() if root_pid is None else root_pid
        self.processes: Dict[int, float] = {}  # pid -> start time (to tell a recycled pid apart)
        self.sockets: set[str] = set()
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def scan(self) -> None:
        pids = descendant_pids(self.root_pid)
        for pid in pids:
            started = start_time(pid)
            if started is not None:
                self.processes.setdefault(pid, started)
        self.sockets |= hivemind_sockets(pids)

    def watch(self, interval: float = 0.3) -> "ProcessTracker":
        """Scan now, then every ``interval`` s in a background thread until :meth:`stop_watching`."""
        self.scan()
        self._stopped.clear()
        self._thread = threading.Thread(target=self._watch, args=(interval,), name="process-tracker", daemon=True)
        self._thread.start()
        return self

    def _watch(self, interval: float) -> None:
        while not self._stopped.wait(interval):
            self.scan()

    def stop_watching(self) -> "ProcessTracker":
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(10)
        return self

    def alive(self) -> List[int]:
        return [pid for pid, started in self.processes.items() if start_time(pid) == started]

    def leftover_sockets(self) -> List[str]:
        return [path for path in self.sockets if os.path.exists(path)]

    def leftover_shared_memory(self) -> List[Path]:
        return torch_shared_memory(list(self.processes))

    def clean_up(self, timeout: float = 10.0) -> None:
        """SIGKILL the processes still alive and wait (up to ``timeout`` s) until they are gone; remove the socket
        and shared-memory files they left."""
        for pid in self.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        for path in [*self.leftover_sockets(), *self.leftover_shared_memory()]:
            Path(path).unlink(missing_ok=True)
