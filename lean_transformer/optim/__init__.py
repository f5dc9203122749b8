"""CPU-side optimizers: 8-bit LAMB, gradients that leave the device during backward, a wrapper that keeps master
weights, gradients and optimizer state off the GPU, and per-block fp16 gradient scaling."""

from lean_transformer.optim.block_grad_scaler import BlockGradScaler
from lean_transformer.optim.grad_offload import HostGradients
from lean_transformer.optim.lamb import CPULAMB8Bit
from lean_transformer.optim.offload import OffloadedOptimizer

__all__ = ["BlockGradScaler", "CPULAMB8Bit", "HostGradients", "OffloadedOptimizer"]
