"""CPU-side optimizers: 8-bit LAMB, gradients that leave the device during backward, and a wrapper that keeps
master weights, gradients and optimizer state off the GPU."""

from lean_transformer.optim.grad_offload import HostGradients
from lean_transformer.optim.lamb import CPULAMB8Bit
from lean_transformer.optim.offload import OffloadedOptimizer

__all__ = ["CPULAMB8Bit", "HostGradients", "OffloadedOptimizer"]
