"""Per-block gradient scaling for fp16 training (the per-resblock scaling of DALL-E, Ramesh et al. 2021).

One loss scale for a whole network must keep every block's gradients inside fp16's range (about 6e-8 to 65504)
at once. In deep networks the blocks' gradient magnitudes drift apart, and no single scale fits: large enough for
the blocks with the smallest gradients (which otherwise underflow to zero and stop learning), it overflows in the
blocks with the largest (and ``torch.amp.GradScaler`` skips the whole step).

``BlockGradScaler`` gives every residual block its own scale, applied in backward by two identity functions per
block: the gradient entering the block (at its output) is multiplied by the block's scale, and the gradient leaving
it (at its input, back into the residual stream) is divided by it. So the residual stream carries unscaled gradients
(keep it in fp32: ``fp32_residual=True``), the block's own fp16 backward runs at its own scale, and its parameter
gradients come out multiplied by exactly that scale. ``unscale_`` divides them back, block by block, and notes the
blocks whose gradients are not finite; ``step`` skips only those blocks' updates (their gradients become None, which
torch optimizers skip), and ``update`` halves their scales and doubles the scale of every block that has stayed
finite for ``growth_interval`` steps. A block that overflows returns a zero gradient to the residual stream for
that step (an infinite one would poison every block below it): the blocks below it then train on the gradient of
the residual path alone for that step.

Built on hooks rather than inside ``torch.amp.GradScaler`` because that scaler has one scale for everything; our
hooks only scale gradients, so forward results are unchanged, and with every scale equal to one power of two the
unscaled gradients equal ``GradScaler``'s (a test checks it).

Usage (a plain training loop; the trainer's ``--block_grad_scaling`` is :mod:`lean_transformer.swarm.averaging.block_scaling`)::

    scaler = BlockGradScaler.for_lean_model(model)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(**batch).loss
    loss.backward()
    scaler.step(optimizer)      # unscale_, skip overflowed blocks, optimizer.step()
    scaler.update()
    optimizer.zero_grad()
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scales[index]``."""

    @staticmethod
    def forward(ctx, x: Tensor, scales: Tensor, index: int) -> Tensor:
        ctx.scales, ctx.index = scales, index
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scales[ctx.index], None, None


class _UnscaleGrad(torch.autograd.Function):
    """Identity forward; backward divides the gradient by ``scales[index]``; a non-finite gradient is replaced by
    zeros and marks the block in ``found_inf`` (on the device, without a sync)."""

    @staticmethod
    def forward(ctx, x: Tensor, scales: Tensor, found_inf: Tensor, index: int) -> Tensor:
        ctx.scales, ctx.found_inf, ctx.index = scales, found_inf, index
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        unscaled = grad.float() / ctx.scales[ctx.index]
        finite = torch.isfinite(unscaled).all()
        ctx.found_inf[ctx.index] += (~finite).float()
        return torch.where(finite, unscaled, 0.0).to(grad.dtype), None, None, None


class BlockGradScaler:
    """One fp16 gradient scale per residual block; see the module docstring.

    :param blocks: the residual branches (modules called as ``block(x, ...)`` whose output is added to the residual
        stream); each must own its parameters alone (no parameter shared between blocks).
    :param params: for each block, the parameters it uses (default: ``block.parameters()``).
    :param other_params: the parameters outside every block (embeddings, head): their gradients are unscaled already;
        ``step`` skips them too when they are not finite.
    :param match_input_dtype: return each block's output in its input's dtype (an fp16 output of an fp32 stream
        becomes fp32: the value the residual sum sees is the same), so that the gradient entering the block is
        scaled in the stream's precision, before autograd casts it to fp16. For an fp32 residual stream; off for a
        half-precision one, where it would change the stream's dtype.
    """

    def __init__(self, blocks: Sequence[nn.Module], params: Optional[Sequence[Iterable[Tensor]]] = None,
                 other_params: Iterable[Tensor] = (), init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, max_scale: float = 2.0 ** 24,
                 match_input_dtype: bool = True):
        if not blocks:
            raise ValueError("blocks must name at least one module")
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1
                and max_scale >= init_scale):
            raise ValueError(f"need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1 "
                             f"and max_scale >= init_scale; got init_scale={init_scale}, growth_factor="
                             f"{growth_factor}, backoff_factor={backoff_factor}, growth_interval={growth_interval}, "
                             f"max_scale={max_scale}")
        groups = [list(p) for p in params] if params is not None else [list(b.parameters()) for b in blocks]
        if len(groups) != len(blocks):
            raise ValueError(f"params has {len(groups)} groups for {len(blocks)} blocks")
        owner: dict[int, int] = {}
        for index, group in enumerate(groups):
            for param in group:
                if owner.setdefault(id(param), index) != index:
                    raise ValueError(f"a parameter of shape {tuple(param.shape)} belongs to blocks {owner[id(param)]}"
                                     f" and {index}: its gradient would mix two scales")
        self.blocks, self.groups = list(blocks), groups
        self.other_params = [p for p in other_params if id(p) not in owner]
        device = groups[0][0].device if groups[0] else torch.device("cpu")
        self.scales = torch.full((len(blocks),), float(init_scale), device=device)
        self.found_inf = torch.zeros(len(blocks), device=device)  # counts per block since the last update
        self.growth_tracker = torch.zeros(len(blocks), dtype=torch.long, device=device)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.max_scale = growth_interval, max_scale
        self.match_input_dtype = match_input_dtype
        self.skipped_blocks = 0  # blocks skipped by the last step
        self._unscaled = False
        self._handles: list[RemovableHandle] = []
        for index, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._make_pre_hook(index), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._make_post_hook(index)))

    @classmethod
    def for_lean_model(cls, model: nn.Module, **kwargs: Any) -> "BlockGradScaler":
        """A scaler whose blocks are the attention and feed-forward sub-layers of a lean model's distinct layers.

        Backward in pieces (``backward_chunks`` > 1) bypasses the sub-layers' forward hooks, and shared large
        matrices belong to several blocks: both are rejected."""
        body = model.body
        if body.backward_chunks > 1 or any(getattr(m, "backward_chunks", 1) > 1 for m in body.modules()):
            raise ValueError("BlockGradScaler cannot be combined with backward_chunks > 1 (the pieces bypass the "
                             "blocks' hooks)")
        blocks = [sub for layer in body.layers for sub in (layer.attention, layer.ffn)]
        params = [body.trainable_tensors([block]) for block in blocks]
        inside = {id(p) for group in params for p in group}
        others = [p for p in model.parameters() if p.requires_grad and id(p) not in inside]
        kwargs.setdefault("match_input_dtype", bool(model.config.fp32_residual))
        return cls(blocks, params, others, **kwargs)

    def _make_pre_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            if not torch.is_grad_enabled() or not args[0].requires_grad:
                return None
            return (_UnscaleGrad.apply(args[0], self.scales, self.found_inf, index), *args[1:]), kwargs
        return hook

    def _make_post_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output: Tensor):
            if not torch.is_grad_enabled() or not output.requires_grad:
                return None
            if self.match_input_dtype:
                output = output.to(args[0].dtype)
            return _ScaleGrad.apply(output, self.scales, index)
        return hook

    def remove(self) -> None:
        """Detach the hooks: the model's backward is plain again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @torch.no_grad()
    def unscale_(self) -> None:
        """Divide each block's gradients by its scale and note the blocks (and the other parameters) whose
        gradients are not finite. Called by ``step`` if not called before (e.g. to clip gradients in between)."""
        if self._unscaled:
            raise RuntimeError("unscale_ was already called since the last update()")
        for index, group in enumerate(self.groups):
            grads = [p.grad for p in group if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, 1.0 / self.scales[index])
                finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
                self.found_inf[index] += (~finite).float()
        self._unscaled = True

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        """Unscale (if needed), drop the gradients of the blocks that overflowed and of non-finite other parameters
        (one device sync), then ``optimizer.step(**kwargs)``."""
        if not self._unscaled:
            self.unscale_()
        overflowed = (self.found_inf > 0).tolist()
        for group, skip in zip(self.groups, overflowed):
            if skip:
                for param in group:
                    param.grad = None
        others = [p for p in self.other_params if p.grad is not None]
        if others and not torch.stack([torch.isfinite(p.grad).all() for p in others]).all():
            for param in others:
                param.grad = None
        self.skipped_blocks = sum(overflowed)
        return optimizer.step(**kwargs)

    @torch.no_grad()
    def update(self) -> None:
        """Halve the scale of every block that overflowed since the last update; double the scale of every block
        finite for ``growth_interval`` updates in a row (up to ``max_scale``)."""
        overflowed = self.found_inf > 0
        self.growth_tracker = torch.where(overflowed, 0, self.growth_tracker + 1)
        grow = self.growth_tracker >= self.growth_interval
        factor = torch.where(overflowed, self.backoff_factor, torch.where(grow, self.growth_factor, 1.0))
        self.scales.mul_(factor).clamp_(max=self.max_scale)
        self.growth_tracker.masked_fill_(grow, 0)
        self.found_inf.zero_()
        self._unscaled = False

    def state_dict(self) -> dict[str, Tensor]:
        return {"scales": self.scales.clone(), "growth_tracker": self.growth_tracker.clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        if state["scales"].shape != self.scales.shape:
            raise ValueError(f"state has {state['scales'].numel()} block scales, this scaler {self.scales.numel()}")
        self.scales.copy_(state["scales"])
        self.growth_tracker.copy_(state["growth_tracker"])
