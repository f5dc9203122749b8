"""Feed-forward activations; gated variants take a doubled pre-activation and split it into gate and value."""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lean_transformer.config import ACTIVATIONS, GATED_ACTIVATIONS

Activation = Callable[[Tensor], Tensor]
ActivationBackward = Callable[[Tensor, Tensor], Tensor]  # (grad of the output, pre-activation) -> grad of the input

_BASE: dict[str, Activation] = {
    "gelu": F.gelu,
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),  # GPT-2's tanh approximation
    "relu": F.relu,
    "silu": F.silu,
}
assert set(_BASE) == set(ACTIVATIONS)

# the kernels autograd calls for these activations, fed the pre-activation (ReLU's autograd feeds its output, whose
# sign is the input's: the same mask), so a backward needs no activation output
_BACKWARD: dict[str, ActivationBackward] = {
    "gelu": lambda grad, hidden: torch.ops.aten.gelu_backward(grad, hidden),
    "gelu_new": lambda grad, hidden: torch.ops.aten.gelu_backward(grad, hidden, approximate="tanh"),
    "relu": lambda grad, hidden: torch.ops.aten.threshold_backward(grad, hidden, 0),
    "silu": lambda grad, hidden: torch.ops.aten.silu_backward(grad, hidden),
}
assert set(_BACKWARD) == set(ACTIVATIONS)


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


def get_activation_backward(name: str) -> Optional[ActivationBackward]:
    """``(grad, hidden) -> grad * act'(hidden)`` for the element-wise activation ``name``, the very values autograd
    gives; None for gated ones (their backward goes through autograd)."""
    get_activation(name)  # the same error for an unknown name
    return _BACKWARD.get(name)
