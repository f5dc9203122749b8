"""A parameter used twice gets the gradient of its first-differentiated use handed off at once, not held.

Autograd sums a parameter's contributions before its hooks run. A tied embedding table is used by the input lookup
and by the output head; the head's contribution comes first in backward and waits in autograd's buffer through the
backward of every layer (for a 50304 x 2048 bfloat16 table: 0.19 GiB on the device beside each layer's backward).
Where the gradients leave the device anyway (``optim.grad_offload.HostGradients``), that contribution can leave at
once: ``handoff(param)`` is ``param`` in the forward pass, and in backward gives its gradient to the receiver set on
``param`` (``set_receiver``) instead of to autograd's sum. The receiver must add it to what the parameter's
post-accumulate hook gets (HostGradients adds both into one float32 host buffer).

Without a receiver, or when the engine will not accumulate into the parameter (``torch.autograd.grad``, or
``backward(inputs=...)`` without it), the gradient flows on as usual: same values, nothing handed off. torch has no
public way to ask the engine the latter; ``torch._C._will_engine_execute_node`` is what its own
``register_multi_grad_hook`` uses.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

Receiver = Callable[[Tensor], None]
_ATTRIBUTE = "_lean_early_grad_receiver"


def set_receiver(param: Tensor, receiver: Optional[Receiver]) -> None:
    """Where ``handoff(param)``'s gradient goes in backward (None: back to autograd's sum)."""
    if not param.is_leaf:
        raise ValueError("set_receiver: param must be a leaf tensor (a parameter)")
    if receiver is None:
        if hasattr(param, _ATTRIBUTE):
            delattr(param, _ATTRIBUTE)
    else:
        setattr(param, _ATTRIBUTE, receiver)


def handoff(param: Tensor) -> Tensor:
    """``param``, whose gradient through this use goes to its receiver in backward, if it has one by then."""
    if not (torch.is_grad_enabled() and param.requires_grad and param.is_leaf):
        return param
    return _Handoff.apply(param)


def _accumulates(param: Tensor) -> bool:
    """Whether the running backward will accumulate into ``param`` (and so run its post-accumulate hooks)."""
    try:
        return torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(param).node)
    except RuntimeError:  # raised under torch.autograd.grad: it captures leaves instead of accumulating
        return False


class _Handoff(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param: Tensor) -> Tensor:
        ctx.param = param  # a parameter, not an activation: referencing it costs no memory
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Optional[Tensor]:
        receiver: Optional[Receiver] = getattr(ctx.param, _ATTRIBUTE, None)
        if receiver is None or not _accumulates(ctx.param):
            return grad
        receiver(grad)
        return None
