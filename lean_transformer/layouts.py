"""Block layouts: which ``block_size x block_size`` tiles of a weight matrix exist. Here, below both the config
(which checks a layout against the model's shapes when it is built) and ``modules/blocksparse`` (which builds the
weights from it).

A layout is named by a string that reads like a call, e.g. ``"pixelfly(block_size=64)"`` or
``"hypercube(block_size=32, folded=True)"``. The string is parsed with :mod:`ast` and only literal keyword values
are accepted, so a config file can never run code. ``block_size`` is required by every layout and consumed here;
the other keywords go to the layout function, which sees the matrix only in units of blocks::

    @register_layout("my_layout")
    def my_layout(out_blocks: int, in_blocks: int, *, width: int = 1) -> torch.Tensor:
        ...  # a bool tensor [out_blocks, in_blocks]; True = the block is kept

    BlockSparseLinear(512, 2048, layout="my_layout(block_size=32, width=2)")
"""
from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

LayoutFn = Callable[..., torch.Tensor]
_LAYOUTS: dict[str, LayoutFn] = {}


def register_layout(name: str) -> Callable[[LayoutFn], LayoutFn]:
    """Decorator adding ``fn(out_blocks, in_blocks, **kwargs) -> BoolTensor[out_blocks, in_blocks]`` to the registry
    under ``name`` (registering a name again replaces the earlier function)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a layout name must be a Python identifier, got {name!r}")

    def decorator(fn: LayoutFn) -> LayoutFn:
        _LAYOUTS[name] = fn
        return fn

    return decorator


def registered_layouts() -> tuple[str, ...]:
    return tuple(sorted(_LAYOUTS))


@dataclass(frozen=True)
class LayoutSpec:
    """A parsed layout string: the layout's name, its block size and the remaining keyword arguments."""

    name: str
    block_size: int
    kwargs: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        args = [f"block_size={self.block_size}"] + [f"{key}={value!r}" for key, value in self.kwargs]
        return f"{self.name}({', '.join(args)})"


def parse_layout(layout: str) -> LayoutSpec:
    """Parse ``"name(block_size=..., key=literal, ...)"`` without evaluating it.

    Raises ValueError for anything but a call of a registered layout with literal keyword arguments, a missing or
    non-positive ``block_size``, or keywords that the layout function does not take.
    """
    if not isinstance(layout, str):
        raise ValueError(f"weight_layout must be a string such as 'pixelfly(block_size=64)', got {layout!r}")
    form = "name(block_size=..., key=value, ...)"
    try:
        call = ast.parse(layout.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError(f"weight_layout {layout!r} is not of the form {form}") from None
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        raise ValueError(f"weight_layout {layout!r} is not of the form {form}")
    name = call.func.id
    if name not in _LAYOUTS:
        raise ValueError(f"weight_layout {layout!r}: unknown layout {name!r}; registered: {registered_layouts()}")
    if call.args:
        raise ValueError(f"weight_layout {layout!r}: pass arguments by keyword, e.g. {name}(block_size=64)")

    kwargs: dict[str, Any] = {}
    for keyword in call.keywords:
        if keyword.arg is None:
            raise ValueError(f"weight_layout {layout!r}: '**' arguments are not allowed")
        if keyword.arg in kwargs:
            raise ValueError(f"weight_layout {layout!r}: argument {keyword.arg!r} is given twice")
        try:
            kwargs[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
            raise ValueError(f"weight_layout {layout!r}: argument {keyword.arg!r} must be a literal "
                             f"(number, string, bool, None)") from None

    block_size = kwargs.pop("block_size", None)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"weight_layout {layout!r}: block_size must be a positive integer, got {block_size!r}")
    try:
        inspect.signature(_LAYOUTS[name]).bind(1, 1, **kwargs)
    except TypeError as e:
        raise ValueError(f"weight_layout {layout!r}: {e}") from None
    return LayoutSpec(name, block_size, tuple(kwargs.items()))


def make_layout(layout: Union[str, LayoutSpec], out_features: int, in_features: int, *,
                balanced: bool = False) -> torch.Tensor:
    """The bool block mask ``[out_features // block_size, in_features // block_size]`` of a layout.

    :param balanced: also require the same number of kept blocks in every row (what the PyTorch backend needs).
    """
    spec = parse_layout(layout) if isinstance(layout, str) else layout
    for field, size in (("out_features", out_features), ("in_features", in_features)):
        if size % spec.block_size:
            raise ValueError(f"weight_layout {str(spec)!r}: block_size={spec.block_size} does not divide "
                             f"{field}={size}")
    shape = (out_features // spec.block_size, in_features // spec.block_size)
    try:
        with torch.device("cpu"):  # even where models are built on the meta device (e.g. from_pretrained)
            mask = _LAYOUTS[spec.name](*shape, **dict(spec.kwargs))
    except ValueError as e:
        raise ValueError(f"weight_layout {str(spec)!r} for a {out_features}x{in_features} matrix: {e}") from None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != shape:
        got = f"{mask.dtype} tensor of shape {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask)
        raise ValueError(f"layout function {spec.name!r} must return a bool tensor of shape {shape}, got {got}")
    per_row = mask.sum(1)
    if per_row.min() == 0:
        raise ValueError(f"weight_layout {str(spec)!r} leaves an output row of {out_features}x{in_features} "
                         f"without blocks")
    if balanced and per_row.max() != per_row.min():
        raise ValueError(f"weight_layout {str(spec)!r} is unbalanced for a {out_features}x{in_features} matrix: "
                         f"{int(per_row.min())} to {int(per_row.max())} blocks per row, and the PyTorch backend "
                         f"needs the same number in every row")
    return mask.cpu()


# ---------------------------------------------------------------------------------------------- built-in layouts

def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _base_size(out_blocks: int, in_blocks: int, size: Optional[int], what: str) -> int:
    """The side of the power-of-two pattern that is tiled over the square of the smaller block count: ``size`` if
    given, else the largest power of two dividing that count (all of it when it is a power of two)."""
    smaller = min(out_blocks, in_blocks)
    if max(out_blocks, in_blocks) % smaller:
        raise ValueError(f"a {out_blocks}x{in_blocks}-block matrix: the larger block count must be a multiple of the "
                         f"smaller one")
    if size is None:
        return smaller & -smaller
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0 or size & (size - 1) or smaller % size:
        raise ValueError(f"{what} must be a power of two dividing {smaller} (the smaller block count), got {size!r}")
    return size


def _fit(base: torch.Tensor, out_blocks: int, in_blocks: int, stretch: bool) -> torch.Tensor:
    """Tile a square power-of-two ``base`` over the ``m x m`` square (m = smaller block count), then widen it to
    the rectangle: ``stretch=True`` repeats each row (or column) in place, so consecutive blocks along the longer
    side share their pattern; ``stretch=False`` stacks copies of the square. Either way every row keeps the same
    number of blocks, and so does every column."""
    smaller = min(out_blocks, in_blocks)
    square = base.repeat(smaller // len(base), smaller // len(base))
    rows, cols = out_blocks // smaller, in_blocks // smaller
    if stretch:
        return square.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)
    return square.repeat(rows, cols)


def _xor_table(size: int) -> torch.Tensor:
    index = torch.arange(size)
    return index[:, None] ^ index[None, :]


@register_layout("pixelfly")
def pixelfly(out_blocks: int, in_blocks: int, *, n_factors: Optional[int] = None,
             butterfly_size: Optional[int] = None, stretch: bool = False) -> torch.Tensor:
    """Flat block butterfly, the sparse part of PixelFly (Chen et al. 2021, "Pixelated Butterfly").

    A butterfly factor matrix ``B_k`` of size n is block-diagonal with n/k butterfly factors, each a 2x2 grid of
    diagonal (k/2 x k/2) matrices, so entry (i, j) of ``B_k`` can be non-zero only where ``i xor j`` is 0 or k/2.
    The flat butterfly of maximum stride k is the first-order expansion of a butterfly product,
    ``I + B_2 + B_4 + ... + B_k``; here each entry is a block. Hence block (i, j) is kept iff ``i xor j`` is 0 or
    one of 1, 2, 4, ..., 2^(n_factors - 1): ``1 + n_factors`` blocks in every row and every column.

    :param n_factors: number of butterfly factors, log2(butterfly_size) (the full flat butterfly) by default.
        E.g. n_factors=3 on 32x32 blocks keeps 4 blocks per row: 1/8 of the weights.
    :param butterfly_size: side of the butterfly in blocks, a power of two dividing the smaller block count;
        defaults to the largest such power of two. A smaller butterfly is tiled over the square.
    :param stretch: how a rectangular matrix extends the square pattern, see ``_fit``.
    """
    _check_bool("stretch", stretch)
    size = _base_size(out_blocks, in_blocks, butterfly_size, "butterfly_size")
    log_size = size.bit_length() - 1
    n_factors = log_size if n_factors is None else n_factors
    _check_int("n_factors", n_factors, 0, log_size)
    xor = _xor_table(size)
    is_stride = (xor & (xor - 1) == 0) & (xor < 2 ** n_factors)  # a power of two (or 0) below the maximum stride
    return _fit(is_stride, out_blocks, in_blocks, stretch)


@register_layout("hypercube")
def hypercube(out_blocks: int, in_blocks: int, *, folded: bool = False, cube_size: Optional[int] = None,
              stretch: bool = False) -> torch.Tensor:
    """Adjacency (plus self-loops) of the hypercube graph on ``cube_size`` nodes: blocks i and j are linked when
    their indices differ in one bit, which is exactly the full flat butterfly. ``folded=True`` also links each
    node to its complement (``i xor j == cube_size - 1``), the folded cube graph: one more block per row, and the
    graph diameter (how many layers it takes for every input to reach every output) is halved.

    :param cube_size: number of nodes, a power of two dividing the smaller block count (the largest by default).
    """
    _check_bool("folded", folded)
    _check_bool("stretch", stretch)
    size = _base_size(out_blocks, in_blocks, cube_size, "cube_size")
    xor = _xor_table(size)
    linked = xor & (xor - 1) == 0
    if folded:
        linked |= xor == size - 1
    return _fit(linked, out_blocks, in_blocks, stretch)


@register_layout("dense")
def dense(out_blocks: int, in_blocks: int) -> torch.Tensor:
    """Every block: the block-sparse machinery at full density (a baseline)."""
    return torch.ones(out_blocks, in_blocks, dtype=torch.bool)
