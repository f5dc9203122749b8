"""Tokenizers of the tasks: the built-in byte-level one (no files, no internet), or a Hugging Face tokenizer saved in
a local directory. Both give word boundaries, which whole-word masking needs, and both save themselves in Hugging
Face's format into every checkpoint, so that ``AutoTokenizer.from_pretrained(checkpoint)`` loads the tokenizer the
model was trained with."""
from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Optional, Protocol

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

_WHITESPACE = np.frombuffer(b" \t\n\r\x0b\x0c", dtype=np.uint8)


class Tokenizer(Protocol):
    """What the tasks need from a tokenizer."""

    pad_token_id: int
    eos_token_id: int
    mask_token_id: Optional[int]
    cls_token_id: Optional[int]
    sep_token_id: Optional[int]
    num_random_tokens: int  # MLM's random replacements are drawn from ids [0, num_random_tokens)

    def __len__(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_words(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids and, for each token, the index of the word it belongs to (-1: no word, e.g. whitespace)."""

    def decode(self, ids: list[int]) -> str: ...

    def fingerprint(self) -> str:
        """Equal for tokenizers that map text to the same ids (peers of a run must agree on it)."""

    def save_pretrained(self, directory: str) -> None:
        """Write the tokenizer in Hugging Face's format (loadable with ``AutoTokenizer.from_pretrained``)."""


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; five special tokens follow. Words are maximal runs of non-whitespace bytes."""

    pad_token_id, eos_token_id, mask_token_id, cls_token_id, sep_token_id = range(256, 261)
    num_random_tokens = 256
    SPECIAL_TOKENS = dict(pad_token="<pad>", eos_token="</s>", mask_token="<mask>", cls_token="<cls>",
                          sep_token="<sep>")  # ids 256..260, in this order

    def __len__(self) -> int:
        return 261

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_words(self, text: str) -> tuple[list[int], list[int]]:
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        is_space = np.isin(ids, _WHITESPACE)
        starts_word = ~is_space & np.concatenate([[True], is_space[:-1]])
        word_ids = np.cumsum(starts_word) - 1
        word_ids[is_space] = -1
        return ids.tolist(), word_ids.tolist()

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return f"bytes:{len(self)}"

    def to_hf(self) -> "PreTrainedTokenizerFast":
        """The same tokenizer as a Hugging Face fast tokenizer: a byte-level BPE without merges (each byte one
        token, with GPT-2's byte-to-character map and word splitting) whose ids are the byte values; special tokens
        in the text are split into bytes too, as here."""
        from tokenizers import Tokenizer as RustTokenizer
        from tokenizers import decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        vocabulary = {character: byte for byte, character in bytes_to_unicode().items()}
        tokenizer = RustTokenizer(models.BPE(vocab=vocabulary, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens(list(self.SPECIAL_TOKENS.values()))
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer, split_special_tokens=True, **self.SPECIAL_TOKENS)

    def save_pretrained(self, directory: str) -> None:
        self.to_hf().save_pretrained(directory)


class HFTokenizer:
    """A Hugging Face (fast) tokenizer loaded from a local directory, without network access."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise FileNotFoundError(f"--tokenizer_path: {path} is not a directory with a saved tokenizer")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"--tokenizer_path: cannot load a tokenizer from {path} ({e})") from None
        if not self.tokenizer.is_fast:
            raise ValueError(f"--tokenizer_path: {path} holds a slow tokenizer; a fast one is needed for word ids")
        tok = self.tokenizer
        self.eos_token_id = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
        if self.eos_token_id is None:
            raise ValueError(f"--tokenizer_path: the tokenizer in {path} has neither an eos nor a sep token")
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_token_id
        self.mask_token_id, self.cls_token_id, self.sep_token_id = tok.mask_token_id, tok.cls_token_id, tok.sep_token_id
        self.num_random_tokens = len(tok)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_words(self, text: str) -> tuple[list[int], list[int]]:
        encoding = self.tokenizer(text, add_special_tokens=False)
        word_ids = [-1 if word is None else word for word in encoding.word_ids()]
        return encoding["input_ids"], word_ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def save_pretrained(self, directory: str) -> None:
        self.tokenizer.save_pretrained(directory)

    def fingerprint(self) -> str:
        vocabulary = json.dumps(sorted(self.tokenizer.get_vocab().items())).encode()
        return f"{type(self.tokenizer).__name__}:{len(self)}:{hashlib.sha256(vocabulary).hexdigest()[:16]}"


def load_tokenizer(path: Optional[str]) -> Tokenizer:
    return ByteTokenizer() if path is None else HFTokenizer(path)
