"""Single-device training with the optimizer on the CPU (no swarm needed).

The device keeps only what forward and backward need: the model (float32, float16 or bfloat16). Its gradients
leave it during backward (:class:`~lean_transformer.optim.grad_offload.HostGradients`), float32 master weights and
the optimizer state live in host RAM. Each ``step()`` runs the wrapped optimizer on the master weights, with the
host gradients as their ``.grad``, and copies the updated weights back, rounded to the model's dtype.

This is the swarm-free twin of the trainer's path (hivemind.Optimizer with ``offload_optimizer`` and
:mod:`lean_transformer.swarm.averaging.host_grad_averager`): both take gradients from the same ``HostGradients``; hivemind
keeps its own master weights and optimizer, so the two share that class rather than this one.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from lean_transformer.optim.grad_offload import HostGradients
from lean_transformer.optim.lamb import CPULAMB8Bit

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


class OffloadedOptimizer:
    """Wraps an optimizer so that its master weights, gradients and state stay in CPU RAM.

    :param params: the model's parameters or parameter groups (one device, any floating-point dtype)
    :param optimizer_factory: builds the optimizer from parameter groups of float32 CPU tensors, e.g.
      ``functools.partial(CPULAMB8Bit, lr=1e-3, weight_decay=0.01)``
    :param pin_memory: page-lock the master weights (default: when the parameters are on a CUDA device)

    Gradients accumulate over backward passes until ``zero_grad()``, as with a torch optimizer, but on the host:
    the model's ``.grad`` stays None. ``param_groups`` are the inner optimizer's, so a learning-rate scheduler can
    be attached to ``.optimizer``. ``grads.non_finite()`` tells whether a gradient since ``zero_grad()`` had an inf
    or a NaN; ``grads.grad_scale`` unscales float16 loss scaling on the host.
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
        self.params = model_params
        self.masters = []
        for param in model_params:
            master = torch.empty(param.shape, dtype=torch.float32, pin_memory=pin_memory)
            self.masters.append(master.copy_(param.detach()))
        self.grads = HostGradients(model_params)
        masters = iter(self.masters)
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
        self.grads.wait()
        for master, buffer, touched in zip(self.masters, self.grads.buffers, self.grads.touched()):
            master.grad = buffer if touched else None  # like the model: no gradient, no update
        self.optimizer.step()
        self._push_weights()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Starts a new accumulation (the host buffers are overwritten by the next gradients)."""
        self.grads.reset()

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state and the float32 master weights (the model may hold rounded copies)."""
        return {"optimizer": self.optimizer.state_dict(), "master_weights": list(self.masters)}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        masters = state_dict.get("master_weights")
        if not isinstance(masters, (list, tuple)) or len(masters) != len(self.masters):
            raise ValueError(f"state_dict['master_weights'] must be a list of {len(self.masters)} tensors")
        for index, (own, master) in enumerate(zip(self.masters, masters)):
            if not isinstance(master, torch.Tensor) or master.shape != own.shape:
                got = tuple(master.shape) if isinstance(master, torch.Tensor) else type(master).__name__
                raise ValueError(
                    f"state_dict['master_weights'][{index}] is {got}, expected shape {tuple(own.shape)}"
                )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        for own, master in zip(self.masters, masters):
            own.copy_(master)
        self._push_weights()

    def _push_weights(self) -> None:
        for param, master in zip(self.params, self.masters):
            param.copy_(master, non_blocking=param.is_cuda)
        for device in {param.device for param in self.params if param.is_cuda}:
            torch.cuda.current_stream(device).synchronize()  # the masters may change again right after
