"""CPU-side optimizers: 8-bit LAMB, and a wrapper that keeps master weights and optimizer state off the GPU."""

from lean_transformer.optim.lamb import CPULAMB8Bit
from lean_transformer.optim.offload import OffloadedOptimizer

__all__ = ["CPULAMB8Bit", "OffloadedOptimizer"]
