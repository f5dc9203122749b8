"""Peer processes forked from a Python that has already imported torch, hivemind and transformers.

Every peer process of the suite (~200) would otherwise spend ~6 s of CPU on the same imports before it does anything
(``transformers.modeling_utils`` alone pulls in ``torch.distributed.tensor`` and sympy): ~15 CPU-minutes on a 2-core
CI machine, during which the swarm tests' peers start seconds apart. A preloaded server does the imports once per test
session; each peer is then a fork of it: a real process of its own (own pid, session, files, signals, exit code) that
runs the same script as ``__main__`` with the same argv, cwd and environment, and exits through the interpreter's
normal shutdown (atexit, multiprocessing's children). It differs from ``python SCRIPT`` only in what was imported
before ``__main__`` ran, so commands that test start-up itself (a wheel's entry points, bad flags, the demo) run
through ``subprocess.Popen`` as users run them, and ``LEAN_TEST_PRELOAD=0`` runs every peer that way.

:func:`popen` is a drop-in for ``subprocess.Popen`` as :class:`PeerProcess` calls it. The imports read the
environment (``HF_ENDPOINT``, ``OMP_NUM_THREADS``, ...), so there is a server per environment: a command whose
environment differs from every running server's in anything but RUN_TIME_VARIABLES starts a new one. A command that
does not run this Python (``ip netns exec ...``) goes to ``subprocess.Popen``.

The server: ``python tests/preloaded.py SOCKET`` listens on a unix socket. A request is a JSON line with the argv,
cwd and environment, and the stdin/stdout/stderr file descriptors (SCM_RIGHTS); the reply is the child's pid, then,
on the same connection, its exit code as Popen reports it (negative: the signal that ended it). The server exits when
its parent (the test session) does.
"""
from __future__ import annotations

import atexit
import gc
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
PRELOAD = ("torch", "numpy", "hivemind", "transformers.modeling_utils", "lean_transformer.models",
           "lean_transformer.swarm.peers.trainer", "lean_transformer.swarm.peers.aux_peer", "run_trainer",
           "run_aux_peer")
# variables no preloaded module reads: pytest's note of the running test, and those the tests' own peer scripts
# (tests/slow_trainer.py, ...) read at run time; a child gets them all the same
RUN_TIME_VARIABLES = frozenset({"PYTEST_CURRENT_TEST", "SLOW_BATCH_SECONDS", "SLOW_FSYNC_SECONDS", "RENDEZVOUS",
                               "SWARM_PEERS"})
# what the tests give their peers: one torch thread (tiny models, several peers on 2 busy cores), the repository
# importable
PEER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
START_TIMEOUT = 120.0


# ---------------------------------------------------------------- the server (its own process)


def serve(socket_path: str) -> None:
    """Accepts requests until the parent exits; forks a child per request and reports each one's exit code."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    print("ready", flush=True)
    children: Dict[int, socket.socket] = {}
    while os.getppid() == parent:
        if select.select([listener], [], [], 0.05)[0]:
            connection, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                for other in (listener, *children.values()):
                    other.close()
                run_child(json.loads(message), fds, connection)  # never returns: the child exits from __main__
            for fd in fds:
                os.close(fd)
            connection.sendall(f"{pid}\n".encode())
            children[pid] = connection
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = children.pop(pid)
            try:
                connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # its client has gone
            connection.close()


def own_hivemind_locks() -> None:
    """hivemind makes process-wide multiprocessing locks when it is imported (MPFuture's, its async context
    executor's): a Python's processes share them by design, but forked from one server every peer of the session would
    share them, and a peer killed while holding one (the tests SIGKILL peers mid-round) would block every later peer
    forever (seen: a DHT process stuck in ``MPFuture._send_update`` for minutes). Each child makes its own."""
    import multiprocessing  # noqa: PLC0415

    from hivemind.utils.asyncio import _AsyncContextWrapper  # noqa: PLC0415 (preloaded)
    from hivemind.utils.mpfuture import MPFuture  # noqa: PLC0415

    MPFuture.reset_backend()  # MPFuture's and SharedBytes' locks
    _AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()


def run_child(request: dict, fds: List[int], connection: socket.socket) -> None:
    """Becomes ``python *argv`` in a new session, with the request's files, cwd and environment."""
    connection.close()
    if request["new_session"]:
        os.setsid()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
    for fd in set(fds):
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import numpy  # noqa: PLC0415 (preloaded)

    numpy.random.seed()  # numpy's global generator is not reseeded at fork (Python's random is)
    own_hivemind_locks()
    # the imports' objects back under the collector for the interpreter's shutdown (registered first: runs last), as
    # in any Python: left frozen, triton's nanobind bindings report them as leaked (27 lines on every exit)
    atexit.register(gc.unfreeze)
    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)


# ---------------------------------------------------------------- the client (the test session)


class ForkedProcess:
    """What the suite uses of ``subprocess.Popen`` for a child of the server: pid, poll, wait, signals, stdin, and
    stdout/stderr pipes read by :meth:`communicate`."""

    def __init__(self, args: Sequence[str], connection: socket.socket, stdin: Optional[int], stdout: Optional[int],
                 stderr: Optional[int], text: bool):
        self.args, self._connection, self.returncode, self._text = list(args), connection, None, text
        self._buffer = b""
        self.stdin = os.fdopen(stdin, "wb") if stdin is not None else None
        self._pipes = {name: fd for name, fd in (("stdout", stdout), ("stderr", stderr)) if fd is not None}
        self._read: Dict[str, bytearray] = {name: bytearray() for name in self._pipes}
        pid = self._read_line(START_TIMEOUT)
        if pid is None:
            raise RuntimeError(f"the preloaded server did not fork {self.args} within {START_TIMEOUT:g} s")
        self.pid = int(pid)

    def _read_line(self, timeout: Optional[float]) -> Optional[str]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._connection], [], [], left)[0]:
                return None
            chunk = self._connection.recv(64)
            if not chunk:
                raise RuntimeError(f"the preloaded server went away before reporting on {self.args}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            line = self._read_line(0)
            if line is not None:
                self.returncode = int(line)
                self._connection.close()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            line = self._read_line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(line)
            self._connection.close()
        return self.returncode

    def communicate(self, timeout: Optional[float] = None) -> Tuple[Any, Any]:
        """Reads the pipes to their end, then waits for the exit; TimeoutExpired keeps what was read for the next
        call, as Popen's does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pipes:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for fd in select.select(list(self._pipes.values()), [], [], left)[0]:
                name = next(name for name, each in self._pipes.items() if each == fd)
                chunk = os.read(fd, 1 << 16)
                self._read[name] += chunk
                if not chunk:
                    os.close(self._pipes.pop(name))
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        output = {name: bytes(data).decode() if self._text else bytes(data) for name, data in self._read.items()}
        return output.get("stdout"), output.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Server:
    """A preloaded server process of this test session: one per environment (the imports read theirs), started on
    first use and kept until the session ends."""

    _lock = threading.Lock()
    _servers: Dict[frozenset, "Server"] = {}

    def __init__(self, env: Dict[str, str]):
        self.owner = os.getpid()  # a fork of the test session (a test's in-process hivemind) runs its atexit too
        self.directory = tempfile.mkdtemp(prefix="lean-preloaded-")
        self.socket_path = os.path.join(self.directory, "socket")
        self.process = subprocess.Popen([sys.executable, __file__, self.socket_path], cwd=REPO, env=env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        if not select.select([self.process.stdout], [], [], START_TIMEOUT)[0] or \
                self.process.stdout.readline() != b"ready\n":
            self.process.kill()
            raise RuntimeError(f"the preloaded server did not start within {START_TIMEOUT:g} s")
        atexit.register(self.close)

    @classmethod
    def get(cls, env: Dict[str, str]) -> "Server":
        """The server for ``env``; a new one for an environment that differs from every running server's in a
        variable an import may read (anything but RUN_TIME_VARIABLES: pytest's PYTEST_CURRENT_TEST changes with every
        test)."""
        env = {name: value for name, value in env.items() if name not in RUN_TIME_VARIABLES}
        with cls._lock:
            key = frozenset(env.items())
            if key not in cls._servers:
                cls._servers[key] = cls(env)
            return cls._servers[key]

    def close(self) -> None:
        if os.getpid() != self.owner:
            return
        self.process.kill()
        self.process.wait(10)
        Path(self.socket_path).unlink(missing_ok=True)
        os.rmdir(self.directory)

    def spawn(self, args: Sequence[str], cwd: Path, env: Dict[str, str], stdin, stdout, stderr, text: bool,
              new_session: bool) -> ForkedProcess:
        child_fds, kept = [], {}  # the child's stdin, stdout, stderr; our ends of its pipes
        for name, target in (("stdin", stdin), ("stdout", stdout), ("stderr", stderr)):
            if target == subprocess.PIPE:
                read, write = os.pipe()
                child_fds.append(read if name == "stdin" else write)
                kept[name] = write if name == "stdin" else read
            elif target == subprocess.STDOUT:
                child_fds.append(child_fds[1])
            elif target is None or target == subprocess.DEVNULL:
                child_fds.append(os.open(os.devnull, os.O_RDONLY if name == "stdin" else os.O_WRONLY))
            else:
                child_fds.append(os.dup(target.fileno()))
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(self.socket_path)
            request = {"argv": list(args[1:]), "cwd": str(cwd), "env": env, "new_session": new_session}
            socket.send_fds(connection, [json.dumps(request).encode()], child_fds)
        finally:
            for fd in set(child_fds):
                os.close(fd)
        return ForkedProcess(args, connection, kept.get("stdin"), kept.get("stdout"), kept.get("stderr"), text)


def popen(args: Sequence[str], *, cwd: Optional[Path] = None, env: Optional[Dict[str, str]] = None, stdin=None,
          stdout=None, stderr=None, text: bool = False, start_new_session: bool = False):
    """``subprocess.Popen(args, ...)``: forked from the preloaded server of ``env`` if ``args`` runs this Python."""
    env = dict(os.environ if env is None else env)
    if args[0] == sys.executable and os.environ.get("LEAN_TEST_PRELOAD", "1") != "0":
        return Server.get(env).spawn(args, cwd or Path.cwd(), env, stdin, stdout, stderr, text, start_new_session)
    return subprocess.Popen(args, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                            start_new_session=start_new_session)


def run(args: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None,
        cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True, timeout=timeout, ...)`` through :func:`popen`."""
    process = popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
    return subprocess.CompletedProcess(list(args), process.returncode, stdout, stderr)


def run_side_by_side(script: str, variants: Sequence[str], timeout: float = 120) -> List[Tuple[dict, str]]:
    """``python SCRIPT VARIANT`` for each of ``variants``, all at the same time, each in its own process with the
    peers' environment: the JSON object each printed last, with its stderr. One that fails fails the test, with the
    tail of its stderr."""
    env = dict(os.environ, **PEER_ENV)
    processes = [popen([sys.executable, script, variant], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       env=env) for variant in variants]
    results = []
    for process in processes:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        finally:
            process.kill()
        assert process.returncode == 0, stderr[-3000:]
        results.append((json.loads(stdout.strip().splitlines()[-1]), stderr))
    return results


if __name__ == "__main__":
    import importlib

    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            if module not in ("run_trainer", "run_aux_peer"):  # the repository's scripts: on PYTHONPATH or not
                raise
    gc.freeze()  # the imports' objects: out of the children's collections while they run (copied on write otherwise)
    serve(sys.argv[1])
