"""The feed-forward sub-layer, with a hand-written backward that keeps only two activations.

Plain autograd would keep the layer-norm output, the pre-activation, the activation output and the dropout mask.
``_FFNFunction`` saves only the block input ``x`` and the pre-activation ``h``; in backward it recomputes the layer
norm from ``x``, the activation from ``h`` and the dropout mask by replaying the forward's RNG state (restoring the
caller's afterwards). The two projections are differentiated through the ``LinearOp`` protocol, so no matmul is
recomputed, whichever kind of linear layer the config chose.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lean_transformer.config import LeanTransformerConfig
from lean_transformer.modules.activations import get_activation
from lean_transformer.modules.linear import SharedMatrix, make_linear
from lean_transformer.modules.replay import AutocastState, RNGState, dropout_mask

Params = tuple[Tensor, ...]


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
        self.dropout = config.hidden_dropout_prob
        self.custom_grad = True  # set by LeanPreTrainedModel.set_optimizations(ffn_custom_grad=...)

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
        dropout_p = self.dropout if self.training else 0.0
        flat = tuple(t for part in self._parts() for t in part)
        if self.custom_grad and torch.is_grad_enabled() and any(t.requires_grad for t in (x, *flat)):
            return _FFNFunction.apply(self, dropout_p, x, *flat)
        return self.compute(x, self.split_params(flat), dropout_p)[-1]


class _FFNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ffn: LeanFFN, dropout_p: float, x: Tensor, *flat: Tensor) -> Tensor:
        ctx.ffn, ctx.dropout_p = ffn, dropout_p
        ctx.autocast = AutocastState.capture()
        ctx.rng = RNGState.capture(x) if dropout_p > 0 else None
        hidden, projected, out = ffn.compute(x, ffn.split_params(flat), dropout_p)
        ctx.out_dtype = out.dtype
        keep_projected = ffn.post_norm is not None  # the post-norm's backward needs its input
        ctx.save_for_backward(x, hidden, projected if keep_projected else None, *flat)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        ffn: LeanFFN = ctx.ffn
        x, hidden, projected, *flat = ctx.saved_tensors
        pre_norm, dense_in, dense_out, post_norm = ffn.split_params(flat)
        grads_post: list[Optional[Tensor]] = []
        with ctx.autocast.restore():
            grad = grad_out
            if ctx.dropout_p > 0:
                with ctx.rng.replay():
                    grad = grad * dropout_mask(grad_out.shape, ctx.dropout_p, ctx.out_dtype, grad_out.device)
            if post_norm:
                with torch.enable_grad():
                    inputs = (projected.detach().requires_grad_(), *_detached(post_norm))
                    normed = ffn._norm(inputs[0], inputs[1:])
                grad, *grads_post = _grad(normed, inputs, grad)

            with torch.enable_grad():
                hidden_leaf = hidden.detach().requires_grad_()
                activated = ffn.activation(hidden_leaf)
            grad_act, grads_out = ffn.dense_out.op_backward(activated.detach(), grad.to(activated.dtype), dense_out)
            (grad_hidden,) = _grad(activated, (hidden_leaf,), grad_act)

            with torch.enable_grad():
                inputs = (x.detach().requires_grad_(x.requires_grad), *_detached(pre_norm))
                normed = ffn._norm(inputs[0], inputs[1:])
            grad_normed, grads_in = ffn.dense_in.op_backward(normed.detach(), grad_hidden.to(hidden.dtype), dense_in)
            grad_x, *grads_pre = _grad(normed, inputs, grad_normed)
        grad_x = grad_x.to(x.dtype) if grad_x is not None else None
        return None, None, grad_x, *grads_pre, *grads_in, *grads_out, *grads_post
