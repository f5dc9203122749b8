"""``BlockSparseLinear``: a large projection whose weight is block-sparse, plus an optional dense low-rank term.

Two backends compute the block-sparse products: the Triton kernels (``triton_kernel.py``) on CUDA where Triton is
installed and the block size suits them (16-128, a power of two), and the plain-PyTorch one (``native.py``)
everywhere else, which is also the reference the kernels are tested against.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
from types import ModuleType
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from lean_transformer.layouts import LayoutSpec, make_layout, parse_layout
from lean_transformer.modules.blocksparse.native import blocksparse_matmul, blocksparse_matmul_backward
from lean_transformer.modules.linear_op import Grads, LinearOp
from lean_transformer.modules.replay import AutocastState

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "native", "triton")
_triton_failure: Optional[str] = None  # set when a Triton launch raised on CUDA: "auto" then stays native


def _triton_kernels() -> Optional[ModuleType]:
    """The Triton backend's module, or None where Triton is not installed (imported on first use only, so that CPU
    runs never import Triton)."""
    if importlib.util.find_spec("triton") is None:
        return None
    return importlib.import_module("lean_transformer.modules.blocksparse.triton_kernel")


def _compute_dtype(device: torch.device, default: torch.dtype) -> torch.dtype:
    """The dtype the products run in: autocast's where it is on (as for ``F.linear``), else ``default``."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else default


@contextlib.contextmanager
def _no_autocast(device: torch.device) -> Iterator[None]:
    # inputs are cast explicitly; autocast must not re-cast the in-place baddbmm_/addmm_ accumulators
    with torch.autocast(device.type, enabled=False):
        yield


class BlockSparseLinear(LinearOp):
    """``y = x @ W^T + (x @ U^T) @ V^T + b``, with W block-sparse in a registered layout (see ``layout.py``) and an
    optional rank-``lowrank_dim`` term (PixelFly's "sparse + low-rank").

    ``backend``: ``"auto"`` runs the Triton kernels on CUDA where they apply (see the module docstring) and the
    native path elsewhere; if a Triton launch raises, it logs one warning and stays native for the process.
    ``"native"`` and ``"triton"`` force one (``"triton"`` raises where it cannot run; on the CPU it needs
    ``TRITON_INTERPRET=1``). ``backend_used`` says which one ran the last product.

    Parameters: ``blocks`` ``[out_blocks, block_size, k * block_size]`` (row block o, column slice t is the block
    at input block ``col_index[o, t]``), ``lowrank_in`` U ``[lowrank_dim, in_features]``, ``lowrank_out`` V
    ``[out_features, lowrank_dim]`` and ``bias``; ``op_params()`` returns those present in this order. Only the kept
    blocks are stored, so parameters, gradients and optimizer state shrink with the layout's density.
    """

    def __init__(self, in_features: int, out_features: int, layout: Union[str, LayoutSpec], lowrank_dim: int = 0,
                 bias: bool = True, backend: str = "auto"):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend, self.backend_used = backend, None
        if not isinstance(lowrank_dim, int) or isinstance(lowrank_dim, bool) or lowrank_dim < 0:
            raise ValueError(f"lowrank_dim must be a non-negative integer, got {lowrank_dim!r}")
        self.in_features, self.out_features, self.lowrank_dim = in_features, out_features, lowrank_dim
        self.layout = parse_layout(layout) if isinstance(layout, str) else layout
        mask = make_layout(self.layout, out_features, in_features, balanced=True)
        out_blocks, blocks_per_row = mask.shape[0], int(mask[0].sum())
        block_size = self.layout.block_size
        # Derived from the layout string, so neither a parameter nor a buffer: it stays out of the state dict (and
        # of what peers average), and is rebuilt, not left uninitialized, when a model is made on the meta device.
        self._col_index = {torch.device("cpu"): mask.nonzero()[:, 1].view(out_blocks, blocks_per_row)}
        self._layout_index: dict[torch.device, Any] = {}  # the Triton kernels' row and column lists, per device
        self.blocks = nn.Parameter(torch.empty(out_blocks, block_size, blocks_per_row * block_size))
        if lowrank_dim:
            self.lowrank_in = nn.Parameter(torch.empty(lowrank_dim, in_features))
            self.lowrank_out = nn.Parameter(torch.empty(out_features, lowrank_dim))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reset_parameters(0.02)

    def col_index(self, device: torch.device) -> Tensor:
        """[out_blocks, k]: the input block of each kept block, row by row (cached per device)."""
        if device not in self._col_index:
            self._col_index[device] = self._col_index[torch.device("cpu")].to(device)
        return self._col_index[device]

    def _triton(self, x: Tensor) -> Optional[ModuleType]:
        """The Triton backend's module where it runs the products on ``x``'s device and dtype, else None."""
        if self.backend == "native" or (self.backend == "auto" and (x.device.type != "cuda" or _triton_failure)):
            return None
        kernels = _triton_kernels()
        if self.backend == "triton":
            if kernels is None:
                raise RuntimeError("backend='triton' needs the triton package")
            return kernels
        usable = kernels is not None and kernels.supports(self.block_size, x.dtype)
        return kernels if usable else None

    def _kernel_index(self, kernels: ModuleType, device: torch.device) -> Any:
        if device not in self._layout_index:
            self._layout_index[device] = kernels.LayoutIndex.build(
                self._col_index[torch.device("cpu")], self.in_features // self.block_size, device)
        return self._layout_index[device]

    def _try_triton(self, x: Tensor, run: Callable[[ModuleType, Any], Any]) -> Optional[Any]:
        """``run(kernels, layout_index)`` where the Triton backend applies to ``x`` (see ``backend``), else None."""
        global _triton_failure
        try:
            kernels = self._triton(x)
            if kernels is not None:
                result = run(kernels, self._kernel_index(kernels, x.device))
                self.backend_used = "triton"
                return result
        except Exception as error:  # an import, compiler or launch failure of any type; the native path still works
            if self.backend == "triton":
                raise
            _triton_failure = f"{type(error).__name__}: {error}"
            logger.warning(f"Triton block-sparse kernels failed, using the native path: {_triton_failure}")
        self.backend_used = "native"
        return None

    def _matmul(self, x2d: Tensor, blocks: Tensor) -> Tensor:
        y = self._try_triton(x2d, lambda kernels, index: kernels.blocksparse_matmul(x2d, blocks, index))
        return blocksparse_matmul(x2d, blocks, self.col_index(x2d.device)) if y is None else y

    def _matmul_backward(self, x2d: Tensor, grad_y2d: Tensor, blocks: Tensor, need_x: bool, need_blocks: bool,
                         grad_blocks_dtype: torch.dtype) -> tuple[Optional[Tensor], Optional[Tensor]]:
        grads = self._try_triton(x2d, lambda kernels, index: kernels.blocksparse_matmul_backward(
            x2d, grad_y2d, blocks, index, need_x, need_blocks, grad_blocks_dtype))
        if grads is None:
            grads = blocksparse_matmul_backward(x2d, grad_y2d, blocks, self.col_index(x2d.device), need_x,
                                                need_blocks)
        return grads

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def density(self) -> float:
        """The fraction of the dense matrix's weights kept in blocks."""
        return self._col_index[torch.device("cpu")].shape[1] * self.block_size / self.in_features

    def layout_mask(self) -> Tensor:
        """The bool block mask [out_blocks, in_blocks] this layer was built from."""
        mask = torch.zeros(self.out_features // self.block_size, self.in_features // self.block_size, dtype=torch.bool)
        return mask.scatter_(1, self.col_index(mask.device), True)

    def dense_weight(self) -> Tensor:
        """The equivalent dense ``[out_features, in_features]`` matrix (zeros outside the layout, low-rank term
        added), for inspection and export; the forward pass never builds it."""
        col_index = self.col_index(self.blocks.device)
        out_blocks, blocks_per_row = col_index.shape
        size = self.block_size
        weight = self.blocks.new_zeros(out_blocks, size, self.in_features // size, size)
        rows = torch.arange(out_blocks, device=col_index.device)[:, None]
        weight[rows, :, col_index, :] = self.blocks.view(out_blocks, size, blocks_per_row, size).transpose(1, 2)
        weight = weight.view(self.out_features, self.in_features)
        return weight + self.lowrank_out @ self.lowrank_in if self.lowrank_dim else weight

    def op_params(self) -> tuple[Tensor, ...]:
        params = [self.blocks]
        if self.lowrank_dim:
            params += [self.lowrank_in, self.lowrank_out]
        if self.bias is not None:
            params.append(self.bias)
        return tuple(params)

    def _split(self, params: tuple[Tensor, ...]) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        blocks, rest = params[0], list(params[1:])
        lowrank_in, lowrank_out = (rest.pop(0), rest.pop(0)) if self.lowrank_dim else (None, None)
        bias = rest.pop(0) if self.bias is not None else None
        return blocks, lowrank_in, lowrank_out, bias

    def op_forward(self, x: Tensor, params: tuple[Tensor, ...]) -> Tensor:
        if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params)):
            # autograd keeps only x (and the parameters), not the gathered copies
            return _BlockSparseFunction.apply(self, x, *params)
        return self._forward(x, params)

    def op_backward(self, x: Tensor, grad_y: Tensor, params: tuple[Tensor, ...]) -> tuple[Tensor, Grads]:
        return self._backward(x, grad_y, params, need_x=True)

    def _forward(self, x: Tensor, params: tuple[Tensor, ...]) -> Tensor:
        dtype = _compute_dtype(x.device, x.dtype)
        blocks, lowrank_in, lowrank_out, bias = (None if p is None else p.to(dtype) for p in self._split(params))
        with _no_autocast(x.device):
            x2d = x.reshape(-1, self.in_features).to(dtype)
            y = self._matmul(x2d, blocks)
            if lowrank_in is not None:
                y.addmm_(x2d @ lowrank_in.t(), lowrank_out.t())
            if bias is not None:
                y.add_(bias)
        return y.view(*x.shape[:-1], self.out_features)

    def _backward(self, x: Tensor, grad_y: Tensor, params: tuple[Tensor, ...], need_x: bool
                  ) -> tuple[Optional[Tensor], Grads]:
        dtype = _compute_dtype(grad_y.device, grad_y.dtype)
        blocks, lowrank_in, lowrank_out, bias = self._split(params)
        with _no_autocast(x.device), torch.no_grad():
            x2d = x.reshape(-1, self.in_features).to(dtype)
            grad_y2d = grad_y.reshape(-1, self.out_features).to(dtype)
            grad_x, grad_blocks = self._matmul_backward(x2d, grad_y2d, blocks.to(dtype), need_x,
                                                        blocks.requires_grad, blocks.dtype)
            grads = [grad_blocks]
            if lowrank_in is not None:
                hidden = x2d @ lowrank_in.to(dtype).t()  # rank-r, cheap to recompute
                grad_hidden = grad_y2d @ lowrank_out.to(dtype)
                if grad_x is not None:
                    grad_x.addmm_(grad_hidden, lowrank_in.to(dtype))
                grads += [grad_hidden.t() @ x2d if lowrank_in.requires_grad else None,
                          grad_y2d.t() @ hidden if lowrank_out.requires_grad else None]
            if bias is not None:
                grads.append(grad_y2d.sum(0) if bias.requires_grad else None)
        grads = tuple(None if g is None else g.to(p.dtype) for g, p in zip(grads, params))
        if grad_x is not None:
            grad_x = grad_x.view(x.shape).to(x.dtype)
        return grad_x, grads

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """Blocks and U ~ normal(0, std); V and the bias start at zero, so a fresh layer computes exactly its
        block-sparse part (like the adapters of shared matrices)."""
        nn.init.normal_(self.blocks, mean=0.0, std=std)
        if self.lowrank_dim:
            nn.init.normal_(self.lowrank_in, mean=0.0, std=std)
            nn.init.zeros_(self.lowrank_out)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, layout={str(self.layout)!r}, "
                f"density={self.density:.4g}, lowrank_dim={self.lowrank_dim}, bias={self.bias is not None}")


class _BlockSparseFunction(torch.autograd.Function):
    """Plain-autograd entry point: saves the input and the parameters, differentiates with ``_backward``."""

    @staticmethod
    def forward(ctx, layer: BlockSparseLinear, x: Tensor, *params: Tensor) -> Tensor:
        ctx.layer = layer
        ctx.autocast = AutocastState.capture()
        ctx.save_for_backward(x, *params)
        return layer._forward(x, params)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: Tensor):
        x, *params = ctx.saved_tensors
        with ctx.autocast.restore():
            grad_x, grads = ctx.layer._backward(x, grad_y, tuple(params), need_x=ctx.needs_input_grad[1])
        return None, grad_x, *grads
