"""The swarm's per-epoch statistics on disk (an append-only JSONL file) and in memory (a bounded window for plots).

The file holds three kinds of rows: the trainers' statistics of an epoch (``SwarmStats``: loss, samples/s, peers), the
validation loss of a checkpoint (``Evaluation``: epoch, validation_loss, time; a row with ``validation_loss``) and the
table of contributors (``PeerSnapshot``: a row with ``peers``). Readers that want one kind filter by those keys."""
from __future__ import annotations

import json
import logging
import os
from collections import deque
from pathlib import Path
from typing import Deque, Iterable, Iterator, Optional, Union

from lean_transformer.swarm.monitoring.aggregation import SwarmStats
from lean_transformer.swarm.monitoring.evaluation import Evaluation
from lean_transformer.swarm.monitoring.peer_table import PeerSnapshot

Row = Union[SwarmStats, Evaluation, PeerSnapshot]

logger = logging.getLogger(__name__)


class RunHistory:
    """Appends one JSON line per epoch (and per evaluation, and per table of contributors) and keeps the last
    ``max_rows`` epochs and evaluations in memory, and the last table (``peers``).

    A restarted peer reopens the same file: earlier rows come back into the plot window and their epochs are not
    logged twice. A line cut short by a crash is skipped when reading and never glued to the next row.
    """

    def __init__(self, path: os.PathLike, max_rows: int = 10_000):
        if max_rows <= 0:
            raise ValueError(f"max_rows must be positive, got {max_rows}")
        self.path = Path(path)
        self.rows: Deque[SwarmStats] = deque(maxlen=max_rows)
        self.evaluations: Deque[Evaluation] = deque(maxlen=max_rows)
        self.peers: Optional[PeerSnapshot] = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            for row in read_history(self.path):
                self._keep(row)
            _terminate_last_line(self.path)

    @property
    def last_epoch(self) -> Optional[int]:
        return self.rows[-1].epoch if self.rows else None

    def append(self, row: Row) -> None:
        with self.path.open("a", encoding="utf-8") as file:
            file.write(json.dumps(row.to_dict()) + "\n")
        self._keep(row)

    def _keep(self, row: Row) -> None:
        if isinstance(row, PeerSnapshot):
            self.peers = row
        else:
            (self.evaluations if isinstance(row, Evaluation) else self.rows).append(row)


def read_history(path: os.PathLike) -> Iterator[Row]:
    """Yield the valid rows of a history file (all kinds, in file order), skipping (and reporting) lines that do
    not parse."""
    with open(path, encoding="utf-8") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                parsed = (Evaluation.from_dict(row) if "validation_loss" in row else
                          PeerSnapshot.from_dict(row) if "peers" in row else SwarmStats.from_dict(row))
            except (ValueError, KeyError, TypeError) as error:
                logger.warning(f"{path}:{line_number}: skipping an unreadable row ({error})")
                continue
            yield parsed


def read_rows(path: os.PathLike) -> Iterable[SwarmStats]:
    """The swarm statistics rows of a history file."""
    return (row for row in read_history(path) if isinstance(row, SwarmStats))


def read_evaluations(path: os.PathLike) -> Iterable[Evaluation]:
    """The evaluation rows of a history file."""
    return (row for row in read_history(path) if isinstance(row, Evaluation))


def read_peer_snapshots(path: os.PathLike) -> Iterable[PeerSnapshot]:
    """The tables of contributors in a history file."""
    return (row for row in read_history(path) if isinstance(row, PeerSnapshot))


def _terminate_last_line(path: Path) -> None:
    with path.open("rb+") as file:
        file.seek(0, os.SEEK_END)
        if file.tell() == 0:
            return
        file.seek(-1, os.SEEK_END)
        if file.read(1) != b"\n":
            file.write(b"\n")
