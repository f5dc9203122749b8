"""A short local training of a tiny LeanGPT on generated data, printing the loss and memory figures.

The data are arithmetic sequences modulo the vocabulary size (each with its own random start and step), so the
model can only predict well by inferring the step in context: the loss falls visibly within a few hundred steps.

Usage: python -m lean_transformer.demo.one_process [--steps 150 --seed 0]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from lean_transformer import LeanGPTConfig, LeanGPTForCausalLM
from lean_transformer.modules.memory import SavedTensorCounter

VOCAB, SEQ_LEN, BATCH = 32, 32, 16


def arithmetic_sequences(batch: int, generator: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, VOCAB, (batch, 1), generator=generator)
    step = torch.randint(1, 6, (batch, 1), generator=generator)
    return (start + step * torch.arange(SEQ_LEN)) % VOCAB


def activation_bytes(model: LeanGPTForCausalLM, input_ids: torch.Tensor, **options) -> int:
    model.set_optimizations(**options)
    with SavedTensorCounter(exclude=model.parameters()).record() as counter:
        model(input_ids, labels=input_ids)
    model.set_optimizations()
    return counter.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be positive")
    torch.set_num_threads(1)  # a model this small runs fastest on one thread
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    config = LeanGPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                           max_position_embeddings=SEQ_LEN, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = LeanGPTForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    print(f"LeanGPT: {sum(p.numel() for p in model.parameters()):,} parameters, {config.num_hidden_layers} layers, "
          f"d={config.hidden_size}; training {args.steps} steps on generated arithmetic sequences")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        input_ids = arithmetic_sequences(BATCH, generator)
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1 or step % 25 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.3f}  ({time.perf_counter() - start:.1f}s)", flush=True)

    input_ids = arithmetic_sequences(BATCH, generator)
    per_token_layer = BATCH * SEQ_LEN * config.num_hidden_layers * 4 * config.hidden_size
    print("\nActivation memory kept for backward (fp32 words of size d per token per layer, embeddings and "
          "LM head included):")
    for name, options in [("plain autograd FFN", dict(ffn_custom_grad=False)), ("default", {}),
                          ("gradient checkpointing", dict(gradient_checkpointing=True))]:
        print(f"  {name:24s} {activation_bytes(model, input_ids, **options) / per_token_layer:6.2f}")
    if loss.item() > 2.5:
        print("warning: the loss did not fall as expected", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
