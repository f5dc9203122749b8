"""Attention on CPU where no fused kernel applies: peak memory and time of one forward + backward of the attention
core, chunked attention against SDPA's math kernel (its fallback: the baseline) and SDPA's fused CPU kernel.

Peak memory is measured exactly: every allocation and free of the CPU allocator during the call, as recorded by
the PyTorch profiler (``profile_memory=True``), summed in time order; the peak is the highest running total above
the memory held before the call (inputs excluded, their gradients and every temporary included). Times are the
process's CPU time (one thread, so other jobs on a shared machine do not count) in separate runs without the
profiler, best of ``--repeats`` rounds that run every row once.

Usage: python benchmarks/attention.py [--seq 4096 --heads 8 --head_dim 64 --chunk_size 128]
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch._C._profiler import _EventType
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from lean_transformer.modules.attention_mask import AttentionMask
from lean_transformer.modules.chunked_attention import chunked_attention


def peak_bytes(step: Callable[[], None]) -> int:
    """The highest total of CPU allocator bytes allocated during ``step`` and not yet freed."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = []

    def walk(node) -> None:
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))  # negative for frees
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    total = peak = 0
    for _, size in sorted(events, key=lambda event: event[0]):
        total += size
        peak = max(peak, total)
    return peak


def best_seconds(steps: list[Callable[[], None]], repeats: int) -> list[float]:
    """Each step's best time over ``repeats`` rounds; a round runs every step once, so that a change of load on a
    shared machine affects all rows alike."""
    best = [float("inf")] * len(steps)
    for _ in range(repeats):
        for i, step in enumerate(steps):
            start = time.process_time()
            step()
            best[i] = min(best[i], time.process_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--chunk_size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n = args.seq
    query, key, value = (torch.randn(1, args.heads, n, args.head_dim, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, args.heads, n, args.head_dim)
    padding = torch.ones(1, n, dtype=torch.bool)
    padding[:, n - n // 10:] = False  # the last 10% are padding
    mask = AttentionMask(padding, n, n, causal=True)

    def sdpa(dropout_p: float, backend: SDPBackend) -> Callable[[], None]:
        def step() -> None:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask.dense(query.device),
                                                     dropout_p=dropout_p)
            torch.autograd.grad(out, (query, key, value), grad)
            mask._dense = None  # rebuilt inside every measured step, like the chunked rows
        return step

    def chunked(dropout_p: float) -> Callable[[], None]:
        def step() -> None:
            out = chunked_attention(query, key, value, mask, True, dropout_p, args.chunk_size)
            torch.autograd.grad(out, (query, key, value), grad)
        return step

    # the outputs agree (no dropout): the rows compute the same function
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask.dense(query.device))
    got = chunked_attention(query, key, value, mask, True, 0.0, args.chunk_size)
    error = (got - expected).abs().max().item()
    del expected, got

    rows = [("SDPA math kernel, padding mask (the fallback; baseline)", sdpa(0.0, SDPBackend.MATH)),
            ("SDPA fused CPU kernel, padding mask (dense [T, T] mask)", sdpa(0.0, SDPBackend.FLASH_ATTENTION)),
            (f"chunked attention, padding mask (chunks of {args.chunk_size} queries)", chunked(0.0)),
            ("SDPA, padding mask + dropout 0.1 (math kernel: no fused kernel takes dropout)",
             sdpa(0.1, SDPBackend.MATH)),
            ("chunked attention, padding mask + dropout 0.1", chunked(0.1))]
    peaks = [peak_bytes(step) for _, step in rows]
    results = list(zip([name for name, _ in rows], peaks, best_seconds([step for _, step in rows], args.repeats)))
    base_peak, base_time = results[0][1], results[0][2]
    print(f"\nattention core forward + backward, CPU fp32, 1 thread, batch 1, T={n}, {args.heads} heads of "
          f"{args.head_dim}, causal, last 10% padded; max |chunked - SDPA| = {error:.1e}\n")
    print("| attention core | peak memory | vs baseline | CPU time | vs baseline |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, peak, seconds in results:
        print(f"| {name} | {peak / 2**20:.0f} MiB | {peak / base_peak:.3f}x | {seconds:.2f} s | "
              f"{seconds / base_time:.2f}x |")


if __name__ == "__main__":
    main()
