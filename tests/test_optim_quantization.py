"""The companded block-wise 8-bit codes: exactness properties, and accuracy against bitsandbytes' dynamic map."""

from __future__ import annotations

import bitsandbytes.functional as bnb_functional
import pytest
import torch

from lean_transformer.optim.quantization import dequantize_blockwise, quantize_blockwise

BLOCK = 256  # what bitsandbytes' 8-bit optimizers use, and our default


def round_trip(x: torch.Tensor, signed: bool, block_size: int = BLOCK) -> torch.Tensor:
    codes, absmax = quantize_blockwise(x, signed, block_size)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and absmax.dtype == torch.float32
    return dequantize_blockwise(codes, absmax, signed, block_size)


def bnb_round_trip(x: torch.Tensor, signed: bool) -> torch.Tensor:
    code = bnb_functional.create_dynamic_map(signed=signed)
    codes, state = bnb_functional.quantize_blockwise(x, code=code, blocksize=BLOCK)
    return bnb_functional.dequantize_blockwise(codes, state)


def relative_rmse(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx - exact).norm() / exact.norm()).item()


def adam_like_moments(n: int = 1 << 18) -> tuple[torch.Tensor, torch.Tensor]:
    """Moments after 30 Adam steps on heavy-tailed gradients whose scale varies by row (like real layers)."""
    gen = torch.Generator().manual_seed(1)
    scale = torch.exp(torch.randn(n // 512, 1, generator=gen)).expand(-1, 512).reshape(-1)
    m, v = torch.zeros(n), torch.zeros(n)
    for _ in range(30):
        outliers = 1 + 10 * (torch.rand(n, generator=gen) < 0.01)
        g = torch.randn(n, generator=gen) * scale * outliers
        m.mul_(0.9).add_(g, alpha=0.1)
        v.mul_(0.999).addcmul_(g, g, value=0.001)
    return m, v


def test_more_accurate_than_bitsandbytes_dynamic_blockwise():
    m, v = adam_like_moments()
    gaussian = torch.randn(1 << 18, generator=torch.Generator().manual_seed(2))
    for x, signed in ((gaussian, True), (m, True), (gaussian.square(), False), (v, False)):
        ours, theirs = relative_rmse(round_trip(x, signed), x), relative_rmse(bnb_round_trip(x, signed), x)
        assert ours <= theirs, (signed, ours, theirs)
    # what Adam divides by: sqrt(v)
    assert relative_rmse(round_trip(v, False).sqrt(), v.sqrt()) <= relative_rmse(
        bnb_round_trip(v, False).sqrt(), v.sqrt()
    )


@pytest.mark.parametrize("signed", [True, False])
def test_round_trip_error_bounds_and_edge_cases(signed):
    x = torch.randn(3 * BLOCK + 77)  # a partial last block
    x = x if signed else x.abs()
    x[BLOCK : 2 * BLOCK] = 0.0  # an all-zero block must encode to zero codes (not NaN cast to a byte)
    codes, absmax = quantize_blockwise(x, signed, BLOCK)
    assert torch.equal(codes[BLOCK : 2 * BLOCK], torch.zeros(BLOCK, dtype=torch.uint8)) and absmax[1] == 0
    y = round_trip(x, signed)
    for block in (slice(0, BLOCK), slice(2 * BLOCK, 3 * BLOCK), slice(3 * BLOCK, None)):
        absmax = x[block].abs().max()
        # the block maximum is (almost) exact; everything else is within one code step of the largest values
        torch.testing.assert_close(y[block].abs().max(), absmax, rtol=1e-6, atol=0)
        levels = 127 if signed else 255
        step_near_max = absmax * (1 - ((levels - 1) / levels) ** (2 if signed else 4))
        assert (y[block] - x[block]).abs().max() <= 0.5 * step_near_max * 1.0001
        assert torch.equal(torch.sign(y[block])[y[block] != 0], torch.sign(x[block])[y[block] != 0])


@pytest.mark.parametrize("signed", [True, False])
def test_codes_are_scale_invariant_over_a_wide_range_of_magnitudes(signed):
    x = torch.randn(4 * BLOCK)
    x = x if signed else x.square()
    codes, _ = quantize_blockwise(x, signed, BLOCK)
    for scale in (1e-15, 1e-6, 1e6, 1e15):  # tiny or huge gradients: only the absmax changes
        scaled_codes, absmax = quantize_blockwise(x * scale, signed, BLOCK)
        assert torch.equal(scaled_codes, codes)
        torch.testing.assert_close(
            dequantize_blockwise(scaled_codes, absmax, signed, BLOCK), round_trip(x, signed) * scale
        )


def test_second_moment_keeps_a_wide_dynamic_range():
    """A linear code would zero everything below absmax / 510; sqrt(v) -> 0 would make m / sqrt(v) explode."""
    v = torch.tensor([1.0] + [10.0**-k for k in range(1, 11)]).repeat(BLOCK // 11 + 1)[:BLOCK]
    decoded = round_trip(v, signed=False)
    assert (decoded > 0).all()  # down to 1e-10 of the block maximum
    sqrt_error = (decoded.sqrt() / v.sqrt() - 1).abs()
    assert (sqrt_error[v >= 1e-6] < 0.05).all(), sqrt_error  # sqrt(v) within 5% over six decades


def test_unsigned_rejects_negative_values():
    with pytest.raises(ValueError, match="non-negative"):
        quantize_blockwise(torch.tensor([1.0, -1.0]), signed=False, block_size=BLOCK)
