"""What a checkpoint of a swarm peer holds, and how it goes back into a running model and swarm optimizer.

A checkpoint directory has the model in ``save_pretrained`` format (safetensors; loadable on its own with
``from_pretrained``) and ``training_state.pt`` with the optimizer's state (LAMB statistics), the LR scheduler's state
and the epoch, plus the optimizer's own ``checkpoint_state()`` (in DiLoCo mode the outer state: anchor and outer
momentum). Writing it atomically is the job of
``CheckpointDir`` (fill a temporary directory, then rename).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
from transformers import PreTrainedModel

if TYPE_CHECKING:
    from lean_transformer.swarm.averaging.optimizer import SwarmOptimizer

TRAINING_STATE_FILE = "training_state.pt"
_EPOCH_IN_NAME = re.compile(r"(\d+)$")


def save_training_state(directory: os.PathLike, model: PreTrainedModel, optimizer: SwarmOptimizer,
                        wait_for_averaging: bool = False) -> None:
    """Write the model and the optimizer/scheduler/epoch state into ``directory`` (which should be fresh).

    Background work that has finished is applied first. A state-averaging round still in flight is waited for only
    with ``wait_for_averaging``: it needs other peers and may take up to --averaging_timeout, during which a
    training peer would stop contributing.
    """
    directory = Path(directory)
    averager = optimizer.state_averager
    averager.step(wait_for_delayed_updates=wait_for_averaging)
    with averager.lock_optimizer:  # a delayed optimizer step (--delay_optimizer_step) may be running meanwhile
        model.save_pretrained(directory, safe_serialization=True)
        torch.save(dict(epoch=optimizer.local_epoch, optimizer=averager.optimizer.state_dict(),
                        scheduler=averager.scheduler.state_dict() if averager.scheduler is not None else None,
                        **optimizer.checkpoint_state()),
                   directory / TRAINING_STATE_FILE)


def read_epoch(directory: os.PathLike) -> int:
    """The epoch of a checkpoint, without loading the model."""
    return int(torch.load(Path(directory) / TRAINING_STATE_FILE, map_location="cpu", weights_only=True)["epoch"])


@torch.no_grad()
def load_training_state(directory: os.PathLike, model: PreTrainedModel, optimizer: SwarmOptimizer) -> int:
    """Load a checkpoint into a running model and optimizer (including the optimizer's offloaded copy of the
    parameters, which is what newcomers download and what the next optimizer step starts from); returns its epoch.

    Raises ValueError if the checkpoint does not fit the model or the optimizer.
    """
    directory = Path(directory)
    averager = optimizer.state_averager
    averager.step(wait_for_delayed_updates=True)  # nothing running in the background may overwrite what we load
    try:
        loaded = type(model).from_pretrained(directory)  # resolves tied and sharded weights
        model.load_state_dict(loaded.state_dict())
    except (OSError, RuntimeError, ValueError) as e:
        raise ValueError(f"{directory} does not hold a checkpoint of this model: {str(e).splitlines()[0]}") from None
    del loaded
    state = torch.load(directory / TRAINING_STATE_FILE, map_location="cpu", weights_only=True)
    offloaded = [param for group in averager.optimizer.param_groups for param in group["params"]]
    for main_param, offloaded_param in zip(averager.main_parameters, offloaded):
        if offloaded_param is not main_param:
            offloaded_param.copy_(main_param)
    try:
        averager.optimizer.load_state_dict(state["optimizer"])
        if averager.scheduler is not None and state["scheduler"] is not None:
            averager.scheduler.load_state_dict(state["scheduler"])
    except (KeyError, ValueError, RuntimeError) as e:
        raise ValueError(f"{directory}: optimizer state does not fit this optimizer ({e})") from None
    try:
        optimizer.load_checkpoint_state(state)  # DiLoCo: restart from the checkpoint's anchor
    except ValueError as e:
        raise ValueError(f"{directory}: outer state does not fit this model ({e})") from None
    averager.local_epoch = int(state["epoch"])
    if optimizer.grad_averager is not None:
        optimizer.grad_averager.reset_accumulated_grads_()  # gradients computed with the old parameters
    optimizer.tracker.report_local_progress(optimizer.local_epoch, samples_accumulated=0)
    return optimizer.local_epoch


def find_checkpoint(path: os.PathLike) -> Optional[Path]:
    """``path`` itself if it is a checkpoint, else its newest checkpoint subdirectory (by the number ending its
    name, e.g. ``epoch-000042``), else None."""
    path = Path(path)
    if (path / TRAINING_STATE_FILE).is_file():
        return path
    candidates = [(int(match.group(1)), child) for child in path.iterdir() if not child.name.startswith(".")
                  and (child / TRAINING_STATE_FILE).is_file() and (match := _EPOCH_IN_NAME.search(child.name))]
    return max(candidates)[1] if candidates else None
