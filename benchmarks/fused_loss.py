"""Peak memory of the LM loss: plain logits + ``F.cross_entropy`` (baseline) against the chunked linear +
cross-entropy of ``modules/fused_loss.py``.

Peak: every tensor alive during the loss's forward and backward, counted exactly with
``torch.distributed._tools.mem_tracker.MemTracker``, minus the inputs (hidden states, weight) and their gradients,
which both need. Measured on CPU at a reduced number of tokens; the full shape (4 x 2048 tokens, d=2048, vocab 50257)
is *estimated*: the same code runs on fake tensors (``FakeTensorMode``: shapes and dtypes, no data, no compute) under
the same tracker. The fused loss's peak is mostly the one transient copy of the weight gradient that its backward
makes (``stored * grad_loss``), not logits. Time: forward + backward at the measured shape, interleaved, best of
``--repeats``.

Usage: python benchmarks/fused_loss.py [--tokens 1024 --hidden 256 --vocab 50257]
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from lean_transformer.modules.fused_loss import linear_cross_entropy

Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def plain(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=-100)


def fused(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return linear_cross_entropy(hidden, weight, labels)


def inputs(tokens: int, hidden_size: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    weight = (0.02 * torch.randn(vocab, hidden_size)).requires_grad_()
    return hidden, weight, torch.randint(0, vocab, (tokens,))


def peak_beyond_inputs(loss_fn: Loss, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> int:
    tracker = MemTracker()
    tracker.track_external(hidden, weight, labels)
    with tracker:
        loss_fn(hidden, weight, labels).backward()
    peak = tracker.get_tracker_snapshot("peak")[hidden.device]["Total"]
    return peak - 2 * (hidden.nbytes + weight.nbytes) - labels.nbytes


def estimate(loss_fn: Loss, tokens: int, hidden_size: int, vocab: int) -> int:
    with FakeTensorMode():
        return peak_beyond_inputs(loss_fn, *inputs(tokens, hidden_size, vocab))


def seconds(loss_fn: Loss, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> float:
    hidden.grad = weight.grad = None
    start = time.perf_counter()
    loss_fn(hidden, weight, labels).backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--full_tokens", type=int, default=4 * 2048)
    parser.add_argument("--full_hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mib = 2 ** 20
    tensors = inputs(args.tokens, args.hidden, args.vocab)
    measured = {name: peak_beyond_inputs(fn, *tensors) for name, fn in (("plain", plain), ("fused", fused))}
    times: dict[str, list[float]] = {"plain": [], "fused": []}
    for _ in range(args.repeats):
        for name, fn in (("plain", plain), ("fused", fused)):
            times[name].append(seconds(fn, *tensors))
    estimated = {name: estimate(fn, args.full_tokens, args.full_hidden, args.vocab)
                 for name, fn in (("plain", plain), ("fused", fused))}

    print(f"LM loss forward + backward, vocab {args.vocab}, fp32; peak beyond the inputs and their gradients\n")
    print("| shape | plain logits + F.cross_entropy (baseline) | chunked linear + cross-entropy | ratio |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| measured: {args.tokens} tokens, d={args.hidden} | {measured['plain'] / mib:.1f} MiB | "
          f"{measured['fused'] / mib:.1f} MiB | {measured['fused'] / measured['plain']:.3f}x |")
    print(f"| estimated (FakeTensorMode): {args.full_tokens} tokens, d={args.full_hidden} | "
          f"{estimated['plain'] / mib:.0f} MiB | {estimated['fused'] / mib:.0f} MiB | "
          f"{estimated['fused'] / estimated['plain']:.3f}x |")
    print(f"\nTime at the measured shape (1 thread, best of {args.repeats}): fused / plain = "
          f"{min(times['fused']) / min(times['plain']):.2f}x")


if __name__ == "__main__":
    main()
