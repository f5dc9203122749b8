"""CPULAMB8Bit against a float32 LAMB written here from the paper's equations (You et al., 2019, Alg. 2)."""
from __future__ import annotations

import copy
import functools
import io
import math
from typing import Callable, Optional

import bitsandbytes.functional as bnb_functional
import pytest
import torch

from lean_transformer.optim import CPULAMB8Bit
from lean_transformer.optim.quantization import dequantize_blockwise, quantize_blockwise

Quantizer = Callable[[torch.Tensor, bool], torch.Tensor]


class ReferenceLAMB:
    """Textbook float32 LAMB; ``quantizer`` optionally rounds the stored moments after every step."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, clamp_value=10.0,
                 bias_correction=True, max_grad_norm: Optional[float] = None, quantizer: Optional[Quantizer] = None):
        self.params = list(params)
        self.lr, (self.beta1, self.beta2), self.eps, self.wd = lr, betas, eps, weight_decay
        self.clamp_value, self.bias_correction, self.max_grad_norm, self.quantizer = clamp_value, bias_correction, max_grad_norm, quantizer
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        grads = [p.grad for p in self.params]
        if self.max_grad_norm is not None:
            total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
            grads = [g * min(1.0, self.max_grad_norm / (total + 1e-6)) for g in grads]
        for i, (p, g) in enumerate(zip(self.params, grads)):
            m = self.beta1 * self.m[i] + (1 - self.beta1) * g
            v = self.beta2 * self.v[i] + (1 - self.beta2) * g * g
            m_hat, v_hat = m, v
            if self.bias_correction:
                m_hat, v_hat = m / (1 - self.beta1**self.t), v / (1 - self.beta2**self.t)
            update = m_hat / (v_hat.sqrt() + self.eps) + self.wd * p
            w_norm, u_norm = p.norm(), update.norm()
            ratio = (w_norm.clamp(0, self.clamp_value) / u_norm) if w_norm > 0 and u_norm > 0 else 1.0
            p.sub_(self.lr * ratio * update)
            if self.quantizer is not None and p.numel() >= 4096:
                m, v = self.quantizer(m, True), self.quantizer(v, False)
            self.m[i], self.v[i] = m, v


def own_quantizer(x: torch.Tensor, signed: bool) -> torch.Tensor:
    return dequantize_blockwise(*quantize_blockwise(x, signed, 256), signed, 256).view_as(x)


@functools.cache
def dynamic_map(signed: bool) -> torch.Tensor:
    return bnb_functional.create_dynamic_map(signed=signed)


def bnb_quantizer(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """bitsandbytes' block-wise dynamic quantization, as its 8-bit optimizers use it (block size 256)."""
    codes, quant_state = bnb_functional.quantize_blockwise(x.contiguous(), code=dynamic_map(signed), blocksize=256)
    return bnb_functional.dequantize_blockwise(codes, quant_state).view_as(x)


def regression_problem(seed: int = 0):
    """A teacher-student MLP; both weight matrices are big enough (8192 and 4096 values) for 8-bit state."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 32, generator=gen)
    teacher = [torch.randn(32, 64, generator=gen) / 32**0.5, torch.randn(64, 16, generator=gen) / 8]
    y = torch.tanh(x @ teacher[0]) @ teacher[1]
    params = [
        torch.randn(32, 256, generator=gen) / 32**0.5,
        torch.zeros(256),  # a zero tensor exercises the trust ratio's "||w|| = 0" branch
        torch.randn(256, 16, generator=gen) / 16,
        torch.zeros(16),
    ]

    def loss_fn(p):
        return (torch.tanh(x @ p[0] + p[1]) @ p[2] + p[3] - y).pow(2).mean()

    return [p.requires_grad_() for p in params], loss_fn


def train(make_optimizer, steps: int = 50, seed: int = 0, **kwargs):
    params, loss_fn = regression_problem(seed)
    optimizer = make_optimizer(params, **kwargs)
    losses = []
    for _ in range(steps):
        for p in params:
            p.grad = None
        loss = loss_fn(params)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return torch.tensor(losses), [p.detach() for p in params]


HYPER = dict(lr=0.02, weight_decay=0.01, eps=1e-6)


def relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float((x - y).pow(2).sum()) for x, y in zip(a, b)) / sum(float(y.pow(2).sum()) for y in b))


@pytest.mark.parametrize("options", [dict(), dict(bias_correction=False, clamp_value=3.0), dict(max_grad_norm=0.05, weight_decay=0.0)])
def test_full_precision_path_matches_reference(options):
    """With every tensor below min_8bit_size the optimizer is plain float32 LAMB."""
    ref_losses, ref_params = train(ReferenceLAMB, **{**HYPER, **options})
    losses, params = train(CPULAMB8Bit, min_8bit_size=10**9, **{**HYPER, **options})
    assert ref_losses[-1] < 0.5 * ref_losses[0]  # the problem is actually being optimized
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-6)
    for p, ref in zip(params, ref_params):
        torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-6)


def test_8bit_tracks_float32_reference_at_least_as_well_as_bitsandbytes_quantization():
    ref_losses, ref_params = train(ReferenceLAMB, **HYPER)
    losses, params = train(CPULAMB8Bit, **HYPER)
    # the same algorithm with moments rounded by our codec (8-bit is the only difference) ...
    sim_losses, sim_params = train(ReferenceLAMB, quantizer=own_quantizer, **HYPER)
    # ... and by bitsandbytes' dynamic block-wise codec
    bnb_losses, bnb_params = train(ReferenceLAMB, quantizer=bnb_quantizer, **HYPER)

    # stated bounds (measured: 1.0% and 1.7%; bitsandbytes' codec: 2.5% and 3.4%)
    assert ((losses - ref_losses).abs() / ref_losses).max() < 0.03  # every step's loss within 3% of float32 LAMB
    assert relative_error(params, ref_params) < 0.04  # final weights within 4% (relative L2)
    assert relative_error(params, ref_params) <= relative_error(bnb_params, ref_params)
    # the fused kernel computes what the simple simulation does (up to rounding, amplified over 50 steps)
    torch.testing.assert_close(losses, sim_losses, rtol=2e-3, atol=0)
