"""The protocol every large projection follows, so that hand-written backward passes work for every kind.

The protocol (``LinearOp``)
---------------------------
Every large projection (attention q/k/v and output, feed-forward in and out) is a ``LinearOp``:

``op_params() -> tuple[Tensor, ...]``
    The tensors the matmul depends on, always in the same order and never ``None`` (a layer without bias
    returns a shorter tuple). The feed-forward's ``autograd.Function`` receives them flattened next to its
    input and gives each sub-module back the ``len(op_params())`` tensors it handed over.
``op_forward(x, params) -> Tensor``
    ``y = x @ W^T (+ b)`` over the last dimension of ``x``, computed only from ``params`` (not from ``self``'s
    attributes), so that it can run on detached copies. It must also be differentiable by plain autograd.
``op_backward(x, grad_y, params) -> (grad_x, grads)``
    The explicit backward of ``op_forward`` given its input ``x`` (which the caller saved or recomputed) and the
    output gradient; ``grads`` matches ``params`` one to one, ``None`` where a tensor needs no gradient. It must
    not recompute the forward matmul, so ``x`` is the only activation a caller keeps for it. Gradients are
    returned in each parameter's own dtype (under autocast the products run in half precision).
``reset_parameters(std)``
    Initializes the weights (normal with standard deviation ``std``, biases zero); the models call it.
``forward(x)`` is ``op_forward(x, op_params())``.

The kinds live in :mod:`lean_transformer.modules.linear` and :mod:`lean_transformer.modules.blocksparse`.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

Grads = tuple[Optional[Tensor], ...]


def flatten_leading(t: Tensor) -> Tensor:
    """Fold every leading dimension into one: (..., n) -> (N, n)."""
    return t.reshape(-1, t.shape[-1])


def matmul_backward(x: Tensor, grad_y: Tensor, weight: Tensor, bias: Optional[Tensor]
                    ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """Gradients of ``y = x @ weight^T + bias`` with respect to x, weight and bias."""
    grad_x = grad_y @ weight
    grad_w = (flatten_leading(grad_y).t() @ flatten_leading(x)).to(weight.dtype) if weight.requires_grad else None
    grad_b = None
    if bias is not None and bias.requires_grad:
        grad_b = flatten_leading(grad_y).sum(0).to(bias.dtype)
    return grad_x, grad_w, grad_b


class LinearOp(nn.Module):
    """Base class of every large projection; see the module docstring for the protocol."""

    in_features: int
    out_features: int

    def op_params(self) -> tuple[Tensor, ...]:
        raise NotImplementedError

    def op_forward(self, x: Tensor, params: tuple[Tensor, ...]) -> Tensor:
        raise NotImplementedError

    def op_backward(self, x: Tensor, grad_y: Tensor, params: tuple[Tensor, ...]) -> tuple[Tensor, Grads]:
        raise NotImplementedError

    def reset_parameters(self, std: float) -> None:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        return self.op_forward(x, self.op_params())


def even_bounds(total: int, pieces: int) -> list[int]:
    """``pieces + 1`` boundaries splitting ``range(total)`` into near-equal parts (plain ints: no tensor, so shapes
    stay static under fake tensors and compilation)."""
    return [index * total // pieces for index in range(pieces + 1)]
