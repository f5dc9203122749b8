"""Validation loss of the swarm's checkpoints: the model's own loss on held-out batches, which no trainer sees (the
task provides them), next to the trainers' running training loss."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

import torch
from transformers import PreTrainedModel

from lean_transformer.swarm.protocol.settings import Batch


@dataclass(frozen=True)
class Evaluation:
    """The validation loss of the checkpoint of one epoch (``time``: when it was measured)."""

    epoch: int
    validation_loss: float
    time: float

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: Mapping) -> "Evaluation":
        return cls(epoch=int(row["epoch"]), validation_loss=float(row["validation_loss"]), time=float(row["time"]))


@torch.no_grad()
def evaluate(model: PreTrainedModel, batches: Sequence[Batch]) -> float:
    """The mean of the model's loss over ``batches`` (each the mean over its labelled tokens, as in training), in
    eval mode (no dropout) and without gradients; the model's mode is restored afterwards. The loss is computed a
    chunk of tokens at a time (``return_logits=False``), so a large vocabulary never materializes full logits."""
    if not batches:
        raise ValueError("evaluate needs at least one batch")
    was_training = model.training
    device = next(model.parameters()).device
    model.eval()
    try:
        losses = [float(model(**{name: tensor.to(device) for name, tensor in batch.items()},
                              return_logits=False).loss) for batch in batches]
    finally:
        model.train(was_training)
    return math.fsum(losses) / len(losses)
