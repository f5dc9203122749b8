"""Feed-forward activations; gated variants take a doubled pre-activation and split it into gate and value."""
from __future__ import annotations

import functools
from typing import Callable

import torch.nn.functional as F
from torch import Tensor

from lean_transformer.config import ACTIVATIONS, GATED_ACTIVATIONS

Activation = Callable[[Tensor], Tensor]

_BASE: dict[str, Activation] = {
    "gelu": F.gelu,
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),  # GPT-2's tanh approximation
    "relu": F.relu,
    "silu": F.silu,
}
assert set(_BASE) == set(ACTIVATIONS)


def _gated(hidden: Tensor, gate_activation: Activation) -> Tensor:
    gate, value = hidden.chunk(2, dim=-1)
    return gate_activation(gate) * value


def get_activation(name: str) -> Activation:
    """The activation called ``name``; for gated names (geglu, swiglu) it maps [..., 2n] -> [..., n]."""
    if name in GATED_ACTIVATIONS:
        return functools.partial(_gated, gate_activation=_BASE[GATED_ACTIVATIONS[name]])
    if name in _BASE:
        return _BASE[name]
    raise ValueError(f"hidden_act must be one of {tuple(_BASE) + tuple(GATED_ACTIVATIONS)}, got {name!r}")
