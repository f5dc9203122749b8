"""Shared by the aux peer's tests: readers for what it leaves on disk, and peer processes to run a swarm."""
from __future__ import annotations

import json
import socket
import struct
from pathlib import Path
from typing import List, Optional, Sequence

from lean_transformer.swarm.peers.processes import PeerProcess, stop_all, wait_until  # noqa: F401 (imported from here)
from preloaded import PEER_ENV, popen

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
    """The ``wandb.log`` rows stored in the (single) offline run under ``wandb_dir``, so far."""
    (run_file,) = Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb")
    return parse_wandb_history(run_file.read_bytes())


def parse_wandb_history(data: bytes) -> List[dict]:
    """The ``wandb.log`` rows of a run's ``.wandb`` file (a log of protobuf records in 32 KiB blocks, each chunk
    with a 7-byte header), read up to its last whole chunk: wandb's service process may be writing the next one
    (CI: a record cut short there failed to parse)."""
    from wandb.proto import wandb_internal_pb2

    block_size = 32 * 1024
    position, pending, rows = 7, b"", []  # the file starts with a 7-byte header (":W&B", magic, version)
    while position + 7 <= len(data):
        left_in_block = block_size - position % block_size
        if left_in_block < 7:  # block padding
            position += left_in_block
            continue
        _checksum, length, chunk_type = struct.unpack("<IHB", data[position : position + 7])
        if chunk_type == 0 and length == 0:  # zero-filled rest of a block
            position += left_in_block
            continue
        if position + 7 + length > len(data):  # the chunk being written
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
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


def start_peer(name: str, argv: Sequence[str], log_dir: Path, env: Optional[dict] = None, **options) -> PeerProcess:
    """A peer process with the tests' environment (one torch thread: PEER_ENV), started from the repository's root
    (where run_trainer.py and tests/ are), forked from the preloaded server where it can be (tests/preloaded.py);
    ``options`` as :class:`PeerProcess` takes them (``events=False`` for a command that is not a trainer or an aux
    peer)."""
    return PeerProcess(name, argv, log_dir, {**PEER_ENV, **(env or {})}, cwd=REPO, popen=popen, **options)
