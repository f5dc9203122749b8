"""Activation memory kept for backward, per token per layer, in fp32 words of size d (hidden size).

Counted exactly with ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves during the forward
pass is attributed to its storage, each storage counted once, parameters excluded. The per-layer figure is the
difference between a 2L- and an L-layer model of the same shape (so embeddings and the LM head cancel out),
divided by L, by the number of tokens and by 4*d bytes. Runs on CPU; dropout is 0 in every row (with dropout,
CPU SDPA falls back to materializing the attention matrix in both models).

Usage: python benchmarks/memory.py [--hidden 768 --heads 12 --seq 1024 --layers 2]
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch
import transformers
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from lean_transformer import LeanGPTConfig, LeanGPTForCausalLM
from lean_transformer.modules.memory import SavedTensorCounter


def saved_bytes(model: nn.Module, input_ids: torch.Tensor) -> int:
    """Bytes of the unique non-parameter storages saved for backward by one training forward pass."""
    model.train()
    with SavedTensorCounter(exclude=model.parameters()).record() as counter:
        loss = model(input_ids, labels=input_ids).loss
    del loss
    return counter.nbytes


def hf_gpt2(args: argparse.Namespace, layers: int, attn_implementation: str) -> nn.Module:
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=layers,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0)
    config._attn_implementation = attn_implementation
    return GPT2LMHeadModel(config)


def lean_gpt(args: argparse.Namespace, layers: int, **options) -> nn.Module:
    reversible = options.pop("reversible", False)
    config = LeanGPTConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=layers,
                           num_attention_heads=args.heads, max_position_embeddings=args.seq,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, reversible=reversible)
    model = LeanGPTForCausalLM(config)
    model.set_optimizations(**options)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=1024, help="small: the LM head cancels out anyway")
    parser.add_argument("--layers", type=int, default=2, help="L: per-layer figures compare L and 2L layers")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    input_ids = torch.randint(0, args.vocab, (1, args.seq))
    word = 4 * args.hidden * args.seq  # bytes of one fp32 vector of size d for every token

    def per_layer(build: Callable[[int], nn.Module]) -> float:
        small, large = (saved_bytes(build(n), input_ids) for n in (args.layers, 2 * args.layers))
        return (large - small) / args.layers / word

    rows: list[tuple[str, str, str]] = []

    def report(name: str, value: str, target: str = "") -> None:
        rows.append((name, value, target))
        print(f"  measured {name}: {value}", file=sys.stderr, flush=True)

    report("HF GPT-2, sdpa attention", f"{per_layer(lambda n: hf_gpt2(args, n, 'sdpa')):.2f}")
    report("HF GPT-2, eager attention", f"{per_layer(lambda n: hf_gpt2(args, n, 'eager')):.2f}")
    report("LeanGPT default", f"{per_layer(lambda n: lean_gpt(args, n)):.2f}", "<= 12")
    report("LeanGPT, plain-autograd FFN (ffn_custom_grad=False)",
           f"{per_layer(lambda n: lean_gpt(args, n, ffn_custom_grad=False)):.2f}")
    report("LeanGPT, checkpoint_attention_core",
           f"{per_layer(lambda n: lean_gpt(args, n, checkpoint_attention_core=True)):.2f}")
    report("LeanGPT, gradient_checkpointing=True",
           f"{per_layer(lambda n: lean_gpt(args, n, gradient_checkpointing=True)):.2f}", "<= 1.5")
    rev4, rev16 = (saved_bytes(lean_gpt(args, n, reversible=True), input_ids) for n in (4, 16))
    report("LeanGPT reversible: total bytes 16 layers / 4 layers", f"{rev16 / rev4:.4f}", "<= 1.05")

    print(f"\nActivation memory saved for backward, d={args.hidden}, heads={args.heads}, T={args.seq}, batch 1, "
          f"fp32 words of size d per token per layer (dropout 0)\n")
    print("| model / options | measured | target |")
    print("| --- | --- | --- |")
    for name, value, target in rows:
        print(f"| {name} | {value} | {target} |")


if __name__ == "__main__":
    main()
