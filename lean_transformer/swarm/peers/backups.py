"""A trainer's local backups: its state every N epochs (and on exit), written atomically, restored when its
parameters turn non-finite."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Optional

import hivemind
import torch
from transformers import PreTrainedModel

from lean_transformer.swarm.storage.checkpoint_dir import CheckpointDir
from lean_transformer.swarm.storage.training_state import load_training_state, save_training_state

logger = logging.getLogger(__name__)


class NonFiniteParametersError(RuntimeError):
    """The parameters became NaN or infinite (or keep producing non-finite losses) and no usable local backup could
    replace them."""


def parameters_are_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(param).all()) for param in model.parameters())


class LocalBackups:
    """Backups in ``directory/epoch-NNNNNN/`` (the newest ``keep`` of them), one every ``every_epochs`` epochs.

    When the parameters break, the newest backup is restored; if they break again before getting past the epoch where
    they first broke, the next restore goes one backup further back (the newest one may hold parameters that were
    finite but already useless), and when none is left the peer stops with a clear error instead of looping.
    """

    def __init__(self, directory: os.PathLike, every_epochs: int, keep: int,
                 save_tokenizer: Optional[Callable[[Path], None]] = None):
        self.checkpoints = CheckpointDir(directory, keep_last=keep)
        self.every_epochs, self.save_tokenizer = every_epochs, save_tokenizer
        self.restores_in_a_row, self.broken_at_epoch = 0, -1

    @property
    def directory(self) -> Path:
        return self.checkpoints.root

    def save(self, model: PreTrainedModel, optimizer: hivemind.Optimizer, wait_for_averaging: bool = False
             ) -> Optional[Path]:
        """Back up the current state, unless it is non-finite (which would only replace a good backup)."""
        if not parameters_are_finite(model):
            logger.warning("Not backing up non-finite parameters")
            return None
        def write(directory: Path) -> None:
            save_training_state(directory, model, optimizer, wait_for_averaging)
            if self.save_tokenizer is not None:
                self.save_tokenizer(directory)

        path = self.checkpoints.save(optimizer.local_epoch, write)
        logger.info(f"Backed up epoch {optimizer.local_epoch} to {path}")
        return path

    def on_new_epoch(self, model: PreTrainedModel, optimizer: hivemind.Optimizer) -> None:
        """Called once per epoch: restore a backup if the parameters broke, else back up when it is time."""
        if not parameters_are_finite(model):
            self.restore(model, optimizer, reason="parameters became non-finite")
            return
        if optimizer.local_epoch > self.broken_at_epoch:
            self.restores_in_a_row = 0  # got past the epoch where the parameters broke
        if self.every_epochs and optimizer.local_epoch % self.every_epochs == 0:
            self.save(model, optimizer)

    def restore(self, model: PreTrainedModel, optimizer: hivemind.Optimizer, reason: str) -> int:
        """Load a backup because of ``reason`` (e.g. "parameters became non-finite"); returns its epoch."""
        epoch = optimizer.local_epoch
        backups = self.checkpoints.checkpoints()  # oldest first
        if not backups:
            raise NonFiniteParametersError(
                f"{reason} at epoch {epoch} and there is no local backup in {self.directory} "
                f"(--backup_every_epochs); lower --learning_rate or --resume_from a checkpoint")
        if self.restores_in_a_row >= len(backups):
            raise NonFiniteParametersError(
                f"{reason} at epoch {epoch}, again after restoring each of the {len(backups)} local backups in "
                f"{self.directory}; training diverges, lower --learning_rate")
        _, path = backups[-1 - self.restores_in_a_row]
        self.restores_in_a_row += 1
        self.broken_at_epoch = max(self.broken_at_epoch, epoch)
        restored_epoch = load_training_state(path, model, optimizer)
        logger.warning(f"{reason[0].upper()}{reason[1:]} at epoch {epoch}; restored the backup of epoch "
                       f"{restored_epoch} from {path}")
        return restored_epoch
