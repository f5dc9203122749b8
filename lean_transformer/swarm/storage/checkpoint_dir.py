"""A folder of checkpoints (``epoch-000042/`` ...) that are written atomically and rotated.

A checkpoint is written into a hidden temporary directory, flushed to disk (fsync), then renamed into place, so a
reader sees either the whole checkpoint or none of it, even if the writer is SIGKILLed or the machine loses power.
Old checkpoints are first renamed away (hidden) and only then deleted, for the same reason.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Callable, List, Optional, Tuple

logger = logging.getLogger(__name__)

_CHECKPOINT_NAME = re.compile(r"^epoch-(\d+)$")
_LEFTOVER_NAME = re.compile(r"^\.(tmp|trash)-.*-(\d+)$")  # ends with the writer's pid


def fsync_tree(path: Path) -> None:
    """Flush every file under ``path`` and the directories themselves, so a later rename publishes complete data."""
    for directory, _subdirectories, files in os.walk(path):
        for name in files:
            with open(os.path.join(directory, name), "rb") as file:
                os.fsync(file.fileno())
        _fsync_directory(Path(directory))


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CheckpointDir:
    """Checkpoints named by epoch under ``root``; :meth:`save` keeps the newest ``keep_last`` of them."""

    def __init__(self, root: os.PathLike, keep_last: int):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root, self.keep_last = Path(root), keep_last
        self.root.mkdir(parents=True, exist_ok=True)
        self.remove_leftovers()

    @staticmethod
    def name(epoch: int) -> str:
        return f"epoch-{epoch:06d}"

    def checkpoints(self) -> List[Tuple[int, Path]]:
        """Complete checkpoints as (epoch, path), oldest first."""
        found = []
        for path in self.root.iterdir():
            match = _CHECKPOINT_NAME.match(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def latest(self) -> Optional[Tuple[int, Path]]:
        checkpoints = self.checkpoints()
        return checkpoints[-1] if checkpoints else None

    def save(self, epoch: int, write: Callable[[Path], None]) -> Path:
        """Call ``write(directory)`` to fill a fresh directory, then publish it as the checkpoint of ``epoch``
        (replacing an older checkpoint of the same epoch) and delete checkpoints beyond ``keep_last``."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        target = self.root / self.name(epoch)
        temporary = self.root / f".tmp-{target.name}-{os.getpid()}"
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
        try:
            write(temporary)
            fsync_tree(temporary)
            if target.exists():
                self._discard(target)
            os.rename(temporary, target)
            _fsync_directory(self.root)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
        for _epoch, old in self.checkpoints()[: -self.keep_last]:
            self._discard(old)
        return target

    def _discard(self, checkpoint: Path) -> None:
        trash = self.root / f".trash-{checkpoint.name}-{os.getpid()}"
        os.rename(checkpoint, trash)  # disappears from the listing at once; deleting the files may take a while
        _fsync_directory(self.root)
        shutil.rmtree(trash, ignore_errors=True)

    def remove_leftovers(self) -> None:
        """Delete temporary and discarded directories left behind by writers that were killed."""
        for path in self.root.iterdir():
            match = _LEFTOVER_NAME.match(path.name)
            pid = int(match.group(2)) if match else None
            # our own pid too: nothing is being written yet, and in a container every restart may get the same pid
            if match and path.is_dir() and (pid == os.getpid() or not _pid_alive(pid)):
                logger.info(f"Removing {path}, left behind by an interrupted checkpoint writer")
                shutil.rmtree(path, ignore_errors=True)
