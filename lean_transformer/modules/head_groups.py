"""The attention sub-layer as a sum over groups of heads, for a backward pass that runs one group at a time.

After the output projection, attention is a sum of per-head terms: ``out = sum_h W_o[:, h] attend_h(x) + b_o``, and
head h reads only its own rows of the q/k/v projection. So the gradient of the whole is the sum of the groups'
gradients, and a reversible stack (``set_optimizations(backward_chunks=N)``) can recompute and backpropagate N head
groups one after the other, keeping one group's q, k, v, attention output and their gradients at a time.

This needs the projections' rows and columns per head, so it applies to dense q/k/v and output projections, with
no post-norm (the sandwich norm mixes the heads) and no attention dropout (SDPA draws its dropout inside the
kernel, so a head group cannot replay its part of the mask); ``set_optimizations`` rejects the other cases. The
output dropout is linear and is replayed as a whole-output mask. Kept apart from ``attention.py`` because it
restates that forward pass one head group at a time; the test suite checks that both give the same gradients.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lean_transformer.modules.attention import LeanSelfAttention
from lean_transformer.modules.attention_mask import AttentionMask
from lean_transformer.modules.linear import DenseLinear
from lean_transformer.modules.linear_op import even_bounds
from lean_transformer.modules.rotary import apply_rotary

Piece = tuple[tuple, Callable[[Tensor], Tensor]]


def supports_head_groups(attention: LeanSelfAttention) -> Optional[str]:
    """None if ``attention`` can run in head groups, else why not."""
    if not (isinstance(attention.qkv, DenseLinear) and isinstance(attention.out_proj, DenseLinear)):
        return "the attention projections are shared or block-sparse (head groups need dense projections)"
    if attention.post_norm is not None:
        return "sandwich_norm=True (the post-norm mixes the heads)"
    if attention.attention_dropout > 0:
        return "attention_probs_dropout_prob > 0 (SDPA's dropout mask cannot be replayed one head group at a time)"
    return None


def head_group_pieces(attention: LeanSelfAttention, x: Tensor, chunks: int,
                      attention_mask: Optional[AttentionMask] = None, causal: bool = False,
                      rotary: Optional[tuple[Tensor, Tensor]] = None) -> list[Piece]:
    """``attention(x, ...)`` as ``min(chunks, num_heads)`` pieces whose outputs add up to it; each piece reads the
    whole input (index ``(...,)``). Run under the forward's replayed RNG state: the output dropout mask is drawn
    once for the whole output, when the first piece runs, exactly as ``F.dropout`` drew it in forward."""
    reason = supports_head_groups(attention)
    if reason is not None:
        raise ValueError(f"backward_chunks > 1 cannot split this attention into head groups: {reason}")
    heads, head_dim = attention.num_heads, attention.head_dim
    dropout_p = attention.output_dropout if attention.training else 0.0
    is_causal = causal and attention_mask is None
    dense_mask = attention_mask.dense(x.device) if attention_mask is not None else None
    mask: list[Tensor] = []

    def piece(first: int, last: int, part: Tensor) -> Tensor:
        batch, seq_len, hidden_size = part.shape
        qkv_weight = attention.qkv.weight.view(3, heads, head_dim, hidden_size)[:, first:last].reshape(-1, hidden_size)
        qkv_bias = attention.qkv.bias
        if qkv_bias is not None:
            qkv_bias = qkv_bias.view(3, heads, head_dim)[:, first:last].reshape(-1)
        qkv = F.linear(attention.pre_norm(part), qkv_weight, qkv_bias).view(batch, seq_len, 3, last - first, head_dim)
        if rotary is not None:
            cos, sin = (table.to(qkv.dtype)[:, :, None, None] for table in rotary)
            qkv = torch.cat([apply_rotary(qkv[:, :, :2], cos, sin), qkv[:, :, 2:]], 2)
        query, key, value = qkv.transpose(1, 3).unbind(2)
        attended = F.scaled_dot_product_attention(query, key, value, attn_mask=dense_mask, is_causal=is_causal)
        out_weight = attention.out_proj.weight.view(hidden_size, heads, head_dim)[:, first:last]
        out_weight = out_weight.reshape(hidden_size, -1)
        out_bias = attention.out_proj.bias if first == 0 else None  # the bias belongs to one piece only
        out = F.linear(attended.transpose(1, 2).reshape(batch, seq_len, -1), out_weight, out_bias)
        if dropout_p == 0:
            return out
        if not mask:
            mask.append(F.dropout(torch.ones_like(out), dropout_p, training=True))
        return out * mask[0]

    bounds = even_bounds(heads, min(chunks, heads))
    return [((...,), functools.partial(piece, first, last)) for first, last in zip(bounds[:-1], bounds[1:])]
