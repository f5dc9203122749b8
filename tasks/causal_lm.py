"""Causal language modeling with LeanGPT: documents are tokenized, joined with an end-of-text token and cut into
full-length rows (no padding, so batches carry no attention mask and attention runs unmasked, ``is_causal``)."""
from __future__ import annotations

from typing import Iterator

import torch

from lean_transformer import LeanGPTConfig, LeanGPTForCausalLM
from tasks.base import Batch, Task
from tasks.tokenizer import Tokenizer


class PackedBatcher:
    def __init__(self, documents: Iterator[str], tokenizer: Tokenizer):
        self.documents, self.tokenizer = documents, tokenizer
        self.buffer: list[int] = []

    def next_batch(self, batch_size: int, sequence_length: int) -> Batch:
        needed = batch_size * sequence_length
        while len(self.buffer) < needed:
            self.buffer.extend(self.tokenizer.encode(next(self.documents)))
            self.buffer.append(self.tokenizer.eos_token_id)
        input_ids = torch.tensor(self.buffer[:needed], dtype=torch.long).view(batch_size, sequence_length)
        del self.buffer[:needed]
        return dict(input_ids=input_ids, labels=input_ids.clone())


class CausalLMTask(Task):
    name = "causal_lm"
    default_config = "tiny_gpt.json"
    config_class = LeanGPTConfig
    model_class = LeanGPTForCausalLM

    def batcher(self, documents: Iterator[str], seed: int) -> PackedBatcher:
        return PackedBatcher(documents, self.tokenizer)
