"""Single-device training with the optimizer on the CPU (no swarm needed).

The device keeps only what forward and backward need: the model (float32, float16 or bfloat16) and its
gradients. Float32 master weights and the optimizer state live in host RAM. Each ``step()`` copies the
gradients off the device (through pinned buffers, without blocking, when the device is a GPU), runs the
wrapped optimizer on the CPU and copies the updated weights back, rounded to the model's dtype.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from lean_transformer.optim.lamb import CPULAMB8Bit

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


class _Slot:
    """One model parameter, its float32 master copy on the CPU and (for GPU models) the pinned transfer buffer."""

    def __init__(self, param: torch.Tensor, pin_memory: bool):
        self.param = param
        self.master = torch.empty(param.shape, dtype=torch.float32, pin_memory=pin_memory)
        self.master.copy_(param.detach())
        self.grad = torch.zeros(param.shape, dtype=torch.float32, pin_memory=pin_memory)
        # a GPU model in another dtype transfers through a pinned buffer of its own dtype and converts on the CPU,
        # so the device never allocates a float32 copy of a gradient or of a weight
        low_precision_gpu = param.is_cuda and param.dtype != torch.float32
        self.staging = torch.empty(param.shape, dtype=param.dtype, pin_memory=pin_memory) if low_precision_gpu else None

    def pull_grad(self) -> bool:
        """Start copying the model's gradient to the CPU; False if it has none."""
        grad = self.param.grad
        if grad is None:
            return False
        (self.staging if self.staging is not None else self.grad).copy_(grad, non_blocking=True)
        return True

    def finish_pull(self) -> None:
        if self.staging is not None:
            self.grad.copy_(self.staging)

    def push_weight(self) -> None:
        if self.staging is not None:
            self.param.copy_(self.staging.copy_(self.master), non_blocking=True)
        else:
            self.param.copy_(self.master, non_blocking=self.param.is_cuda)


class OffloadedOptimizer:
    """Wraps an optimizer so that its master weights and state stay in CPU RAM.

    :param params: the model's parameters or parameter groups (any device, any floating-point dtype)
    :param optimizer_factory: builds the optimizer from parameter groups of float32 CPU tensors, e.g.
      ``functools.partial(CPULAMB8Bit, lr=1e-3, weight_decay=0.01)``
    :param pin_memory: page-lock the CPU copies (default: when a parameter is on a CUDA device)

    ``param_groups`` are the inner optimizer's, so a learning-rate scheduler can be attached to ``.optimizer``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_factory: OptimizerFactory = CPULAMB8Bit,
        pin_memory: Optional[bool] = None,
    ):
        groups = list(params)
        if not groups:
            raise ValueError("OffloadedOptimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [dict(group, params=list(group["params"])) for group in groups]
        model_params = [param for group in groups for param in group["params"]]
        for index, param in enumerate(model_params):
            if not isinstance(param, torch.Tensor) or not param.is_floating_point():
                got = param.dtype if isinstance(param, torch.Tensor) else type(param).__name__
                raise ValueError(f"parameter {index} must be a floating-point tensor, got {got}")
        if len({id(param) for param in model_params}) != len(model_params):
            raise ValueError("a parameter appears more than once in params")
        if pin_memory is None:
            pin_memory = any(param.is_cuda for param in model_params)
        self.slots = [_Slot(param, pin_memory) for param in model_params]
        masters = iter(slot.master for slot in self.slots)
        self.optimizer = optimizer_factory(
            [dict(group, params=[next(masters) for _ in group["params"]]) for group in groups]
        )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        has_grad = [slot.pull_grad() for slot in self.slots]
        self._synchronize()
        for slot, pulled in zip(self.slots, has_grad):
            if pulled:
                slot.finish_pull()
            slot.master.grad = slot.grad if pulled else None  # like the model: no gradient, no update
        self.optimizer.step()
        for slot in self.slots:
            slot.push_weight()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the model's gradients (the CPU copies are overwritten by every step)."""
        for slot in self.slots:
            if slot.param.grad is None:
                continue
            if set_to_none:
                slot.param.grad = None
            else:
                slot.param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state and the float32 master weights (the model may hold rounded copies)."""
        return {"optimizer": self.optimizer.state_dict(), "master_weights": [slot.master for slot in self.slots]}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        masters = state_dict.get("master_weights")
        if not isinstance(masters, (list, tuple)) or len(masters) != len(self.slots):
            raise ValueError(f"state_dict['master_weights'] must be a list of {len(self.slots)} tensors")
        for index, (slot, master) in enumerate(zip(self.slots, masters)):
            if not isinstance(master, torch.Tensor) or master.shape != slot.master.shape:
                got = tuple(master.shape) if isinstance(master, torch.Tensor) else type(master).__name__
                raise ValueError(
                    f"state_dict['master_weights'][{index}] is {got}, expected shape {tuple(slot.master.shape)}"
                )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        for slot, master in zip(self.slots, masters):
            slot.master.copy_(master)
            slot.push_weight()
        self._synchronize()

    def _synchronize(self) -> None:
        for device in {slot.param.device for slot in self.slots if slot.param.is_cuda}:
            torch.cuda.current_stream(device).synchronize()
