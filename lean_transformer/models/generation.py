"""Printing what a trained causal LM writes: a thin layer over transformers' ``generate`` for the demo and for
people checking a checkpoint, taking any tokenizer with ``encode``, ``decode`` and ``eos_token_id``."""
from __future__ import annotations

import contextlib
from typing import Optional, Protocol, Sequence

import torch

from lean_transformer.models.gpt import LeanGPTForCausalLM


class TextTokenizer(Protocol):
    eos_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@torch.no_grad()
def sample_text(model: LeanGPTForCausalLM, tokenizer: TextTokenizer, prompts: Sequence[str],
                max_new_tokens: int = 64, do_sample: bool = True, temperature: float = 1.0, top_k: int = 0,
                seed: Optional[int] = None) -> list[str]:
    """Each prompt's continuation (the new text only), generated with the KV cache until ``max_new_tokens`` or an
    end-of-text token.

    Every prompt is preceded by an end-of-text token, as documents are in training (so an empty prompt starts a
    new document), and generated on its own, so no prompt is padded. ``seed`` makes sampling repeatable without
    touching the caller's RNG state. The model runs in eval mode (no dropout) and gets its mode back afterwards.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not do_sample and (temperature != 1.0 or top_k):
        raise ValueError("temperature and top_k apply to sampling only: pass do_sample=True or leave them out")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    texts = []
    rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else []) if seed is not None \
        else contextlib.nullcontext()
    try:
        with rng:
            if seed is not None:
                torch.manual_seed(seed)
            for prompt in prompts:
                ids = [tokenizer.eos_token_id, *tokenizer.encode(prompt)]
                limit = model.config.max_position_embeddings
                if len(ids) + max_new_tokens > limit:
                    raise ValueError(f"prompt {prompt[:20]!r}... has {len(ids)} tokens: with max_new_tokens="
                                     f"{max_new_tokens} that exceeds max_position_embeddings={limit}")
                sampling = dict(temperature=temperature, top_k=top_k) if do_sample else {}  # top_k=0: off
                output = model.generate(torch.tensor([ids], device=device), max_new_tokens=max_new_tokens,
                                        do_sample=do_sample, eos_token_id=tokenizer.eos_token_id,
                                        pad_token_id=tokenizer.eos_token_id, **sampling)
                new = output[0, len(ids):].tolist()
                if tokenizer.eos_token_id in new:
                    new = new[:new.index(tokenizer.eos_token_id)]
                texts.append(tokenizer.decode(new))
    finally:
        model.train(was_training)
    return texts
