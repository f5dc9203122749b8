"""Block-wise 8-bit quantization of optimizer moments, built from plain vectorized torch ops.

Each block of ``block_size`` consecutive values keeps a float32 absmax; inside a block a value is stored as
one byte on a companded (power-law) scale instead of a looked-up dynamic map, so encoding is a handful of
elementwise ops rather than a binary search (``torch.bucketize`` runs at ~0.06 G values/s here, too slow
for an optimizer step).

* signed values (first moment): ``q = round(127 * sign(x) * sqrt(|x| / absmax))``, stored as the int8 byte
  of ``q``; decoded as ``q * |q| * absmax / 127**2``.
* non-negative values (second moment): ``q = round(255 * (x / absmax) ** (1/4))``, stored as uint8;
  decoded as ``(q / 255) ** 4 * absmax``. The fourth root keeps about ten decades of dynamic range, so
  small second moments do not collapse to zero and blow up ``m / sqrt(v)``.

Like bitsandbytes' dynamic map, both codes spend more levels near zero than a linear code; on
Adam-like moments they have a lower relative RMSE than ``bitsandbytes.functional.quantize_blockwise``
(asserted in tests/test_optim_quantization.py).

The ``*_`` functions work on preallocated buffers and are the pieces the fused optimizer kernel uses;
``quantize_blockwise`` / ``dequantize_blockwise`` are allocating conveniences built from them.
"""

from __future__ import annotations

from typing import Optional

import torch

SIGNED_LEVELS = 127
UNSIGNED_LEVELS = 255
# the smallest normal float32, added before a (r)sqrt: rsqrt(0) * 0 would be NaN, and zeros or denormals
# send torch's CPU sqrt down a ~5x slower path
TINY = torch.finfo(torch.float32).tiny


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def block_views(x: torch.Tensor, block_size: int) -> list[tuple[torch.Tensor, Optional[slice]]]:
    """(2-D view of whole blocks, their block indices or None for all) pairs; a trailing partial block is its
    own row. Runs several times per tile, so the common case (whole blocks only) stays cheap."""
    numel = x.numel()
    full = numel // block_size
    if numel == full * block_size:
        return [(x.view(full, block_size), None)]
    views = [(x[: full * block_size].view(full, block_size), slice(0, full))] if full else []
    return views + [(x[full * block_size :].view(1, -1), slice(full, full + 1))]


def mul_blocks_(x: torch.Tensor, per_block: torch.Tensor, block_size: int) -> torch.Tensor:
    """x[i] *= per_block[i // block_size], in place."""
    for rows, idx in block_views(x, block_size):
        rows.mul_((per_block if idx is None else per_block[idx]).unsqueeze(1))
    return x


def amax_blocks(x: torch.Tensor, block_size: int, out: torch.Tensor) -> torch.Tensor:
    """out[j] = max of x over block j; ``x`` must already be non-negative (e.g. ``|m|`` or ``v``)."""
    for rows, idx in block_views(x, block_size):
        torch.amax(rows, dim=1, out=out if idx is None else out[idx])
    return out


def encode_signed_(
    x: torch.Tensor, x_abs: torch.Tensor, absmax: torch.Tensor, block_size: int, codes: torch.Tensor
) -> None:
    """codes (int8) <- round(127 * sign(x) * sqrt(|x| / absmax)); ``x_abs`` holds |x| on entry. Both are
    overwritten (used as scratch)."""
    # as x * rsqrt(|x| + tiny) * 127 / sqrt(absmax): cheaper than sqrt + copysign, and the tiny term turns
    # 0 * inf into 0 for zeros (including all-zero blocks)
    x.mul_(x_abs.add_(TINY).rsqrt_())
    mul_blocks_(x, absmax.clamp_min(TINY).rsqrt_().mul_(SIGNED_LEVELS), block_size).round_()
    codes.copy_(x)


def decode_signed_(
    codes: torch.Tensor,
    scale: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
    scratch: torch.Tensor,
    add: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """out <- add + q * |q| * scale[block] (``add`` defaults to 0); pass ``scale = absmax / 127**2`` times any
    factor to fold in. Adding in the same pass saves a sweep when the caller updates the decoded value."""
    out.copy_(codes)
    torch.abs(out, out=scratch)
    mul_blocks_(scratch, scale, block_size)
    if add is None:
        return out.mul_(scratch)
    return torch.addcmul(add, out, scratch, out=out)


def encode_unsigned_from_sqrt_(
    sqrt_x: torch.Tensor, absmax: torch.Tensor, block_size: int, codes: torch.Tensor
) -> None:
    """codes (uint8) <- 255 * (x / absmax) ** (1/4), given sqrt(x) (consumed as scratch)."""
    scale = absmax.clamp_min(TINY).rsqrt_().mul_(UNSIGNED_LEVELS**2)
    mul_blocks_(sqrt_x, scale, block_size).sqrt_().round_()
    codes.copy_(sqrt_x)


def decode_unsigned_(codes: torch.Tensor, scale: torch.Tensor, block_size: int, out: torch.Tensor) -> torch.Tensor:
    """out <- q ** 4 * scale[block]; pass ``scale = absmax / 255**4`` (times any factor to fold in)."""
    out.copy_(codes)
    out.mul_(out)
    out.mul_(out)
    return mul_blocks_(out, scale, block_size)


def quantize_blockwise(x: torch.Tensor, signed: bool, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode a float tensor; returns (uint8 codes shaped like x, float32 absmax per block)."""
    flat = x.detach().reshape(-1).to(torch.float32, copy=True)  # the signed encoder overwrites its input
    absmax = torch.empty(num_blocks(flat.numel(), block_size))
    codes = torch.empty(flat.shape, dtype=torch.uint8)
    scratch = flat.abs()
    if signed:
        amax_blocks(scratch, block_size, absmax)
        encode_signed_(flat, scratch, absmax, block_size, codes.view(torch.int8))
    else:
        if (flat < 0).any():
            raise ValueError("unsigned quantization needs non-negative values")
        amax_blocks(flat, block_size, absmax)
        encode_unsigned_from_sqrt_(scratch.sqrt_(), absmax, block_size, codes)
    return codes.view(x.shape), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool, block_size: int) -> torch.Tensor:
    """Decode what :func:`quantize_blockwise` produced into a float32 tensor shaped like ``codes``."""
    flat = codes.reshape(-1)
    out = torch.empty(flat.shape)
    if signed:
        decode_signed_(flat.view(torch.int8), absmax / SIGNED_LEVELS**2, block_size, out, torch.empty_like(out))
    else:
        decode_unsigned_(flat, absmax / float(UNSIGNED_LEVELS) ** 4, block_size, out)
    return out.view(codes.shape)
