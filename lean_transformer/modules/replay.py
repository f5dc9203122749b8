"""Capturing and replaying the RNG and autocast state of a forward pass, so that a recomputation in backward draws
the same dropout masks and runs in the same precision as the original forward, then leaves the caller's state as
it found it."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor

_AUTOCAST_DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


@dataclass
class RNGState:
    """The CPU generator state and the states of the CUDA devices that the given tensors live on."""

    cpu: Tensor
    cuda: dict[int, Tensor] = field(default_factory=dict)

    @classmethod
    def capture(cls, *tensors: Tensor) -> "RNGState":
        devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        return cls(torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in devices})

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run a block with this state; the caller's RNG state is restored afterwards."""
        with torch.random.fork_rng(devices=list(self.cuda), enabled=True):
            torch.set_rng_state(self.cpu)
            for device, state in self.cuda.items():
                torch.cuda.set_rng_state(state, device)
            yield


@dataclass
class AutocastState:
    """Which devices had autocast enabled, and with which dtype."""

    dtypes: dict[str, torch.dtype]

    @classmethod
    def capture(cls) -> "AutocastState":
        return cls({d: torch.get_autocast_dtype(d) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)})

    @contextlib.contextmanager
    def restore(self) -> Iterator[None]:
        """Run a block under exactly this autocast state (disabling autocast the caller may have on)."""
        with contextlib.ExitStack() as stack:
            for device in _AUTOCAST_DEVICES:
                if device in self.dtypes:
                    stack.enter_context(torch.autocast(device, dtype=self.dtypes[device]))
                else:
                    stack.enter_context(torch.autocast(device, enabled=False))
            yield


def dropout_mask(shape: torch.Size, p: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """An inverted-dropout mask (0 or 1/(1-p)); drawn the same way wherever a mask must be replayed."""
    return torch.empty(shape, dtype=dtype, device=device).bernoulli_(1.0 - p).div_(1.0 - p)
