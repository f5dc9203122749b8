"""Block-sparse matmul in plain PyTorch (CPU and GPU): gathers plus batched matmuls, never a dense weight.

Weights are stored per output block row: ``blocks[o]`` is a ``[block_size, k * block_size]`` matrix whose t-th
column slice multiplies input block ``col_index[o, t]`` (every row has the same number ``k`` of blocks). Activations
are turned feature-major (``[features // block_size, block_size, tokens]``) once, so that gathering the input blocks
of every output row is a row ``index_select`` that ``bmm`` reads as is.

A row's ``k`` blocks are handled in chunks, one bmm each, so that a chunk's gathered input
``[out_blocks, chunk * block_size, tokens]`` is no larger than the larger of the layer's input and output: no step
holds ``k`` copies of the input. All chunks share one buffer: on CPU a fresh large tensor per chunk costs page
faults, and ``index_select`` without ``out=`` takes a much slower path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def _feature_major(t: Tensor, block_size: int) -> Tensor:
    """[tokens, features] -> [features // block_size, block_size, tokens] (a copy)."""
    tokens, features = t.shape
    return t.t().contiguous().view(features // block_size, block_size, tokens)


def _token_major(t: Tensor) -> Tensor:
    """[blocks, block_size, tokens] -> [tokens, blocks * block_size] (a copy)."""
    blocks, block_size, tokens = t.shape
    return t.view(blocks * block_size, tokens).t().contiguous()


@dataclass
class _Chunk:
    columns: slice  # of ``blocks``' last dimension
    index: Tensor  # flat input-block indices, [out_blocks * chunk]


class _Chunks:
    """The chunks of a layout's rows and the buffer their gathers and products share, for one call."""

    def __init__(self, col_index: Tensor, block_size: int, in_features: int, like: Tensor):
        self.out_blocks, k = col_index.shape
        self.block_size, self.tokens = block_size, like.shape[-1]
        size = max(1, min(k, in_features // (self.out_blocks * block_size)))
        self.chunks = [_Chunk(slice(start * block_size, min(start + size, k) * block_size),
                              col_index[:, start:start + size].reshape(-1)) for start in range(0, k, size)]
        self.buffer = like.new_empty(self.out_blocks * size * block_size * self.tokens)

    def scratch(self, chunk: _Chunk) -> Tensor:
        """Buffer room for one chunk: [out_blocks, chunk * block_size, tokens]."""
        width = chunk.index.numel() // self.out_blocks * self.block_size
        return self.buffer[:self.out_blocks * width * self.tokens].view(self.out_blocks, width, self.tokens)

    def gather(self, x_blocks: Tensor, chunk: _Chunk) -> Tensor:
        """The input blocks each output row's chunk reads (in the buffer)."""
        out = self.scratch(chunk)
        blocks, block_size, tokens = x_blocks.shape
        flat_x = x_blocks.view(blocks, block_size * tokens)
        torch.index_select(flat_x, 0, chunk.index, out=out.view(chunk.index.numel(), flat_x.shape[1]))
        return out


def blocksparse_matmul(x: Tensor, blocks: Tensor, col_index: Tensor) -> Tensor:
    """``x @ W^T`` for x ``[tokens, in_features]`` and the block-sparse W; returns ``[tokens, out_features]``."""
    block_size = blocks.shape[1]
    x_blocks = _feature_major(x, block_size)
    plan = _Chunks(col_index, block_size, x.shape[1], x_blocks)
    y = None
    for chunk in plan.chunks:
        gathered, weight = plan.gather(x_blocks, chunk), blocks[:, :, chunk.columns]
        y = torch.bmm(weight, gathered) if y is None else y.baddbmm_(weight, gathered)
    return _token_major(y)


def blocksparse_matmul_backward(x: Tensor, grad_y: Tensor, blocks: Tensor, col_index: Tensor, need_x: bool,
                                need_blocks: bool) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of ``blocksparse_matmul`` with respect to x and blocks (None where not needed).

    grad_blocks of row o is ``grad_y[o] @ gathered_x[o]^T`` (the input gather is redone, which costs memory traffic
    only); grad_x adds every block's ``W^T @ grad_y[o]`` into its input block with ``index_add_``.
    """
    block_size = blocks.shape[1]
    tokens, in_features = x.shape
    grad_y_blocks = _feature_major(grad_y, block_size)
    plan = _Chunks(col_index, block_size, in_features, grad_y_blocks)
    x_blocks = _feature_major(x, block_size) if need_blocks else None
    grad_x_blocks = grad_y.new_zeros(in_features // block_size, block_size, tokens) if need_x else None
    grad_blocks = torch.empty_like(blocks) if need_blocks else None
    for chunk in plan.chunks:
        if need_blocks:
            gathered = plan.gather(x_blocks, chunk)
            grad_blocks[:, :, chunk.columns] = torch.bmm(grad_y_blocks, gathered.transpose(1, 2))
        if need_x:
            contributions = torch.bmm(blocks[:, :, chunk.columns].transpose(1, 2), grad_y_blocks,
                                      out=plan.scratch(chunk))
            grad_x_blocks.index_add_(0, chunk.index, contributions.view(chunk.index.numel(), block_size, tokens))
    return (_token_major(grad_x_blocks) if need_x else None), grad_blocks
