"""The kinds of large projection, all following the ``LinearOp`` protocol (:mod:`lean_transformer.modules.linear_op`):
``DenseLinear`` (a plain matrix), ``SharedLinear`` (a matrix shared by several layers plus this layer's own low-rank
adapter and bias) and ``BlockSparseLinear`` (:mod:`lean_transformer.modules.blocksparse`). ``make_linear`` picks one
from the config.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lean_transformer.modules.blocksparse import BlockSparseLinear
from lean_transformer.modules.linear_op import Grads, LinearOp, flatten_leading, matmul_backward

if TYPE_CHECKING:
    from lean_transformer.config import LeanTransformerConfig

class DenseLinear(LinearOp):
    """A plain dense projection, ``y = x @ weight^T + bias`` (weight stored as [out_features, in_features])."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.reset_parameters(0.02)

    def op_params(self) -> tuple[Tensor, ...]:
        return (self.weight,) if self.bias is None else (self.weight, self.bias)

    def op_forward(self, x: Tensor, params: tuple[Tensor, ...]) -> Tensor:
        return F.linear(x, *params)

    def op_backward(self, x: Tensor, grad_y: Tensor, params: tuple[Tensor, ...]) -> tuple[Tensor, Grads]:
        weight, bias = params[0], (params[1] if len(params) > 1 else None)
        grad_x, grad_w, grad_b = matmul_backward(x, grad_y, weight, bias)
        return grad_x, (grad_w,) if bias is None else (grad_w, grad_b)

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class SharedMatrix(nn.Module):
    """One weight matrix used by several layers. It is registered once (in the model's body), and every
    ``SharedLinear`` that uses it holds a plain reference, so it appears once in ``state_dict`` and is built per
    model: two models never share it."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.reset_parameters(0.02)

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=std)

    # The LinearOp methods of the shared part (no bias), to which SharedLinear delegates. A block-sparse shared
    # matrix is a bias-free BlockSparseLinear, which has the same methods (see make_shared_matrix).
    def op_params(self) -> tuple[Tensor, ...]:
        return (self.weight,)

    def op_forward(self, x: Tensor, params: tuple[Tensor, ...]) -> Tensor:
        return F.linear(x, params[0])

    def op_backward(self, x: Tensor, grad_y: Tensor, params: tuple[Tensor, ...]) -> tuple[Tensor, Grads]:
        grad_x, grad_w, _ = matmul_backward(x, grad_y, params[0], None)
        return grad_x, (grad_w,)


SharedCore = Union[SharedMatrix, LinearOp]  # a SharedMatrix, or a bias-free BlockSparseLinear


class SharedLinear(LinearOp):
    """``y = x @ W_shared^T + (x @ A^T) @ B^T + bias``: a shared matrix specialized by this layer's own rank-``r``
    adapter (A: [r, in], B: [out, r]; B starts at zero so a fresh layer computes exactly the shared projection)."""

    def __init__(self, shared: SharedCore, adapter_dim: int = 0, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = shared.in_features, shared.out_features
        self._shared = (shared,)  # a tuple, so that nn.Module does not register the shared matrix here again
        self.adapter_dim = adapter_dim
        if adapter_dim:
            self.adapter_in = nn.Parameter(torch.empty(adapter_dim, self.in_features))
            self.adapter_out = nn.Parameter(torch.zeros(self.out_features, adapter_dim))
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None
        self.reset_parameters(0.02)

    @property
    def shared(self) -> SharedCore:
        return self._shared[0]

    def op_params(self) -> tuple[Tensor, ...]:
        params = list(self.shared.op_params())
        if self.adapter_dim:
            params += [self.adapter_in, self.adapter_out]
        if self.bias is not None:
            params.append(self.bias)
        return tuple(params)

    def _split(self, params: tuple[Tensor, ...]
               ) -> tuple[tuple[Tensor, ...], Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        num_shared = len(self.shared.op_params())
        shared, rest = tuple(params[:num_shared]), list(params[num_shared:])
        adapter_in, adapter_out = (rest.pop(0), rest.pop(0)) if self.adapter_dim else (None, None)
        bias = rest.pop(0) if self.bias is not None else None
        return shared, adapter_in, adapter_out, bias

    def op_forward(self, x: Tensor, params: tuple[Tensor, ...]) -> Tensor:
        shared, adapter_in, adapter_out, bias = self._split(params)
        y = self.shared.op_forward(x, shared)
        if adapter_in is not None:
            y = y + F.linear(F.linear(x, adapter_in), adapter_out)
        return y if bias is None else y + bias.to(y.dtype)

    def op_backward(self, x: Tensor, grad_y: Tensor, params: tuple[Tensor, ...]) -> tuple[Tensor, Grads]:
        shared, adapter_in, adapter_out, bias = self._split(params)
        grad_x, shared_grads = self.shared.op_backward(x, grad_y, shared)
        grads: list[Optional[Tensor]] = list(shared_grads)
        if adapter_in is not None:
            hidden = F.linear(x, adapter_in)  # rank-r, cheap to recompute
            grad_hidden, grad_adapter_out, _ = matmul_backward(hidden, grad_y, adapter_out, None)
            grad_x_adapter, grad_adapter_in, _ = matmul_backward(x, grad_hidden, adapter_in, None)
            grad_x = grad_x + grad_x_adapter
            grads += [grad_adapter_in, grad_adapter_out]
        if bias is not None:
            grads.append(flatten_leading(grad_y).sum(0).to(bias.dtype) if bias.requires_grad else None)
        return grad_x, tuple(grads)

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """Initializes this layer's own tensors; the shared matrix is initialized by its owner."""
        if self.adapter_dim:
            nn.init.normal_(self.adapter_in, mean=0.0, std=std)
            nn.init.zeros_(self.adapter_out)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"adapter_dim={self.adapter_dim}, bias={self.bias is not None}")


def _block_sparse(config: LeanTransformerConfig, in_features: int, out_features: int, bias: bool) -> LinearOp:
    return BlockSparseLinear(in_features, out_features, layout=config.weight_layout, lowrank_dim=config.lowrank_dim,
                             bias=bias)


def make_shared_matrix(config: LeanTransformerConfig, in_features: int, out_features: int) -> SharedCore:
    """A matrix for several layers to share: block-sparse when ``weight_layout`` is set (without bias: each
    ``SharedLinear`` adds its own), dense otherwise."""
    if config.weight_layout is not None:
        return _block_sparse(config, in_features, out_features, bias=False)
    return SharedMatrix(in_features, out_features)


def make_linear(config: LeanTransformerConfig, in_features: int, out_features: int, bias: bool = True,
                shared: Optional[SharedCore] = None) -> LinearOp:
    """The projection kind the config asks for: a shared matrix with this layer's adapter when ``shared`` is given,
    block-sparse when ``weight_layout`` is set, dense otherwise."""
    if shared is not None:
        if (shared.in_features, shared.out_features) != (in_features, out_features):
            raise ValueError(f"shared matrix is {shared.out_features}x{shared.in_features}, "
                             f"expected {out_features}x{in_features}")
        return SharedLinear(shared, config.adapter_dim, bias=bias)
    if config.weight_layout is not None:
        return _block_sparse(config, in_features, out_features, bias)
    return DenseLinear(in_features, out_features, bias=bias)
