"""ALBERT-style pretraining with LeanAlbert: masked language modeling with whole-word masking, plus sentence-order
prediction (SOP).

Each example is ``[CLS] A [SEP] B [SEP]`` where A and B are two consecutive runs of sentences from one document,
swapped half of the time (``sentence_order_label`` 1). Masking picks whole words until about 15% of the tokens are
covered; a picked token becomes [MASK] (80%), a random token (10%) or stays (10%), and only picked tokens carry
labels.
"""
from __future__ import annotations

import re
from collections import deque
from typing import Iterator

import numpy as np
import torch

from lean_transformer import LeanAlbertConfig, LeanAlbertForPreTraining
from tasks.base import Batch, Task
from tasks.tokenizer import Tokenizer

_SENTENCE_END = re.compile(r"(?<=[.!?])(?=\s)")  # the space stays with the next sentence
MAX_SKIPPED_DOCUMENTS = 1000
IGNORE_INDEX = -100


class SentencePairBatcher:
    def __init__(self, documents: Iterator[str], tokenizer: Tokenizer, rng: np.random.Generator,
                 pad_to_multiple_of: int, mask_probability: float = 0.15):
        self.documents, self.tokenizer, self.rng = documents, tokenizer, rng
        self.pad_to_multiple_of, self.mask_probability = pad_to_multiple_of, mask_probability
        self.sentences: deque[tuple[np.ndarray, np.ndarray]] = deque()  # (token ids, word ids) of one document
        self.next_word_id = 0  # word ids are unique across sentences, so whole-word masking never merges words

    def _tokenize(self, sentence: str) -> tuple[np.ndarray, np.ndarray]:
        ids, word_ids = self.tokenizer.encode_words(sentence)
        word_ids = np.asarray(word_ids, dtype=np.int64)
        word_ids = np.where(word_ids >= 0, word_ids + self.next_word_id, -1)
        self.next_word_id = int(word_ids.max(initial=self.next_word_id - 1)) + 1
        return np.asarray(ids, dtype=np.int64), word_ids

    def _sentence_chunk(self, budget: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """At least two consecutive sentences of one document, about ``budget`` tokens in total."""
        skipped = 0
        while len(self.sentences) < 2:
            if skipped == MAX_SKIPPED_DOCUMENTS:
                raise ValueError(f"--dataset: {skipped} documents in a row have fewer than two sentences; --task mlm "
                                 f"needs multi-sentence documents (paragraphs) for sentence-order prediction")
            self.sentences = deque(self._tokenize(s) for s in _SENTENCE_END.split(next(self.documents)) if s.strip())
            skipped += 1
        chunk = [self.sentences.popleft(), self.sentences.popleft()]
        while self.sentences and sum(len(ids) for ids, _ in chunk) < budget:
            chunk.append(self.sentences.popleft())
        return chunk

    def _example(self, sequence_length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        budget = sequence_length - 3
        chunk = self._sentence_chunk(budget)
        split = int(self.rng.integers(1, len(chunk)))
        first = [np.concatenate(parts) for parts in zip(*chunk[:split])]
        second = [np.concatenate(parts) for parts in zip(*chunk[split:])]
        while len(first[0]) + len(second[0]) > budget:  # trim the longer segment away from the boundary
            if len(first[0]) >= len(second[0]):
                first = [part[1:] for part in first]
            else:
                second = [part[:-1] for part in second]
        swapped = int(self.rng.random() < 0.5)
        if swapped:
            first, second = second, first
        tok = self.tokenizer
        special = np.array([-1])
        input_ids = np.concatenate([[tok.cls_token_id], first[0], [tok.sep_token_id], second[0], [tok.sep_token_id]])
        word_ids = np.concatenate([special, first[1], special, second[1], special])
        token_type_ids = np.concatenate([np.zeros(len(first[0]) + 2), np.ones(len(second[0]) + 1)])
        return input_ids, word_ids, token_type_ids.astype(np.int64), swapped

    def _mask_whole_words(self, input_ids: np.ndarray, word_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        words = np.unique(word_ids[word_ids >= 0])
        target = max(1, round(self.mask_probability * int((word_ids >= 0).sum())))
        picked = np.zeros(len(input_ids), dtype=bool)
        for word in self.rng.permutation(words):
            positions = word_ids == word
            if picked.sum() + positions.sum() > target:
                continue
            picked |= positions
            if picked.sum() >= target:
                break
        labels = np.where(picked, input_ids, IGNORE_INDEX)
        roll = self.rng.random(len(input_ids))
        masked = input_ids.copy()
        masked[picked & (roll < 0.8)] = self.tokenizer.mask_token_id
        randomized = picked & (roll >= 0.8) & (roll < 0.9)
        masked[randomized] = self.rng.integers(0, self.tokenizer.num_random_tokens, int(randomized.sum()))
        return masked, labels

    def next_batch(self, batch_size: int, sequence_length: int) -> Batch:
        rows = []
        for _ in range(batch_size):
            input_ids, word_ids, token_type_ids, swapped = self._example(sequence_length)
            masked, labels = self._mask_whole_words(input_ids, word_ids)
            rows.append((masked, token_type_ids, labels, swapped))
        longest = max(len(row[0]) for row in rows)
        length = min(sequence_length, -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of)
        batch = dict(input_ids=torch.full((batch_size, length), self.tokenizer.pad_token_id, dtype=torch.long),
                     attention_mask=torch.zeros(batch_size, length, dtype=torch.long),
                     token_type_ids=torch.zeros(batch_size, length, dtype=torch.long),
                     labels=torch.full((batch_size, length), IGNORE_INDEX, dtype=torch.long),
                     sentence_order_label=torch.tensor([row[3] for row in rows], dtype=torch.long))
        for i, (masked, token_type_ids, labels, _) in enumerate(rows):
            n = len(masked)
            batch["input_ids"][i, :n] = torch.from_numpy(masked)
            batch["attention_mask"][i, :n] = 1
            batch["token_type_ids"][i, :n] = torch.from_numpy(token_type_ids)
            batch["labels"][i, :n] = torch.from_numpy(labels)
        return batch


class MLMTask(Task):
    name = "mlm"
    default_config = "tiny_albert.json"
    config_class = LeanAlbertConfig
    model_class = LeanAlbertForPreTraining

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        missing = [name for name in ("mask_token_id", "cls_token_id", "sep_token_id")
                   if getattr(self.tokenizer, name) is None]
        if missing:
            raise ValueError(f"--tokenizer_path: --task mlm needs [MASK], [CLS] and [SEP] tokens; the tokenizer has "
                             f"no {', '.join(name[:-len('_token_id')] for name in missing)} token")

    def batcher(self, documents: Iterator[str], seed: int) -> SentencePairBatcher:
        return SentencePairBatcher(documents, self.tokenizer, np.random.default_rng(seed),
                                   self.training_args.pad_to_multiple_of)
