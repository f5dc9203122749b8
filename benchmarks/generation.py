"""Generation speed with transformers' ``generate``: 256 new tokens with the KV cache (a ``DynamicCache``) against
the same greedy decoding without it (``use_cache=False``, each step runs the whole sequence again), side by side in
one process; HF GPT-2 of the same shape, with its cache, as a second reference. CPU, fp32, one thread, batch 1.
Times are the process's CPU time (one thread: its compute), so that other jobs on a shared machine, which stretch
wall time and hit the many small steps of cached decoding hardest, do not count.

Usage: python benchmarks/generation.py [--hidden 512 --layers 6 --heads 8 --prompt 16 --new_tokens 256]
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

from lean_transformer import LeanGPTConfig, LeanGPTForCausalLM


def best_times(runs: list[Callable[[], torch.Tensor]], repeats: int) -> tuple[list[float], list[torch.Tensor]]:
    """Each run's best time over ``repeats`` rounds (a round runs each once, so that a change of load on a shared
    machine affects all rows alike), and its output."""
    best, outputs = [float("inf")] * len(runs), [None] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            start = time.process_time()
            outputs[i] = run()
            best[i] = min(best[i], time.process_time() - start)
    return best, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many rounds")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    positions = args.prompt + args.new_tokens
    config = LeanGPTConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                           num_attention_heads=args.heads, max_position_embeddings=positions,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    lean = LeanGPTForCausalLM(config).eval()
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=args.vocab, n_positions=positions, n_embd=args.hidden,
                                      n_layer=args.layers, n_head=args.heads)).eval()
    input_ids = torch.randint(0, args.vocab, (1, args.prompt))
    common = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)

    with torch.no_grad():
        (no_cache, cached, hf_cached), (out_no_cache, out_cached, _) = best_times(
            [lambda: lean.generate(input_ids, use_cache=False, **common), lambda: lean.generate(input_ids, **common),
             lambda: gpt2.generate(input_ids, **common)], args.repeats)
    assert torch.equal(out_cached, out_no_cache), "the cache changed the generated tokens"

    print(f"\n{args.new_tokens} new tokens after a {args.prompt}-token prompt, LeanGPT d={args.hidden}, "
          f"{args.layers} layers, {args.heads} heads (rotary), greedy, fp32, 1 CPU thread, "
          f"best of {args.repeats} rounds\n")
    print("| decoding | CPU seconds | tokens per CPU second | speed vs no cache |")
    print("| --- | ---: | ---: | ---: |")
    for name, seconds in [("LeanGPT, `use_cache=False` (baseline)", no_cache),
                          ("LeanGPT, KV cache (`DynamicCache`)", cached),
                          ("HF GPT-2 of the same shape, KV cache", hf_cached)]:
        print(f"| {name} | {seconds:.2f} | {args.new_tokens / seconds:.0f} | {no_cache / seconds:.2f}x |")
    print("\nThe cached and uncached runs generated the same tokens.")


if __name__ == "__main__":
    main()
