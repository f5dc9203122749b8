"""Peak memory and step time of backward in N pieces (``set_optimizations(backward_chunks=N)``), against N=1.

Peak: every tensor alive during one training step (forward + backward), counted exactly with
``torch.distributed._tools.mem_tracker.MemTracker`` (a dispatch mode that follows each storage from allocation to
release), minus the weights and their gradients; in fp32 words of size d per token. The vocabulary is small so that
the LM head's logits do not hide the body's peak (item 2 of the loss, ``fused_loss.py``, removes them anyway).
Time: forward + backward, the configurations interleaved, best of ``--repeats``, one thread.

Usage: python benchmarks/backward_chunks.py [--hidden 512 --heads 8 --seq 1024 --batch 2 --layers 4]
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from lean_transformer import LeanGPTConfig, LeanGPTForCausalLM


def peak_bytes(model: LeanGPTForCausalLM, input_ids: torch.Tensor) -> int:
    """Peak bytes during a training step, beyond the weights and their gradients."""
    model.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model, input_ids)
    with tracker:
        model(input_ids, labels=input_ids).loss.backward()
    fixed = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    return tracker.get_tracker_snapshot("peak")[input_ids.device]["Total"] - fixed


def step_seconds(model: LeanGPTForCausalLM, input_ids: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    model(input_ids, labels=input_ids).loss.backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    word = 4 * args.hidden * args.batch * args.seq

    print(f"LeanGPT d={args.hidden}, heads={args.heads}, T={args.seq}, batch {args.batch}, {args.layers} layers, "
          f"vocab {args.vocab}, fp32, dropout 0, 1 thread\n")
    print("| model | backward_chunks | peak beyond weights + grads (d-words/token) | vs 1 chunk "
          "| step time vs 1 chunk |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for reversible in (True, False):
        config = LeanGPTConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                               num_attention_heads=args.heads, max_position_embeddings=args.seq,
                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, reversible=reversible)
        model = LeanGPTForCausalLM(config).train()
        peaks, times = {}, {n: [] for n in args.chunks}
        for chunks in args.chunks:
            model.set_optimizations(backward_chunks=chunks)
            peaks[chunks] = peak_bytes(model, input_ids)
        for _ in range(args.repeats):
            for chunks in args.chunks:
                model.set_optimizations(backward_chunks=chunks)
                times[chunks].append(step_seconds(model, input_ids))
        base = args.chunks[0]
        for chunks in args.chunks:
            name = "reversible" if reversible else "default (FFN chunks only)"
            print(f"| {name} | {chunks} | {peaks[chunks] / word:.2f} | {peaks[chunks] / peaks[base]:.3f}x | "
                  f"{min(times[chunks]) / min(times[base]):.2f}x |", flush=True)


if __name__ == "__main__":
    main()
