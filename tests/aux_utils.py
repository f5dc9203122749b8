"""Shared by the aux peer's tests: readers for what it leaves on disk, and peer processes to run a swarm."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def closed_port() -> int:
    """A 127.0.0.1 port nobody listens on (connections to it are refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def assert_valid_png(path: Path) -> None:
    """The file starts with the PNG signature and decodes into a non-empty RGB(A) image."""
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE, f"{path} is not a PNG file"
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100 and image.shape[2] in (3, 4)
    assert image.std() > 0, "the plot is blank"


def wait_for_wandb_history(wandb_dir: Path, rows: int, timeout: float = 30) -> List[dict]:
    """``read_wandb_history`` once it holds ``rows`` rows: wandb's service process may still be writing the file
    when ``finish()`` returns in the logging process (wandb 0.31: the file was empty at that moment in 1 of 5-8
    runs, complete a moment later)."""
    return wait_until(lambda: len(history := read_wandb_history(wandb_dir)) >= rows and history, timeout,
                      f"wandb to write {rows} rows to its offline run file")


def read_wandb_history(wandb_dir: Path) -> List[dict]:
    """The ``wandb.log`` rows stored in the (single) offline run under ``wandb_dir``, decoded from the run's
    ``.wandb`` file (a log of protobuf records in 32 KiB blocks, each chunk with a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    (run_file,) = Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb")
    data, block_size = run_file.read_bytes(), 32 * 1024
    position, pending, rows = 7, b"", []  # the file starts with a 7-byte header (":W&B", magic, version)
    while position + 7 <= len(data):
        left_in_block = block_size - position % block_size
        if left_in_block < 7:  # block padding
            position += left_in_block
            continue
        _checksum, length, chunk_type = struct.unpack("<IHB", data[position : position + 7])
        position += 7
        if chunk_type == 0 and length == 0:  # zero-filled rest of a block
            position += left_in_block - 7
            continue
        pending += data[position : position + length]
        position += length
        if chunk_type in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


# ---------------------------------------------------------------- peer processes

REPO = Path(__file__).resolve().parent.parent


def wait_until(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.2):
    """Poll ``condition`` until it returns something truthy (returned) or fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


class PeerProcess:
    """A peer in its own process and session (so that stopping it also stops hivemind's child processes and the p2p
    daemon), with stdout and stderr captured in files under ``log_dir``."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path, env: Optional[dict] = None):
        self.name = name
        self.stdout_path, self.stderr_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
        with self.stdout_path.open("wb") as stdout, self.stderr_path.open("wb") as stderr:
            self.process = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=stdout, stderr=stderr,
                                            env={**os.environ, **(env or {})}, start_new_session=True)

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float, stream: str = "stderr") -> re.Match:
        """The first match of ``pattern`` in the output; fails early (with the output's tail) if the peer exits."""

        def find():
            match = re.search(pattern, getattr(self, stream), re.MULTILINE)
            if match is None and self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited with code {self.process.returncode} before printing "
                                     f"{pattern!r}:\n{self.stderr[-3000:]}")
            return match

        return wait_until(find, timeout, f"{self.name} to print {pattern!r}")

    def initial_peers(self, timeout: float = 60) -> List[str]:
        return self.wait_for(r"^--initial_peers (.+)$", timeout, stream="stdout").group(1).split()

    def stop(self, timeout: float = 40) -> int:
        """SIGTERM, then wait for a graceful exit; returns the exit code."""
        self.terminate()
        return self.wait(timeout)

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        """The exit code; if the peer does not exit in time, its whole session is killed and the test fails."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} did not exit within {timeout:g} s:\n{self.stderr[-3000:]}") from None
        finally:
            self.kill_leftovers()

    def kill(self) -> None:
        """SIGKILL the peer's main process, then whatever it left behind."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.kill_leftovers()

    def kill_leftovers(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stop_all(peers: Sequence[PeerProcess], timeout: float = 40) -> List[int]:
    """SIGTERM every peer at once, then collect their exit codes."""
    for peer in peers:
        peer.terminate()
    return [peer.wait(timeout) for peer in peers]
