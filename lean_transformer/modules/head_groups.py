"""The attention sub-layer's recomputation and backward in a reversible stack, one group of heads at a time.

After the output projection, attention is a sum of per-head terms: ``out = sum_h W_o[:, h] attend_h(x) + b_o``, and
head h reads only its own rows of the q/k/v projection. So the gradient of the whole is the sum of the groups'
gradients, and a reversible stack (``set_optimizations(backward_chunks=N)``) can recompute and backpropagate N head
groups one after the other, keeping one group's q, k, v, attention output and their gradients at a time.

What stays whole-size is written in place: the layer norm runs once and its output gradient is accumulated over the
groups (``addmm_``), each group's output is subtracted from the residual stream in place, and each group's weight
gradients are written into its rows (q/k/v) or columns (output) of the whole weight gradient. So a step holds the
normed input, its gradient and one group's small tensors besides the streams; autograd over the sliced weights
would instead build a zero-padded whole-size weight gradient per group, and over the output a whole-size temporary.

This needs the projections' rows and columns per head, so it applies to dense q/k/v and output projections, with
no post-norm (the sandwich norm mixes the heads) and no attention dropout (SDPA draws its dropout inside the
kernel, so a head group cannot replay its part of the mask); ``set_optimizations`` rejects the other cases. The
output dropout is linear and is replayed as a whole-output mask. Kept apart from ``attention.py`` because it
restates that forward pass one head group at a time; the test suite checks that both give the same gradients.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lean_transformer.modules.attention import LeanSelfAttention
from lean_transformer.modules.attention_mask import AttentionMask
from lean_transformer.modules.linear import DenseLinear
from lean_transformer.modules.linear_op import even_bounds
from lean_transformer.modules.rotary import apply_rotary


def supports_head_groups(attention: LeanSelfAttention) -> Optional[str]:
    """None if ``attention`` can run in head groups, else why not."""
    if not (isinstance(attention.qkv, DenseLinear) and isinstance(attention.out_proj, DenseLinear)):
        return "the attention projections are shared or block-sparse (head groups need dense projections)"
    if attention.post_norm is not None:
        return "sandwich_norm=True (the post-norm mixes the heads)"
    if attention.attention_dropout > 0:
        return "attention_probs_dropout_prob > 0 (SDPA's dropout mask cannot be replayed one head group at a time)"
    return None


def _add_product(out: Tensor, a: Tensor, b: Tensor, alpha: float = 1.0) -> None:
    """``out += alpha * a @ b`` for 2-d views; in place without a temporary where the dtypes agree (under autocast
    the product runs in the autocast dtype, as the forward's did)."""
    if a.dtype == b.dtype == out.dtype:
        out.addmm_(a, b, alpha=alpha)
    else:
        out.add_(a @ b, alpha=alpha)


def head_group_backward(attention: LeanSelfAttention, x: Tensor, grad_out: Tensor, residual: Tensor, grad_x: Tensor,
                        chunks: int, attention_mask: Optional[AttentionMask] = None, causal: bool = False,
                        rotary: Optional[tuple[Tensor, Tensor]] = None) -> list[tuple[Tensor, Tensor]]:
    """Recompute ``f = attention(x, ...)`` and backpropagate ``grad_out`` through it in ``min(chunks, num_heads)``
    head groups: subtracts f from ``residual`` and adds the input gradient to ``grad_x``, both in place; returns
    ``(parameter, gradient)`` pairs for the parameters that need one. Run under the forward's replayed RNG state
    (the output dropout mask is drawn first, as ``F.dropout`` drew it in forward after a dropout-free SDPA)."""
    reason = supports_head_groups(attention)
    if reason is not None:
        raise ValueError(f"backward_chunks > 1 cannot split this attention into head groups: {reason}")
    heads, head_dim = attention.num_heads, attention.head_dim
    batch, seq_len, hidden_size = x.shape
    tokens = batch * seq_len
    qkv_weight, qkv_bias = attention.qkv.weight, attention.qkv.bias
    out_weight, out_bias = attention.out_proj.weight, attention.out_proj.bias
    is_causal = causal and attention_mask is None
    dense_mask = attention_mask.dense(x.device) if attention_mask is not None else None

    grad = grad_out
    if attention.training and attention.output_dropout > 0:  # f = mask * projection: its gradient is grad * mask
        mask = F.dropout(torch.ones_like(grad_out), attention.output_dropout, training=True)
        grad = grad_out * mask
    else:
        mask = None
    grad_rows = grad.reshape(tokens, hidden_size)
    residual_rows = residual.view(tokens, hidden_size)

    with torch.enable_grad():
        x_leaf = x.detach().requires_grad_()
        normed = attention.pre_norm(x_leaf)
    normed_rows = normed.detach().reshape(tokens, -1)
    grad_normed = torch.zeros_like(normed_rows)
    wanted = {id(p): p.requires_grad for p in (qkv_weight, qkv_bias, out_weight, out_bias) if p is not None}
    grad_qkv_weight = torch.empty_like(qkv_weight) if wanted[id(qkv_weight)] else None
    grad_qkv_bias = torch.empty_like(qkv_bias) if qkv_bias is not None and wanted[id(qkv_bias)] else None
    grad_out_weight = torch.empty_like(out_weight) if wanted[id(out_weight)] else None

    bounds = even_bounds(heads, min(chunks, heads))
    for first, last in zip(bounds[:-1], bounds[1:]):
        group = last - first
        # q, k and v of the group as three leaves (not one [tokens, 3, group, head_dim] tensor): their backward
        # then builds no zero-padded whole-group gradient through the concatenation around the rotary embedding
        rows = [qkv_weight.detach().view(3, heads, head_dim, hidden_size)[i, first:last].reshape(-1, hidden_size)
                for i in range(3)]
        biases = [None] * 3 if qkv_bias is None else \
            [qkv_bias.detach().view(3, heads, head_dim)[i, first:last].reshape(-1) for i in range(3)]
        columns = out_weight.detach().view(hidden_size, heads, head_dim)[:, first:last].reshape(hidden_size, -1)
        with torch.enable_grad():
            leaves = [F.linear(normed_rows, w, b).requires_grad_() for w, b in zip(rows, biases)]
            query, key, value = (leaf.view(batch, seq_len, group, head_dim) for leaf in leaves)
            if rotary is not None:
                cos, sin = (table.to(query.dtype)[:, :, None] for table in rotary)
                query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
            attended = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2),
                                                      value.transpose(1, 2), attn_mask=dense_mask,
                                                      is_causal=is_causal)
            attended_rows = attended.transpose(1, 2).reshape(tokens, group * head_dim)
            del query, key, value, attended
        if mask is None:  # the group's share of f, subtracted from the stream without a whole-size temporary
            _add_product(residual_rows, attended_rows.detach(), columns.t(), alpha=-1.0)
        else:
            residual_rows.sub_(F.linear(attended_rows.detach(), columns).mul_(mask.view(tokens, hidden_size)))
        if grad_out_weight is not None:
            grad_out_weight.view(hidden_size, heads, head_dim)[:, first:last] = (
                grad_rows.t() @ attended_rows.detach()).view(hidden_size, group, head_dim)
        grads_qkv = torch.autograd.grad(attended_rows, leaves, grad_rows @ columns)
        del attended_rows, leaves
        for i, grad_qkv in enumerate(grads_qkv):
            _add_product(grad_normed, grad_qkv, rows[i])
            if grad_qkv_weight is not None:
                grad_qkv_weight.view(3, heads, head_dim, hidden_size)[i, first:last] = (
                    grad_qkv.t() @ normed_rows).view(group, head_dim, hidden_size)
            if grad_qkv_bias is not None:
                grad_qkv_bias.view(3, heads, head_dim)[i, first:last] = grad_qkv.sum(0).view(group, head_dim)
        del grads_qkv
    if out_bias is not None:
        residual_rows -= out_bias.detach() if mask is None else out_bias.detach() * mask.view(tokens, hidden_size)
    del normed_rows

    norm_params = [p for p in (attention.pre_norm.weight, attention.pre_norm.bias) if p.requires_grad]
    grad_input, *grads_norm = torch.autograd.grad(normed, [x_leaf, *norm_params], grad_normed.view_as(normed))
    grad_x += grad_input
    result = list(zip(norm_params, grads_norm))
    result += [(p, g) for p, g in ((qkv_weight, grad_qkv_weight), (qkv_bias, grad_qkv_bias),
                                   (out_weight, grad_out_weight)) if g is not None]
    if out_bias is not None and out_bias.requires_grad:
        result.append((out_bias, grad_rows.sum(0)))
    return result
