"""Exact accounting of the activations autograd keeps for backward."""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import Tensor


class SavedTensorCounter:
    """Records every storage saved for backward while active, each storage once, ignoring ``exclude`` (e.g.
    parameters, which are kept anyway). ``nbytes`` is what the activations of the recorded pass cost."""

    def __init__(self, exclude: Iterable[Tensor] = ()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}

    def _pack(self, tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._excluded:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @contextlib.contextmanager
    def record(self) -> Iterator["SavedTensorCounter"]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield self

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())
