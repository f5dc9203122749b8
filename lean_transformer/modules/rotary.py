"""Rotary position embeddings (RoFormer; the GPT-NeoX "rotate half" layout): channel i of each head is paired with
channel i + head_dim/2 and the pair is rotated by the angle position * base^(-2i/head_dim)."""
from __future__ import annotations

import torch
from torch import Tensor


def rotary_cos_sin(seq_len: int, head_dim: int, base: float, device: torch.device, dtype: torch.dtype
                   ) -> tuple[Tensor, Tensor]:
    """cos and sin tables of shape [seq_len, head_dim] for positions 0 .. seq_len - 1."""
    return rotary_tables(torch.arange(seq_len, device=device), head_dim, base, dtype)


def rotary_tables(positions: Tensor, head_dim: int, base: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin tables of shape [*positions.shape, head_dim] for the given (integer) positions, computed in
    float32 (cheap next to the matmuls, and no buffers to keep in sync with checkpoints)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [..., seq_len, (any dims broadcast by cos/sin), head_dim] by the per-position angles."""
    return x * cos + rotate_half(x) * sin
