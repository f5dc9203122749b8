"""Generation speed with transformers' ``generate``: 256 new tokens with the KV cache (a ``DynamicCache``) against
the same greedy decoding without it (``use_cache=False``, each step runs the whole sequence again), side by side in
one process; HF GPT-2 of the same shape, with its cache, as a second reference. CPU, fp32, one thread, batch 1.

Usage: python benchmarks/generation.py [--hidden 512 --layers 6 --heads 8 --prompt 16 --new_tokens 256]
"""
from __future__ import annotations

import argparse
import time

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

from lean_transformer import LeanGPTConfig, LeanGPTForCausalLM


def best_time(generate, repeats: int) -> tuple[float, torch.Tensor]:
    times, output = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        output = generate()
        times.append(time.perf_counter() - start)
    return min(times), output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1, help="best of this many runs per row")
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
        no_cache, out_no_cache = best_time(lambda: lean.generate(input_ids, use_cache=False, **common), args.repeats)
        cached, out_cached = best_time(lambda: lean.generate(input_ids, **common), args.repeats)
        hf_cached, _ = best_time(lambda: gpt2.generate(input_ids, **common), args.repeats)
    assert torch.equal(out_cached, out_no_cache), "the cache changed the generated tokens"

    print(f"\n{args.new_tokens} new tokens after a {args.prompt}-token prompt, LeanGPT d={args.hidden}, "
          f"{args.layers} layers, {args.heads} heads (rotary), greedy, fp32, 1 CPU thread, best of {args.repeats}\n")
    print("| decoding | seconds | tokens/s | speed vs no cache |")
    print("| --- | ---: | ---: | ---: |")
    for name, seconds in [("LeanGPT, `use_cache=False` (baseline)", no_cache),
                          ("LeanGPT, KV cache (`DynamicCache`)", cached),
                          ("HF GPT-2 of the same shape, KV cache", hf_cached)]:
        print(f"| {name} | {seconds:.2f} | {args.new_tokens / seconds:.0f} | {no_cache / seconds:.2f}x |")
    print("\nThe cached and uncached runs generated the same tokens.")


if __name__ == "__main__":
    main()
