"""Linear layer + cross-entropy without the full logits: the vocabulary projection and the loss, a chunk of tokens
at a time.

For a 50257-token vocabulary the logits of 8192 tokens take 1.6 GB in fp32 (and as much again for their
gradient), more than the whole body of a lean model keeps for backward. ``linear_cross_entropy`` computes, for each chunk of
tokens, the chunk's logits (in the autocast dtype when autocast is on, like ``F.linear``), upcasts them to fp32,
takes the loss, and right away the gradients with respect to the hidden states, the weight and the bias; so only one
chunk's logits ever exist, and backward only scales the stored gradients. The chunk holds about as many logits as
the input has hidden values (``rows = tokens * in_features / vocab``, at least 128), so the loss's peak is a few
times the size of its input, not ``vocab / in_features`` times. Under autocast the weight gradient is accumulated over the chunks
with fp32 products (one low-precision product per chunk would round each partial sum), so it is, if anything, more
precise than the plain path's.

On CUDA, liger-kernel's ``LigerFusedLinearCrossEntropyLoss`` (Triton kernels of the same scheme) is used when it is
importable. Our implementation is the CPU path and the fallback: liger-kernel runs on CUDA only, and ours is plain
PyTorch, checked against ``F.cross_entropy`` to float32 tolerance and by float64 gradcheck.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
except ImportError:  # not installed, or no Triton: our chunked implementation serves
    LigerFusedLinearCrossEntropyLoss = None


SCALE_BLOCK = 2 ** 22  # elements: a 16 MiB float32 temporary when backward converts a stored gradient
MIN_CHUNK_ROWS = 128  # narrower chunks spend their time re-reading the whole weight gradient, once per chunk


def default_chunk_rows(num_rows: int, in_features: int, vocab_size: int) -> int:
    """Rows per chunk such that a chunk's logits are about as large as the whole input, and at least
    ``MIN_CHUNK_ROWS`` (on CPU, 1024 tokens x d=256, vocab 50257: 6-row chunks took 2.4x the plain loss's time,
    128-row chunks 0.63x)."""
    return max(1, min(num_rows, max(MIN_CHUNK_ROWS, math.ceil(num_rows * in_features / vocab_size))))


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor] = None,
                         ignore_index: int = -100, chunk_rows: Optional[int] = None, use_liger: bool = True
                         ) -> Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), labels, ignore_index=ignore_index)`` (mean over
    the labels that are not ``ignore_index``) without the full logits.

    :param hidden: [..., in_features]; :param labels: hidden.shape[:-1], class ids or ``ignore_index``.
    :param weight: [vocab, in_features] (a tied embedding table works as is); :param bias: [vocab] or None.
    :param chunk_rows: tokens per chunk (default: ``default_chunk_rows``).
    :param use_liger: use liger-kernel on CUDA when it is installed.
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels has shape {tuple(labels.shape)}, expected hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"weight has {weight.shape[-1]} input features, hidden has {hidden.shape[-1]}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if use_liger and hidden.is_cuda and LigerFusedLinearCrossEntropyLoss is not None:
        return _liger(hidden, weight, labels, bias, ignore_index)
    rows = chunk_rows or default_chunk_rows(hidden.shape[0], hidden.shape[1], weight.shape[0])
    tensors = (hidden, weight) if bias is None else (hidden, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _LinearCrossEntropy.apply(hidden, weight, bias, labels, ignore_index, rows)
    return _chunks(hidden, weight, bias, labels, ignore_index, rows, (False, False, False))[0]


def _liger(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor], ignore_index: int) -> Tensor:
    if torch.is_autocast_enabled(hidden.device.type):  # liger-kernel computes in its inputs' dtype
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index)(weight, hidden, labels, bias)
    return loss[0] if isinstance(loss, tuple) else loss  # some versions also return the z-loss


def _chunks(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, ignore_index: int, rows: int,
            needs: tuple[bool, bool, bool]) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """The mean loss and, where ``needs`` says so, its gradients for hidden, weight and bias; one chunk at a time."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # cast once, not once per chunk
        weight = weight.to(torch.get_autocast_dtype(device_type))
    accumulate = torch.promote_types(weight.dtype, torch.float32)  # fp32 under autocast, fp64 for fp64 inputs
    valid = labels != ignore_index
    scale = 1.0 / valid.sum().to(accumulate)  # inf when no label counts: the loss is nan, as F.cross_entropy's
    total = torch.zeros((), dtype=accumulate, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if needs[0] else None
    grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if needs[1] else None
    grad_bias = torch.zeros(bias.shape, dtype=accumulate, device=bias.device) if needs[2] else None
    for start in range(0, hidden.shape[0], rows):
        chunk, chunk_labels = hidden[start:start + rows], labels[start:start + rows]
        chunk_valid = valid[start:start + rows]
        logits = F.linear(chunk, weight, bias)
        dtype = logits.dtype
        logits32 = logits.to(torch.promote_types(dtype, torch.float32))
        del logits  # only the upcast copy is used from here on (in place where it can be)
        lse = torch.logsumexp(logits32, dim=-1)
        targets = chunk_labels.masked_fill(~chunk_valid, 0)
        target_logits = logits32.gather(1, targets[:, None])[:, 0]
        total += torch.where(chunk_valid, lse - target_logits, 0.0).sum()
        if not any(needs):
            continue
        # d loss / d logits = (softmax - one_hot) / count on the counted rows; handed to the matmuls in the logits'
        # dtype, as autograd would hand the gradient of ``logits.float()`` back
        grad = logits32.sub_(lse[:, None]).exp_()
        grad[torch.arange(grad.shape[0], device=grad.device), targets] -= 1.0
        grad = grad.mul_(torch.where(chunk_valid, scale, 0.0)[:, None]).to(dtype)
        del logits32
        if grad_hidden is not None:
            grad_hidden[start:start + rows] = grad @ weight.to(grad.dtype)  # weight already is, except for fp64
        if grad_weight is not None:  # summed over chunks in fp32: low-precision partial sums would each be rounded
            with torch.autocast(device_type, enabled=False):
                grad_weight.addmm_(grad.t().to(accumulate), chunk.to(accumulate))
        if grad_bias is not None:
            grad_bias += grad.sum(0)
    return total * scale, grad_hidden, grad_weight, grad_bias


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, ignore_index: int,
                rows: int) -> Tensor:
        loss, *grads = _chunks(hidden, weight, bias, labels, ignore_index, rows, tuple(ctx.needs_input_grad[:3]))
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.save_for_backward(*grads)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        # out of place: no device sync (to skip the product when grad_loss is 1) and no mutation of saved tensors
        # (retain_graph and gradcheck re-run backward)
        grads = [None if g is None else scaled_to(g, grad_loss, dtype)
                 for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)]
        return *grads, None, None, None


def scaled_to(tensor: Tensor, scale: Tensor, dtype: torch.dtype, block: int = SCALE_BLOCK) -> Tensor:
    """``(tensor * scale).to(dtype)``, the same values, a block of ``block`` elements at a time when the dtype
    changes: the product in ``tensor``'s dtype then exists for one block only, not as a whole-size temporary (for a
    tied 50304 x 2048 embedding: the float32 weight gradient, 0.38 GiB, besides its bfloat16 result)."""
    if tensor.dtype == dtype:
        return tensor * scale
    flat = tensor.reshape(-1)  # the saved gradients are contiguous: a view
    result = torch.empty(flat.shape, dtype=dtype, device=tensor.device)
    for start in range(0, flat.numel(), block):
        result[start:start + block] = flat[start:start + block] * scale  # the copy rounds, as .to(dtype) does
    return result.view(tensor.shape)
