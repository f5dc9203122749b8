"""Block-sparse matmul in Triton: the fast path of ``BlockSparseLinear`` on CUDA.

Why our own kernel: the native path (``native.py``) gathers input blocks into a feature-major copy and runs batched
matmuls, which moves every activation several times and on an H100 took 2-3x the time of the dense layer. Triton's
own ``triton.ops.blocksparse`` (which the original lean_transformer wrapped) left Triton in 3.0, and the other
block-sparse kernels we know (``stk``, torch's BSR tensors) bring their own weight storage; these three kernels read
our storage (``blocks[o]``: row o's ``k`` kept blocks side by side) and the token-major activations as
they are, so nothing is gathered, transposed or copied.

The three products and the index list each needs (built once per layout, see ``LayoutIndex``):

- forward ``y = x @ W^T``: one program per (output block row o, token tile); it walks row o's ``k`` blocks
  (``col_index[o]``, row-major) and accumulates ``x[:, c] @ W[o, c]^T``.
- input gradient ``dx = dy @ W``: one program per (input block column c, token tile); it walks the blocks of
  column c (a CSR list: ``col_ptr``, and each entry's row o and slot t) and accumulates ``dy[:, o] @ W[o, c]``.
  Columns may hold different numbers of blocks (rectangular layouts), which the CSR list allows.
- weight gradient ``dW[o, c] = dy[:, o]^T @ x[:, c]``: one program per kept block; it iterates over all tokens.

Every product accumulates in float32 (``tl.dot``) and stores in the output's dtype; float32 inputs use TF32 only
where ``torch.backends.cuda.matmul.allow_tf32`` allows it, as torch's own matmul does. The kernels also run on the
CPU under ``TRITON_INTERPRET=1`` (set before Triton is imported), which is how the tests check them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 16, 128  # tl.dot needs >= 16; larger tiles would not fit one program
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def supports(block_size: int, dtype: torch.dtype) -> bool:
    """Whether these kernels handle ``block_size`` (a power of two in [16, 128]) and ``dtype``."""
    return MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE and block_size & (block_size - 1) == 0 and dtype in DTYPES


@dataclass(frozen=True)
class LayoutIndex:
    """The layout's block lists for the kernels, int32 on one device.

    ``col_index`` ``[out_blocks * k]``: row-major, the input block of row o's slot t (forward, weight gradient).
    ``col_ptr`` ``[in_blocks + 1]``, ``entry_row``, ``entry_slot``: column-major (CSR by input block), the row o
    and slot t of each kept block of column c at ``col_ptr[c]:col_ptr[c + 1]`` (input gradient).
    """
    col_index: Tensor
    col_ptr: Tensor
    entry_row: Tensor
    entry_slot: Tensor
    out_blocks: int
    in_blocks: int
    blocks_per_row: int

    @classmethod
    def build(cls, col_index: Tensor, in_blocks: int, device: torch.device) -> "LayoutIndex":
        out_blocks, k = col_index.shape
        flat = col_index.reshape(-1).cpu().long()
        order = torch.argsort(flat * (out_blocks * k) + torch.arange(flat.numel()))  # by column, then row-major
        counts = torch.bincount(flat, minlength=in_blocks)
        col_ptr = torch.zeros(in_blocks + 1, dtype=torch.long)
        torch.cumsum(counts, 0, out=col_ptr[1:])
        as_index = lambda t: t.to(device=device, dtype=torch.int32).contiguous()  # noqa: E731
        return cls(as_index(flat), as_index(col_ptr), as_index(order // k), as_index(order % k),
                   out_blocks, in_blocks, k)


@triton.jit
def _forward_kernel(x_ptr, w_ptr, col_index_ptr, y_ptr, M, K_BLOCKS, stride_xm, stride_wo, stride_wr, stride_ym,
                    BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    o = tl.program_id(0)  # fastest: the programs of one token tile run together and share its x rows in L2
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = offs_m.to(tl.int64)[:, None]
    mask_m = offs_m[:, None] < M
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BS)
    w_row = w_ptr + o.to(tl.int64) * stride_wo + offs_n[None, :] * stride_wr  # W^T tile: [k, n] = W[o][n, k]
    acc = tl.zeros((BLOCK_M, BS), dtype=tl.float32)
    for i in range(0, K_BLOCKS * (BS // BLOCK_K)):
        t = i // (BS // BLOCK_K)
        kk = (i % (BS // BLOCK_K)) * BLOCK_K
        c = tl.load(col_index_ptr + o * K_BLOCKS + t)
        x = tl.load(x_ptr + rows * stride_xm + (c * BS + kk + offs_k)[None, :], mask=mask_m, other=0.0)
        w_t = tl.load(w_row + (t * BS + kk + offs_k)[:, None])
        acc += tl.dot(x, w_t, input_precision=PRECISION)
    y = y_ptr + rows * stride_ym + (o * BS + offs_n)[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m)


@triton.jit
def _grad_input_kernel(dy_ptr, w_ptr, col_ptr_ptr, entry_row_ptr, entry_slot_ptr, dx_ptr, M, stride_dym,
                       stride_wo, stride_wr, stride_dxm,
                       BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    c = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = offs_m.to(tl.int64)[:, None]
    mask_m = offs_m[:, None] < M
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BS)
    start = tl.load(col_ptr_ptr + c)
    end = tl.load(col_ptr_ptr + c + 1)
    acc = tl.zeros((BLOCK_M, BS), dtype=tl.float32)
    for i in range(start * (BS // BLOCK_K), end * (BS // BLOCK_K)):
        e = i // (BS // BLOCK_K)
        kk = (i % (BS // BLOCK_K)) * BLOCK_K
        o = tl.load(entry_row_ptr + e)
        t = tl.load(entry_slot_ptr + e)
        dy = tl.load(dy_ptr + rows * stride_dym + (o * BS + kk + offs_k)[None, :], mask=mask_m, other=0.0)
        w = tl.load(w_ptr + o.to(tl.int64) * stride_wo + (kk + offs_k)[:, None] * stride_wr
                    + (t * BS + offs_n)[None, :])  # W[o][kk:kk + BLOCK_K, slot t]
        acc += tl.dot(dy, w, input_precision=PRECISION)
    dx = dx_ptr + rows * stride_dxm + (c * BS + offs_n)[None, :]
    tl.store(dx, acc.to(dx_ptr.dtype.element_ty), mask=mask_m)


@triton.jit
def _grad_weight_kernel(x_ptr, dy_ptr, col_index_ptr, dw_ptr, M, K_BLOCKS, stride_xm, stride_dym, stride_dwo,
                        stride_dwr,
                        BS: tl.constexpr, BLOCK_T: tl.constexpr, PRECISION: tl.constexpr):
    e = tl.program_id(0)  # one kept block: row o, slot t
    o = e // K_BLOCKS
    t = e % K_BLOCKS
    c = tl.load(col_index_ptr + e)
    offs_t = tl.arange(0, BLOCK_T)
    offs_n = tl.arange(0, BS)
    acc = tl.zeros((BS, BS), dtype=tl.float32)
    for m0 in range(0, M, BLOCK_T):
        offs_m = m0 + offs_t
        rows = offs_m.to(tl.int64)
        mask_m = offs_m < M
        dy_t = tl.load(dy_ptr + rows[None, :] * stride_dym + (o * BS + offs_n)[:, None], mask=mask_m[None, :],
                       other=0.0)  # [BS, BLOCK_T]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (c * BS + offs_n)[None, :], mask=mask_m[:, None],
                    other=0.0)  # [BLOCK_T, BS]
        acc += tl.dot(dy_t, x, input_precision=PRECISION)
    dw = dw_ptr + o.to(tl.int64) * stride_dwo + offs_n[:, None] * stride_dwr + (t * BS + offs_n)[None, :]
    tl.store(dw, acc.to(dw_ptr.dtype.element_ty))


@dataclass(frozen=True)
class _Config:
    block_m: int  # token tile of the forward and input-gradient programs
    block_k: int  # reduction step inside a block
    block_t: int  # token step of the weight-gradient programs
    num_warps: int
    precision: str


def _config(block_size: int, dtype: torch.dtype) -> _Config:
    """Fixed tiles: three pipeline stages of the two operand tiles stay under ~100 KiB of shared memory."""
    wide = dtype == torch.float32
    block_k = min(block_size, 32 if wide else 64)
    precision = "tf32" if not wide or torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return _Config(block_m=128 if block_size >= 64 else 64, block_k=block_k, block_t=32 if wide else 64,
                   num_warps=8 if block_size >= 128 else 4, precision=precision)


def _check(x: Tensor, blocks: Tensor, index: LayoutIndex) -> int:
    block_size = blocks.shape[1]
    if not supports(block_size, torch.float32):
        raise ValueError(f"the Triton kernels take block sizes 16-128 (powers of two), got {block_size}")
    if x.dtype != blocks.dtype or x.dtype not in DTYPES:
        raise TypeError(f"x and blocks must share a float32/float16/bfloat16 dtype, got {x.dtype} and {blocks.dtype}")
    if blocks.shape != (index.out_blocks, block_size, index.blocks_per_row * block_size):
        raise ValueError(f"blocks {tuple(blocks.shape)} do not match the layout index "
                         f"({index.out_blocks} rows of {index.blocks_per_row} blocks)")
    return block_size


def _on_device(x: Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current GPU: make it ``x``'s."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def blocksparse_matmul(x: Tensor, blocks: Tensor, index: LayoutIndex) -> Tensor:
    """``x @ W^T`` for x ``[tokens, in_features]`` (same dtype as ``blocks``); returns ``[tokens, out_features]``."""
    block_size = _check(x, blocks, index)
    x, blocks = x.contiguous(), blocks.contiguous()
    tokens = x.shape[0]
    cfg = _config(block_size, x.dtype)
    y = x.new_empty(tokens, index.out_blocks * block_size)
    if tokens:
        grid = (index.out_blocks, triton.cdiv(tokens, cfg.block_m))
        with _on_device(x):
            _forward_kernel[grid](x, blocks, index.col_index, y, tokens, index.blocks_per_row, x.stride(0),
                                  blocks.stride(0), blocks.stride(1), y.stride(0), BS=block_size,
                                  BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, PRECISION=cfg.precision,
                                  num_warps=cfg.num_warps, num_stages=3)
    return y


def blocksparse_matmul_backward(x: Tensor, grad_y: Tensor, blocks: Tensor, index: LayoutIndex, need_x: bool,
                                need_blocks: bool, grad_blocks_dtype: Optional[torch.dtype] = None
                                ) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Gradients of ``blocksparse_matmul`` with respect to x and blocks (None where not needed); the block
    gradient is stored in ``grad_blocks_dtype`` (``blocks.dtype`` by default) straight from the float32 sums."""
    block_size = _check(x, blocks, index)
    if grad_y.dtype != x.dtype:
        raise TypeError(f"grad_y must have x's dtype {x.dtype}, got {grad_y.dtype}")
    x, grad_y, blocks = x.contiguous(), grad_y.contiguous(), blocks.contiguous()
    tokens = x.shape[0]
    cfg = _config(block_size, x.dtype)
    grad_x = x.new_empty(tokens, index.in_blocks * block_size) if need_x else None
    grad_blocks = torch.empty(blocks.shape, dtype=grad_blocks_dtype or blocks.dtype, device=blocks.device) \
        if need_blocks else None
    with _on_device(x):
        if need_x and tokens:
            grid = (index.in_blocks, triton.cdiv(tokens, cfg.block_m))
            _grad_input_kernel[grid](grad_y, blocks, index.col_ptr, index.entry_row, index.entry_slot, grad_x, tokens,
                                     grad_y.stride(0), blocks.stride(0), blocks.stride(1), grad_x.stride(0),
                                     BS=block_size, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
                                     PRECISION=cfg.precision, num_warps=cfg.num_warps, num_stages=3)
        if need_blocks:
            grid = (index.out_blocks * index.blocks_per_row,)
            _grad_weight_kernel[grid](x, grad_y, index.col_index, grad_blocks, tokens, index.blocks_per_row,
                                      x.stride(0), grad_y.stride(0), grad_blocks.stride(0), grad_blocks.stride(1),
                                      BS=block_size, BLOCK_T=cfg.block_t, PRECISION=cfg.precision,
                                      num_warps=cfg.num_warps, num_stages=3)
    return grad_x, grad_blocks


class BlockSparseMatmul(torch.autograd.Function):
    """``y = x @ W^T`` with the Triton kernels in both directions, for use outside ``BlockSparseLinear``
    (which calls the two functions above from its own autograd entry point, shared with the native path)."""

    @staticmethod
    def forward(ctx, x: Tensor, blocks: Tensor, index: LayoutIndex) -> Tensor:
        ctx.index = index
        ctx.save_for_backward(x, blocks)
        return blocksparse_matmul(x, blocks, index)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, blocks = ctx.saved_tensors
        grad_x, grad_blocks = blocksparse_matmul_backward(x, grad_y.to(x.dtype), blocks, ctx.index,
                                                          ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return grad_x, grad_blocks, None
