"""Training-step time of LeanGPT against HF GPT-2 of the same shape, measured side by side in one run.

On CPU: median step time (forward + backward + SGD step) of LeanGPT default (rotary), LeanGPT with absolute
positions (GPT-2's exact function) and HF GPT-2 (sdpa), runs interleaved so that background load hits all alike;
ratio = LeanGPT / HF (target <= 1.1). With a CUDA GPU it also reports, for d=2048, 24 layers, T=2048 under bf16
autocast, the peak memory (torch.cuda.max_memory_allocated) and tokens/s under each runtime option.

Usage: python benchmarks/throughput.py [--hidden 256 --heads 4 --layers 4 --seq 256 --batch 4 --steps 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch
import transformers
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from lean_transformer import LeanGPTConfig, LeanGPTForCausalLM

Step = Callable[[], None]


def hf_gpt2(hidden: int, heads: int, layers: int, seq: int, vocab: int) -> nn.Module:
    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads,
                        bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)


def lean_gpt(hidden: int, heads: int, layers: int, seq: int, vocab: int, **config_overrides) -> LeanGPTForCausalLM:
    return LeanGPTForCausalLM(LeanGPTConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                            num_attention_heads=heads, max_position_embeddings=seq,
                                            **config_overrides))


def training_step(model: nn.Module, input_ids: torch.Tensor, autocast: bool = False) -> Step:
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def cpu_comparison(args: argparse.Namespace) -> None:
    shape = (args.hidden, args.heads, args.layers, args.seq, args.vocab)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    steps = {
        "HF GPT-2 (sdpa)": training_step(hf_gpt2(*shape), input_ids),
        "LeanGPT default (rotary)": training_step(lean_gpt(*shape), input_ids),
        "LeanGPT, absolute positions": training_step(lean_gpt(*shape, position_embedding_type="absolute"),
                                                     input_ids),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():  # warm-up
        step()
    for repeat in range(args.steps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
        print(f"  step {repeat + 1}/{args.steps} done", file=sys.stderr, flush=True)
    baseline = statistics.median(times["HF GPT-2 (sdpa)"])
    print(f"\nCPU training step, d={args.hidden}, {args.layers} layers, {args.heads} heads, T={args.seq}, "
          f"batch {args.batch}, vocab {args.vocab}, {torch.get_num_threads()} threads; median of {args.steps}\n")
    print("| model | step time (s) | ratio to HF GPT-2 | target |")
    print("| --- | --- | --- | --- |")
    for name, measured in times.items():
        target = "<= 1.1" if name.startswith("LeanGPT default") else ""
        print(f"| {name} | {statistics.median(measured):.3f} | {statistics.median(measured) / baseline:.3f} | "
              f"{target} |")


def cuda_options(args: argparse.Namespace) -> None:
    """Peak memory and tokens/s at d=2048, 24 layers, T=2048 under each option (bf16 autocast)."""
    shape = (2048, 16, 24, 2048, 50304)
    input_ids = torch.randint(0, shape[-1], (1, shape[3]), device="cuda")
    variants: dict[str, Callable[[], nn.Module]] = {
        "HF GPT-2 (sdpa)": lambda: hf_gpt2(*shape),
        "LeanGPT default": lambda: lean_gpt(*shape),
        "LeanGPT ffn_custom_grad=False": lambda: _with_options(lean_gpt(*shape), ffn_custom_grad=False),
        "LeanGPT checkpoint_attention_core": lambda: _with_options(lean_gpt(*shape), checkpoint_attention_core=True),
        "LeanGPT gradient_checkpointing=True": lambda: _with_options(lean_gpt(*shape), gradient_checkpointing=True),
        "LeanGPT gradient_checkpointing=4": lambda: _with_options(lean_gpt(*shape), gradient_checkpointing=4),
        "LeanGPT reversible": lambda: lean_gpt(*shape, reversible=True),
    }
    print(f"\nCUDA ({torch.cuda.get_device_name()}), d=2048, 24 layers, T=2048, batch 1, bf16 autocast\n")
    print("| model / options | peak memory (GiB) | tokens/s |")
    print("| --- | --- | --- |")
    for name, build in variants.items():
        model = build().cuda()
        step = training_step(model, input_ids, autocast=True)
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(args.cuda_steps):
            step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2 ** 30
        print(f"| {name} | {peak:.2f} | {args.cuda_steps * input_ids.numel() / elapsed:.0f} |", flush=True)
        del model, step
        torch.cuda.empty_cache()


def _with_options(model: LeanGPTForCausalLM, **options) -> LeanGPTForCausalLM:
    model.set_optimizations(**options)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cuda-steps", type=int, default=5)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cpu_comparison(args)
    if torch.cuda.is_available():
        cuda_options(args)


if __name__ == "__main__":
    main()
