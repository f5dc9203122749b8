"""The feed-forward sub-layer, with a hand-written backward that keeps only two activations.

Plain autograd would keep the layer-norm output, the pre-activation, the activation output and the dropout mask.
``_FFNFunction`` saves only the block input ``x``, the pre-activation ``h`` and, with dropout, which outputs the mask
kept (one byte each); in backward it recomputes the layer norm from ``x`` and the activation from ``h``. (The mask was
once redrawn by replaying the forward's RNG state: on a CPU that second Bernoulli draw cost as much as the rest of
the layer's forward and backward, ``benchmarks/ffn_backward.py``.) The two projections are differentiated through the ``LinearOp`` protocol, so no matmul is
recomputed, whichever kind of linear layer the config chose.

``backward_chunks`` (``set_optimizations``): the backward then runs over the tokens N chunks at a time, so the
recomputed activation and the gradients of the inner (4d-wide) tensors exist for one chunk of tokens only; the
feed-forward acts on each token alone, so the chunks' gradients concatenate (inputs) and add up (parameters) to the
unchunked ones. In a reversible stack ``backward_pieces`` chunks the recomputed forward as well.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lean_transformer.config import LeanTransformerConfig
from lean_transformer.modules.activations import get_activation, get_activation_backward
from lean_transformer.modules.linear import SharedMatrix, make_linear
from lean_transformer.modules.linear_op import even_bounds
from lean_transformer.modules.replay import AutocastState, dropout_mask

Params = tuple[Tensor, ...]
Piece = tuple[tuple, Callable[[Tensor], Tensor]]  # (index into the input and output, function of that part)


def _detached(params: Params) -> Params:
    """Leaf copies of ``params`` that track gradients exactly where the originals need them."""
    return tuple(p.detach().requires_grad_(p.requires_grad) for p in params)


def _grad(outputs: Tensor, inputs: Sequence[Tensor], grad_outputs: Tensor) -> list[Optional[Tensor]]:
    """Local autograd through a cheap element-wise recomputation (layer norm, activation)."""
    wanted = [t for t in inputs if t.requires_grad]
    grads = iter(torch.autograd.grad(outputs, wanted, grad_outputs.to(outputs.dtype)) if wanted else ())
    return [next(grads) if t.requires_grad else None for t in inputs]


class LeanFFN(nn.Module):
    """``dropout(post_norm?(W_out act(W_in LayerNorm(x))))``; the caller adds the residual."""

    def __init__(self, config: LeanTransformerConfig, shared_in: Optional[SharedMatrix] = None,
                 shared_out: Optional[SharedMatrix] = None):
        super().__init__()
        inner = config.intermediate_size * (2 if config.is_gated else 1)
        self.pre_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dense_in = make_linear(config, config.hidden_size, inner, shared=shared_in)
        self.dense_out = make_linear(config, config.intermediate_size, config.hidden_size, shared=shared_out)
        self.post_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.sandwich_norm else None
        self.activation = get_activation(config.hidden_act)
        self.activation_backward = get_activation_backward(config.hidden_act)
        self.dropout = config.hidden_dropout_prob
        self.custom_grad = True  # set by LeanPreTrainedModel.set_optimizations(ffn_custom_grad=...)
        self.backward_chunks = 1  # set by LeanPreTrainedModel.set_optimizations(backward_chunks=...)

    def _parts(self) -> list[Params]:
        """The parameter groups in the order (pre-norm, dense_in, dense_out, post-norm); post-norm may be empty."""
        post = () if self.post_norm is None else (self.post_norm.weight, self.post_norm.bias)
        return [(self.pre_norm.weight, self.pre_norm.bias), self.dense_in.op_params(), self.dense_out.op_params(),
                post]

    def split_params(self, flat: Sequence[Tensor]) -> list[Params]:
        """Undo the flattening of ``_parts()``, using each part's current length."""
        groups, start = [], 0
        for part in self._parts():
            groups.append(tuple(flat[start:start + len(part)]))
            start += len(part)
        return groups

    def _norm(self, x: Tensor, params: Params) -> Tensor:
        return F.layer_norm(x, x.shape[-1:], *params, eps=self.pre_norm.eps)

    def compute(self, x: Tensor, groups: list[Params], dropout_p: float) -> tuple[Tensor, Tensor, Tensor]:
        """The forward pass from explicit parameters; returns (pre-activation, pre-post-norm output, output)."""
        pre_norm, dense_in, dense_out, post_norm = groups
        hidden = self.dense_in.op_forward(self._norm(x, pre_norm), dense_in)
        projected = self.dense_out.op_forward(self.activation(hidden), dense_out)
        out = self._norm(projected, post_norm) if post_norm else projected
        if dropout_p > 0:
            out = out * dropout_mask(out.shape, dropout_p, out.dtype, out.device)
        return hidden, projected, out

    def forward(self, x: Tensor) -> Tensor:
        return self._forward(x, self.dropout if self.training else 0.0, self.backward_chunks)

    def _forward(self, x: Tensor, dropout_p: float, chunks: int) -> Tensor:
        flat = tuple(t for part in self._parts() for t in part)
        if self.custom_grad and torch.is_grad_enabled() and any(t.requires_grad for t in (x, *flat)):
            return _FFNFunction.apply(self, dropout_p, chunks, x, *flat)
        return self.compute(x, self.split_params(flat), dropout_p)[-1]

    def backward_pieces(self, x: Tensor) -> Optional[list[Piece]]:
        """The forward pass as ``backward_chunks`` pieces over the tokens (dim 1 of x), or None for one chunk; piece
        i computes the output rows ``index`` from the input rows ``index``. Run under the forward's replayed RNG
        state: the dropout mask is drawn once for the whole output (exactly as in forward), when the first piece
        runs."""
        if self.backward_chunks == 1:
            return None
        dropout_p = self.dropout if self.training else 0.0
        mask: list[Tensor] = []

        def piece(index: tuple, part: Tensor) -> Tensor:
            out = self._forward(part, 0.0, 1)
            if dropout_p == 0:
                return out
            if not mask:
                mask.append(dropout_mask((*x.shape[:-1], out.shape[-1]), dropout_p, out.dtype, out.device))
            return out * mask[0][index]

        bounds = even_bounds(x.shape[1], self.backward_chunks)
        indices = [(slice(None), slice(start, end)) for start, end in zip(bounds[:-1], bounds[1:]) if end > start]
        return [(index, functools.partial(piece, index)) for index in indices]


class _FFNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ffn: LeanFFN, dropout_p: float, chunks: int, x: Tensor, *flat: Tensor) -> Tensor:
        ctx.ffn, ctx.dropout_p, ctx.chunks = ffn, dropout_p, chunks
        ctx.autocast = AutocastState.capture()
        hidden, projected, out = ffn.compute(x, ffn.split_params(flat), 0.0)
        kept = None
        if dropout_p > 0:  # the very mask compute() would draw: 0 or 1/(1-p), rebuilt exactly from where it is not 0
            mask = dropout_mask(out.shape, dropout_p, out.dtype, out.device)
            out, kept = out * mask, mask != 0
        ctx.out_dtype = out.dtype
        keep_projected = ffn.post_norm is not None  # the post-norm's backward needs its input
        ctx.save_for_backward(x, hidden, projected if keep_projected else None, kept, *flat)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        ffn: LeanFFN = ctx.ffn
        x, hidden, projected, kept, *flat = ctx.saved_tensors
        groups = ffn.split_params(flat)
        with ctx.autocast.restore():
            grad = grad_out
            if kept is not None:
                grad = grad * kept.to(ctx.out_dtype).div_(1.0 - ctx.dropout_p)
            rows = [_rows(t) if t is not None else None for t in (x, hidden, projected, grad)]
            needs_x = ctx.needs_input_grad[3]
            grad_x = torch.empty(rows[0].shape, dtype=x.dtype, device=x.device) if needs_x else None
            totals: list[Optional[Tensor]] = [None] * len(flat)
            bounds = even_bounds(rows[0].shape[0], ctx.chunks)
            for start, end in zip(bounds[:-1], bounds[1:]):
                if end > start:
                    chunk = [t[start:end] if t is not None else None for t in rows]
                    chunk_grad_x, grads = _backward_rows(ffn, groups, needs_x, *chunk)
                    if grad_x is not None:
                        grad_x[start:end] = chunk_grad_x
                    totals = [g if acc is None else acc if g is None else acc + g for acc, g in zip(totals, grads)]
        grad_x = grad_x.view(x.shape) if grad_x is not None else None
        return None, None, None, grad_x, *totals


def _rows(t: Tensor) -> Tensor:
    """[..., n] -> [tokens, n]."""
    return t.reshape(-1, t.shape[-1])


def _backward_rows(ffn: LeanFFN, groups: list[Params], needs_x: bool, x: Tensor, hidden: Tensor,
                   projected: Optional[Tensor],
                   grad: Tensor) -> tuple[Optional[Tensor], list[Optional[Tensor]]]:
    """The feed-forward's backward for some tokens (rows); parameter gradients in ``_parts()`` order."""
    pre_norm, dense_in, dense_out, post_norm = groups
    grads_post: list[Optional[Tensor]] = []
    if post_norm:
        with torch.enable_grad():
            inputs = (projected.detach().requires_grad_(), *_detached(post_norm))
            normed = ffn._norm(inputs[0], inputs[1:])
        grad, *grads_post = _grad(normed, inputs, grad)

    if ffn.activation_backward is not None:  # element-wise: its backward reads the pre-activation only, so the
        activated = ffn.activation(hidden)  # recomputed activation is gone before it (one 4d-wide tensor less)
        grad_act, grads_out = ffn.dense_out.op_backward(activated, grad.to(activated.dtype), dense_out)
        del activated
        grad_hidden = ffn.activation_backward(grad_act.to(hidden.dtype), hidden)
    else:
        with torch.enable_grad():
            hidden_leaf = hidden.detach().requires_grad_()
            activated = ffn.activation(hidden_leaf)
        grad_act, grads_out = ffn.dense_out.op_backward(activated.detach(), grad.to(activated.dtype), dense_out)
        (grad_hidden,) = _grad(activated, (hidden_leaf,), grad_act)
        del activated
    del grad_act

    with torch.enable_grad():
        inputs = (x.detach().requires_grad_(needs_x), *_detached(pre_norm))
        normed = ffn._norm(inputs[0], inputs[1:])
    grad_normed, grads_in = ffn.dense_in.op_backward(normed.detach(), grad_hidden.to(hidden.dtype), dense_in)
    grad_x, *grads_pre = _grad(normed, inputs, grad_normed)
    return grad_x, [*grads_pre, *grads_in, *grads_out, *grads_post]
