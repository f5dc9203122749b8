"""Optimizer step throughput on the CPU and optimizer state size: CPULAMB8Bit vs torch AdamW vs bitsandbytes.

50M float32 parameters in 10 tensors (by default), the same gradients and the same thread count for every
optimizer. Steps are timed round-robin (one step of each optimizer per round) so that load from other processes
hits all of them alike; the table reports the median step over ``--rounds`` rounds with the median of the
per-round ratios to AdamW, and the best (least disturbed) step of each with the ratio of the best steps. State
bytes per parameter count every tensor in ``optimizer.state`` once.

Usage: python benchmarks/optimizer.py [--params 50_000_000] [--tensors 10] [--rounds 7] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import bitsandbytes
import torch

from lean_transformer.optim import CPULAMB8Bit


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of all tensors in the optimizer's state, each storage counted once (bitsandbytes shares its maps)."""
    storages = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


def build(
    name: str,
    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    init: list[torch.Tensor],
    grads: list[torch.Tensor],
) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(tensor.clone()) for tensor in init]
    for param, grad in zip(params, grads):
        param.grad = grad  # shared: none of the optimizers writes to gradients
    optimizer = make(params)
    optimizer.step()  # allocate state outside the timed steps
    log(f"built {name}")
    return optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--tensors", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    if args.params < args.tensors or args.tensors < 1 or args.rounds < 1 or args.threads < 1:
        parser.error("need --params >= --tensors >= 1, --rounds >= 1 and --threads >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    size = args.params // args.tensors
    init = [torch.randn(size) * 0.02 for _ in range(args.tensors)]
    grads = [torch.randn(size) * 1e-3 for _ in range(args.tensors)]
    hyper = dict(lr=1e-3, weight_decay=0.01)
    candidates = {
        "torch.optim.AdamW (fp32, foreach)": lambda p: torch.optim.AdamW(p, foreach=True, **hyper),
        "CPULAMB8Bit (ours)": lambda p: CPULAMB8Bit(p, **hyper),
        "bitsandbytes LAMB8bit (CPU)": lambda p: bitsandbytes.optim.LAMB8bit(p, **hyper),
    }
    optimizers = {name: build(name, make, init, grads) for name, make in candidates.items()}
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for round_index in range(args.rounds):
        for name, optimizer in optimizers.items():
            start = time.perf_counter()
            optimizer.step()
            times[name].append(time.perf_counter() - start)
        log(f"round {round_index + 1}/{args.rounds}: " + ", ".join(f"{t[-1]:.3f}s" for t in times.values()))

    baseline = times["torch.optim.AdamW (fp32, foreach)"]
    numel = size * args.tensors
    setup = f"{numel / 1e6:.0f}M parameters in {args.tensors} tensors, {args.threads} threads"
    print(f"\n{setup}; {args.rounds} rounds: median step (best step, the least disturbed one)\n")
    print("| optimizer | step (s) | M params/s | vs AdamW | best step (s) | best vs AdamW | state bytes/param |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, optimizer in optimizers.items():
        step, best = statistics.median(times[name]), min(times[name])
        ratio = statistics.median(b / t for b, t in zip(baseline, times[name]))
        cells = [
            f"{step:.3f}",
            f"{numel / step / 1e6:.0f}",
            f"{ratio:.2f}x",
            f"{best:.3f}",
            f"{min(baseline) / best:.2f}x",
        ]
        print(f"| {name} | " + " | ".join(cells) + f" | {state_bytes(optimizer) / numel:.2f} |")
    lamb = optimizers["CPULAMB8Bit (ours)"]
    scratch = lamb.scratch_bytes() / numel
    print(
        f"\nCPULAMB8Bit also keeps a float32 update buffer for the largest tensor ({scratch:.2f} bytes/param here, "
        f"at most 4 * chunk_size bytes). bitsandbytes' CPU LAMB8bit applies no trust ratio (it runs Adam's update)."
    )


if __name__ == "__main__":
    main()
