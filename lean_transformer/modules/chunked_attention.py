"""Exact attention in chunks of queries, for where no fused kernel applies: memory O(chunk_size x key_len) per
batch and head instead of the whole [query_len, key_len] matrix, in forward and in backward.

Which CPU cases need it (torch 2.13, measured with ``torch._fused_sdp_choice`` and the allocator's peak in
``benchmarks/attention.py``): CPU SDPA runs its fused flash kernel without dropout, with or without a mask, in
float32, float64 and bfloat16; with a mask it needs the dense [batch, 1, query_len, key_len] mask (the allocator's
peak suggests it also makes a float copy: about 5 bytes per entry per sequence, O(T^2) but not per head). With
``dropout_p > 0`` it falls back to the math kernel, which materializes the attention matrix several times over
(probabilities, dropout mask, their gradients). On CUDA, per PyTorch's documentation, the memory-efficient kernel
takes masks and dropout (flash: dropout, no mask), so this path is for CPU.

Why our own: no kept library has a CPU attention that is exact, trains with dropout and stays linear in memory
(torch's fused CPU kernel takes no dropout). This one is a custom autograd Function: forward keeps q, k, v, the
output and each query's log-sum-exp of scores; backward recomputes each chunk's probabilities from them (the
flash-attention recurrence, ``dS = P * (dP - rowsum(dO * O))``). A chunk holds whole key rows, so its softmax is
exact at once; the saved log-sum-exp is what lets backward rebuild the probabilities without a second reduction.
Dropout masks are drawn chunk by chunk from the RNG state captured at forward and drawn again, in the same order,
from that state in backward, so forward and backward use the same masks and the caller's RNG stream advances as if
the forward ran once.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lean_transformer.modules.attention_mask import AttentionMask
from lean_transformer.modules.replay import RNGState, dropout_mask

DEFAULT_CHUNK_SIZE = 128


def chunked_attention(query: Tensor, key: Tensor, value: Tensor, mask: Optional[AttentionMask] = None,
                      causal: bool = False, dropout_p: float = 0.0, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """What ``F.scaled_dot_product_attention(query, key, value, mask.dense(), dropout_p, is_causal)`` computes
    (with other dropout masks), for [batch, heads, seq, head_dim] inputs; queries are the last ``query_len`` of the
    ``key_len`` positions. Computed in float32 (float64 for float64 inputs), returned in the inputs' dtype."""
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if mask is None and causal and query.shape[2] > 1:
        mask = AttentionMask(None, query.shape[2], key.shape[2], causal=True)
    return _ChunkedAttention.apply(query, key, value, mask, dropout_p, chunk_size)


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, mask: Optional[AttentionMask], dropout_p: float,
                chunk_size: int) -> Tensor:
        ctx.mask, ctx.dropout_p, ctx.chunk_size = mask, dropout_p, chunk_size
        ctx.rng = RNGState.capture(query) if dropout_p > 0 else None
        output = torch.empty_like(query)
        logsumexp = query.new_empty(query.shape[:-1], dtype=_compute_dtype(query))
        with torch.autocast(query.device.type, enabled=False):  # the compute dtype is ours, not autocast's
            value_c = value.to(logsumexp.dtype)
            for start, end, probs in _chunk_probs(query, key, mask, chunk_size, logsumexp, fill=True):
                if dropout_p > 0:
                    probs = probs * dropout_mask(probs.shape, dropout_p, probs.dtype, probs.device)
                output[:, :, start:end] = (probs @ value_c).to(output.dtype)
        ctx.save_for_backward(query, key, value, output, logsumexp)
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: Tensor):
        query, key, value, output, logsumexp = ctx.saved_tensors
        dtype = logsumexp.dtype
        grad_query = torch.empty_like(query)
        grad_key = torch.zeros_like(key, dtype=dtype)
        grad_value = torch.zeros_like(value, dtype=dtype)
        scale = 1 / math.sqrt(query.shape[-1])
        key_c, value_c = key.to(dtype), value.to(dtype)
        replay = ctx.rng.replay() if ctx.rng is not None else contextlib.nullcontext()
        with replay, torch.autocast(query.device.type, enabled=False):
            for start, end, probs in _chunk_probs(query, key, ctx.mask, ctx.chunk_size, logsumexp, fill=False):
                grad_out = grad_output[:, :, start:end].to(dtype)
                grad_probs = grad_out @ value_c.transpose(-1, -2)
                if ctx.dropout_p > 0:
                    keep = dropout_mask(probs.shape, ctx.dropout_p, dtype, probs.device)
                    grad_value += (probs * keep).transpose(-1, -2) @ grad_out
                    grad_probs *= keep
                else:
                    grad_value += probs.transpose(-1, -2) @ grad_out
                delta = (grad_out * output[:, :, start:end].to(dtype)).sum(-1, keepdim=True)
                grad_scores = probs.mul_(grad_probs.sub_(delta)).mul_(scale)
                grad_query[:, :, start:end] = (grad_scores @ key_c).to(grad_query.dtype)
                grad_key += grad_scores.transpose(-1, -2) @ query[:, :, start:end].to(dtype)
        return grad_query, grad_key.to(key.dtype), grad_value.to(value.dtype), None, None, None


def _compute_dtype(tensor: Tensor) -> torch.dtype:
    return torch.promote_types(tensor.dtype, torch.float32)


def _chunk_probs(query: Tensor, key: Tensor, mask: Optional[AttentionMask], chunk_size: int, logsumexp: Tensor,
                 fill: bool) -> Iterator[tuple[int, int, Tensor]]:
    """Yield (start, end, probabilities [batch, heads, end - start, key_len]) for each chunk of queries, in order.
    ``logsumexp`` [batch, heads, query_len] (the compute dtype) is filled in (forward) or read (backward)."""
    scale = 1 / math.sqrt(query.shape[-1])
    key_c = key.to(logsumexp.dtype)
    for start in range(0, query.shape[2], chunk_size):
        end = min(start + chunk_size, query.shape[2])
        scores = (query[:, :, start:end].to(logsumexp.dtype) @ key_c.transpose(-1, -2)).mul_(scale)
        if mask is not None:
            scores.masked_fill_(~mask.rows(start, end, query.device), -math.inf)
        if fill:
            logsumexp[:, :, start:end] = torch.logsumexp(scores, -1)
        yield start, end, scores.sub_(logsumexp[:, :, start:end, None]).exp_()
