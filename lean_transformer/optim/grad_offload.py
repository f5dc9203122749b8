"""Gradients that leave the device as backward produces them, accumulated in float32 host memory.

A hook after each parameter's gradient accumulation (``register_post_accumulate_grad_hook``) hands the gradient to
host memory and frees it on the device (``param.grad = None``), so the device never holds a whole set of gradients:
at most the gradients that backward is still producing plus those in flight. Micro-batch accumulation happens on
the host, in float32, whatever the model's dtype.

On a CUDA device each gradient is copied on a side stream into one of a few pinned staging slots, overlapped with
the rest of backward; a host thread then adds the slot into its float32 buffer (converting and unscaling there,
so a float16 gradient is unscaled in float32, not in float16 where small values would flush to zero). On the CPU
the hook adds synchronously. The same class serves both, so the CPU tests exercise its bookkeeping.

With ``device_accumulation`` K > 1, each parameter's gradients are first summed on the device in a float32 tensor of
its own (+4 bytes/param of device memory) and leave it as that sum every K-th gradient (and whenever a reader waits):
the host adds K times less and the link carries 2/K as many bytes for bfloat16 weights. For a GPU faster than the
host's adds (``benchmarks/host_throughput.py``: two cores add ~0.75 G params/s, which keeps ~35 TFLOPS busy) this
trades device memory for speed; the result is the same sum, rounded in another order (float32 either way).

A tied embedding's output-head gradient arrives first and separately (``modules/early_grad.py``: it would otherwise
wait on the device through the whole backward for the lookup's part); both parts are added into the same buffer.

The buffers can be given (e.g. hivemind's shared-memory averaging tensors, see
:mod:`lean_transformer.swarm.averaging.host_grad_averager`), so the gradients are accumulated, averaged and handed to the
optimizer in one float32 copy. torch offers no such hook-driven host accumulator (FSDP's CPU offload keeps the
whole model sharded and needs a process group), hence this module.
"""
from __future__ import annotations

import functools
import queue
import threading
from typing import Optional, Sequence

import torch

from lean_transformer.modules.early_grad import set_receiver

WAIT_TIMEOUT = 600.0  # seconds: a gradient copy that takes longer means the device or the host thread is stuck


@torch.no_grad()
def accumulate_into(buffer: torch.Tensor, grad: torch.Tensor, scale: float = 1.0, overwrite: bool = False) -> None:
    """``buffer += scale * grad`` (or ``buffer = scale * grad`` with ``overwrite``), in the float32 buffer's dtype:
    the host's whole work per gradient, run on torch's intra-op threads (``benchmarks/host_throughput.py`` times
    it)."""
    if overwrite:
        buffer.copy_(grad)  # then scale in float32: a float16 gradient times 1/scale could flush to zero
        if scale != 1.0:
            buffer.mul_(scale)
    else:
        buffer.add_(grad, alpha=scale)  # computed in float32, the buffer's dtype


class HostGradients:
    """Float32 host accumulators for ``params``, fed by post-accumulate-grad hooks.

    :param params: the model's parameters (any device, any floating-point dtype); each gets a hook
    :param buffers: float32 CPU tensors of the parameters' shapes to accumulate into (default: new ones)
    :param staging_slots: pinned transfer slots for a CUDA model, each the size of the largest gradient
    :param device_accumulation: gradients summed on the device (float32) before they leave it; 1: each leaves alone

    After :meth:`reset`, each buffer's next gradient overwrites it (no zeroing pass); a buffer that got no gradient
    since then is stale until :meth:`zero_untouched_`. ``grad_scale`` multiplies every incoming gradient (set it to
    1 / loss scale under float16 loss scaling). Read the buffers only after :meth:`wait`.
    """

    def __init__(self, params: Sequence[torch.Tensor], buffers: Optional[Sequence[torch.Tensor]] = None,
                 staging_slots: int = 2, device_accumulation: int = 1):
        self.params = tuple(params)
        if not self.params:
            raise ValueError("params: HostGradients got an empty parameter list")
        for index, param in enumerate(self.params):
            if not isinstance(param, torch.Tensor) or not param.is_floating_point() or not param.requires_grad:
                raise ValueError(f"params[{index}] must be a floating-point tensor that requires grad")
        if len({id(param) for param in self.params}) != len(self.params):
            raise ValueError("params: a parameter appears more than once")
        self.devices = {param.device for param in self.params}
        if len(self.devices) != 1:
            raise ValueError(f"params must all be on one device, got {sorted(map(str, self.devices))}")
        self.device = next(iter(self.devices))
        self.is_cuda = self.device.type == "cuda"
        if buffers is None:
            buffers = [torch.zeros(param.shape, dtype=torch.float32) for param in self.params]
        self.buffers = tuple(buffers)
        if len(self.buffers) != len(self.params):
            raise ValueError(f"buffers: expected {len(self.params)} tensors, got {len(self.buffers)}")
        for index, (param, buffer) in enumerate(zip(self.params, self.buffers)):
            if buffer.dtype != torch.float32 or buffer.device.type != "cpu" or buffer.shape != param.shape:
                raise ValueError(f"buffers[{index}] must be a float32 CPU tensor of shape {tuple(param.shape)}, got "
                                 f"{buffer.dtype} {buffer.device.type} {tuple(buffer.shape)}")
        if not isinstance(device_accumulation, int) or device_accumulation < 1:
            raise ValueError(f"device_accumulation must be a positive integer, got {device_accumulation!r}")
        self.device_accumulation = device_accumulation
        self._sums: list[torch.Tensor] = []  # device_accumulation > 1: each parameter's float32 sum on the device
        if device_accumulation > 1:
            self._sums = [torch.zeros(param.shape, dtype=torch.float32, device=self.device) for param in self.params]
        self._summed = [0] * len(self.params)  # whole gradients in each sum since it was last sent
        self._unsent = [False] * len(self.params)  # the sum holds gradients (else the next one overwrites it)
        self._sum_sent: list[Optional[torch.cuda.Event]] = [None] * len(self.params)  # its copy to the host
        self.grad_scale = 1.0
        self.writes = 0  # gradients received so far (ever): tells a reader whether anything arrived since it looked
        self._fresh = [True] * len(self.params)
        self._found_non_finite = torch.zeros((), dtype=torch.bool, device=self.device)
        self._error: Optional[BaseException] = None
        if self.is_cuda:
            self._stream = torch.cuda.Stream(self.device)
            largest = max(param.numel() * (4 if self._sums else param.element_size()) for param in self.params)
            self._free_slots: queue.Queue = queue.Queue()
            for _ in range(staging_slots):
                self._free_slots.put(torch.empty(largest, dtype=torch.uint8, pin_memory=True))
            self._jobs: queue.Queue = queue.Queue()
            self._pending = 0
            self._idle = threading.Condition()
            self._thread = threading.Thread(target=self._host_adds, name="host-gradients", daemon=True)
            self._thread.start()
        self._handles = [param.register_post_accumulate_grad_hook(self._make_hook(index))
                         for index, param in enumerate(self.params)]
        self._early: dict[int, tuple[torch.Tensor, float]] = {}  # host copies of first parts (modules.early_grad)
        for index, param in enumerate(self.params):  # a tied weight's head gradient leaves before the lookup's
            set_receiver(param, functools.partial(self._take_grad, index, early=True))

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:  # all of this backward's gradient went early (``modules.early_grad``)
                return
            param.grad = None  # the device's copy goes as soon as the host has it (on CUDA: after the copy)
            self._take_grad(index, grad)
        return hook

    @torch.no_grad()
    def _take_grad(self, index: int, grad: torch.Tensor, early: bool = False) -> None:
        """Add ``grad`` to buffer ``index``; ``early``: a first part of the gradient (``modules.early_grad``), kept on
        the host in its dtype until the hook's part comes and added to it there, as autograd would have added them."""
        if grad.numel():
            low, high = torch.aminmax(grad)  # NaN propagates to both; no temporary of the gradient's size
            self._found_non_finite.logical_or_(~(torch.isfinite(low) & torch.isfinite(high)))
        self.writes += 1
        if self._sums:
            self._sum_on_device(index, grad, early)
        elif not self.is_cuda:
            self._accumulate(index, grad, early=early)
        else:
            self._send(index, grad, self.grad_scale, early)

    def _sum_on_device(self, index: int, grad: torch.Tensor, early: bool) -> None:
        """Add ``grad`` (unscaled, in float32) to parameter ``index``'s device sum; send the sum on its K-th gradient.
        An early part counts with the rest of its gradient, not on its own."""
        total = self._sums[index]
        if self._sum_sent[index] is not None:  # its last copy to the host must be done before it is overwritten
            torch.cuda.current_stream(self.device).wait_event(self._sum_sent[index])
            self._sum_sent[index] = None
        accumulate_into(total, grad, self.grad_scale, overwrite=not self._unsent[index])
        self._unsent[index] = True
        self._summed[index] += 0 if early else 1
        if self._summed[index] >= self.device_accumulation:
            self._send_sum(index)

    def _send_sum(self, index: int) -> None:
        self._summed[index], self._unsent[index] = 0, False
        if not self.is_cuda:
            self._add_to_buffer(index, self._sums[index], 1.0)
            return
        self._sum_sent[index] = self._send(index, self._sums[index], 1.0, early=False)

    def _send(self, index: int, grad: torch.Tensor, scale: float, early: bool) -> torch.cuda.Event:
        """Copy ``grad`` into a staging slot on the side stream and queue its host add; returns the copy's event."""
        try:
            slot = self._free_slots.get(timeout=WAIT_TIMEOUT)
        except queue.Empty:
            raise TimeoutError(f"no staging slot freed within {WAIT_TIMEOUT:.0f} s: the host adds are stuck") from None
        staged = slot[:grad.numel() * grad.element_size()].view(grad.dtype).view(grad.shape)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            staged.copy_(grad, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        grad.record_stream(self._stream)  # its memory is reused only after the copy
        with self._idle:
            self._pending += 1
        self._jobs.put((index, staged, slot, copied, scale, early))
        return copied

    def _accumulate(self, index: int, grad: torch.Tensor, scale: Optional[float] = None, early: bool = False
                    ) -> None:
        scale = self.grad_scale if scale is None else scale
        if early:
            self._flush_early(index)  # a first part whose rest never came
            self._early[index] = (grad.to("cpu", copy=True), scale)  # a staging slot is reused: our own copy
            return
        part, _ = self._early.pop(index, (None, None))
        if part is not None:
            grad = part.add_(grad)  # in the gradients' dtype: the very sum autograd forms for a parameter used twice
        self._add_to_buffer(index, grad, scale)

    def _flush_early(self, index: int) -> None:
        part, scale = self._early.pop(index, (None, None))
        if part is not None:
            self._add_to_buffer(index, part, scale)

    def _add_to_buffer(self, index: int, grad: torch.Tensor, scale: float) -> None:
        accumulate_into(self.buffers[index], grad, scale, overwrite=self._fresh[index])
        self._fresh[index] = False

    def _host_adds(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:  # remove_hooks(): the thread ends, so it no longer keeps the parameters alive
                return
            index, staged, slot, copied, scale, early = job
            try:
                copied.synchronize()
                self._accumulate(index, staged, scale, early)
            except BaseException as error:  # reported by the next wait()
                self._error = error
            finally:
                self._free_slots.put(slot)
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def wait(self) -> None:
        """Return once every gradient produced so far is in the buffers."""
        for index, unsent in enumerate(self._unsent):  # sums (device_accumulation) still on the device
            if unsent:
                self._send_sum(index)
        if self.is_cuda:
            with self._idle:
                if not self._idle.wait_for(lambda: self._pending == 0, timeout=WAIT_TIMEOUT):
                    raise TimeoutError(f"gradient copies to the host still pending after {WAIT_TIMEOUT:.0f} s")
        for index in list(self._early):  # first parts whose rest never came (the parameter's other use had none)
            self._flush_early(index)
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("accumulating a gradient on the host failed") from error

    def non_finite(self) -> bool:
        """Whether a gradient received since the last :meth:`reset` had an inf or a NaN."""
        return bool(self._found_non_finite)

    def touched(self) -> list[bool]:
        """For each buffer, whether it received a gradient since the last :meth:`reset`."""
        return [not fresh for fresh in self._fresh]

    @torch.no_grad()
    def zero_untouched_(self) -> None:
        """Zero the buffers that got no gradient since the last :meth:`reset` (their content is stale)."""
        self.wait()
        for index, buffer in enumerate(self.buffers):
            if self._fresh[index]:
                buffer.zero_()

    def reset(self) -> None:
        """Start a new accumulation: each buffer's next gradient overwrites it; forget non-finite gradients."""
        self.wait()
        self._fresh = [True] * len(self.params)
        self._found_non_finite.zero_()

    def remove_hooks(self) -> None:
        """Detach from the model: gradients stay in ``param.grad`` again, and the host thread (which refers to the
        parameters) ends, so a shut-down averager does not keep the model's memory."""
        self.wait()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for param in self.params:
            set_receiver(param, None)
        if self.is_cuda and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=WAIT_TIMEOUT)
