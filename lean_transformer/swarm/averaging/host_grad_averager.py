"""A hivemind gradient averager whose accumulators are its averaging buffers, in host memory, fed during backward.

hivemind's GradientAverager keeps three sets of gradients: the model's ``.grad`` (on the device), accumulators (on
the device by default, or the ``.grad`` buffers themselves with ``reuse_grad_buffers``) and the averaged gradients
(float32 shared host memory, which an offloaded optimizer uses as its ``.grad``). Here the model's gradients leave
the device during backward (:class:`~lean_transformer.optim.grad_offload.HostGradients`) straight into the averaged
buffers, which thus also serve as accumulators: one float32 host copy of the gradients in all (4 bytes/param),
none on the device. It also makes bfloat16/float16 weights possible: hivemind keeps float32 master weights for an
offloaded optimizer (and copies them back into the low-precision weights after each step), but its own averaged
gradients take the weights' dtype and cannot serve as the masters' ``.grad``.

The buffers are accumulated in place, averaged in place and stepped from in place, so a local step must not run
while an all-reduce or an optimizer step uses them: hivemind's ``delay_grad_averaging`` and
``delay_optimizer_step`` are refused (:func:`check_host_gradient_options`).

How hivemind's calls map onto the shared buffers:

- ``accumulate_grads_`` counts samples and local steps (as with ``reuse_grad_buffers``: the hooks did the adding);
- ``load_accumulators_into_averager_`` divides the sums by the number of local steps (in place) and zeroes the
  buffers no gradient reached; called again with nothing new since (hivemind's fallback after a failed round), it
  keeps what the buffers hold: this peer's mean gradient, or a partly averaged one, both valid estimates (hivemind's
  own accumulators would have been reset by then and give a zero gradient);
- ``reset_accumulated_grads_`` resets the counts and lets the next gradient overwrite each buffer (no zeroing pass).

With float16 loss scaling, set ``host_grads.grad_scale = 1 / scale`` before backward: gradients are unscaled on
the host, in float32. ``host_grads.non_finite()`` says whether a micro-batch since the last reset overflowed.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

from lean_transformer.optim.grad_offload import HostGradients
from lean_transformer.swarm.auth.averaging_gate import GatedGradientAverager
from lean_transformer.swarm.averaging.averagers import GradientAverager


class HostAccumulated:
    """Mixed in front of a hivemind GradientAverager class (see the module docstring)."""

    # hivemind caches the RPC table and stub per class: rebuild them for the subclass (same names, same wire format)
    _rpc_handlers = None
    _stub_type = None

    def __init__(self, parameters: Sequence[torch.nn.Parameter], *args: Any, reuse_grad_buffers: bool = False,
                 accumulate_grads_on: Any = None, averaged_grads: Sequence[torch.Tensor] = (),
                 device_accumulation: int = 1, **kwargs: Any):
        if averaged_grads:
            raise ValueError("averaged_grads: HostAccumulated allocates the averaged gradients itself")
        parameters = tuple(parameters)
        buffers = tuple(torch.zeros(param.shape, dtype=torch.float32).share_memory_() for param in parameters)
        self.host_grads = HostGradients(parameters, buffers, device_accumulation=device_accumulation)
        self._writes_when_loaded = None
        # reuse_grad_buffers=True: no accumulators of hivemind's own; ours are _grads_from_parameters() below
        super().__init__(parameters, *args, reuse_grad_buffers=True, averaged_grads=buffers, **kwargs)

    def _grads_from_parameters(self) -> Iterator[torch.Tensor]:
        yield from self.host_grads.buffers

    @torch.no_grad()
    def load_accumulators_into_averager_(self) -> None:
        host_grads = self.host_grads
        host_grads.wait()
        if host_grads.writes == self._writes_when_loaded:
            return  # nothing new since the last load: keep its result
        with self.get_tensors():
            scale = 1.0 / self.local_times_accumulated if self.local_times_accumulated else 0.0
            for buffer, touched in zip(host_grads.buffers, host_grads.touched()):
                if touched and scale:
                    buffer.mul_(scale)
                else:
                    buffer.zero_()
        host_grads.reset()
        self._writes_when_loaded = host_grads.writes

    @torch.no_grad()
    def reset_accumulated_grads_(self) -> None:
        self._accumulators_used_in_step = False
        self.local_samples_accumulated = self.local_times_accumulated = 0
        self._anchor_batch_size = None
        self.host_grads.reset()

    def shutdown(self) -> None:
        self.host_grads.remove_hooks()
        super().shutdown()


class HostGradientAverager(HostAccumulated, GradientAverager):
    """hivemind's GradientAverager (cancel-safe, same RPC names) with host accumulators fed during backward."""


class HostGatedGradientAverager(HostAccumulated, GatedGradientAverager):
    """:class:`HostGradientAverager` serving token holders only (``gate=`` is required); hivemind names RPCs after
    the class, so this one keeps its own name on the wire."""


def check_host_gradient_options(offload_optimizer: bool, delay_optimizer_step: bool,
                                delay_grad_averaging: bool) -> None:
    """Raise a ValueError naming the option that cannot run with host gradients."""
    if not offload_optimizer:
        raise ValueError("offload_optimizer: host gradients feed the offloaded optimizer, so they need it")
    if delay_optimizer_step or delay_grad_averaging:
        flag = "delay_optimizer_step" if delay_optimizer_step else "delay_grad_averaging"
        raise ValueError(f"{flag}: the host gradient buffers are accumulated, averaged and stepped from in place, "
                         f"so backward cannot overlap the optimizer step or the averaging round")
