"""CPU-side optimizers: 8-bit LAMB, and a wrapper that keeps master weights and optimizer state off the GPU; per-block
fp16 gradient scaling."""

from lean_transformer.optim.block_grad_scaler import BlockGradScaler
from lean_transformer.optim.lamb import CPULAMB8Bit
from lean_transformer.optim.offload import OffloadedOptimizer

__all__ = ["BlockGradScaler", "CPULAMB8Bit", "OffloadedOptimizer"]
