"""Where a peer's training text comes from: the embedded Markov corpus, local text files, or a streamed Hugging Face
dataset. A source is opened (and checked) once at start-up; ``documents(seed)`` then gives an endless stream of
documents in an order that depends on ``seed``, which each peer derives from its identity.

Every source is split in two by a hash of each document's text (``--validation_fraction`` of them are held out):
trainers read only the training documents, the aux peer evaluates checkpoints on the held-out ones. The split is
the same on every machine and for every seed, so no trainer ever sees a held-out document.
"""
from __future__ import annotations

import glob
import hashlib
import os
import random
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Iterable, Iterator, Literal, Optional, TypeVar

from lean_transformer.data.markov import MarkovCorpus

if TYPE_CHECKING:
    from tasks.settings import TaskArguments

T = TypeVar("T")
Split = Literal["train", "validation"]
MAX_DOCUMENTS_OUTSIDE_SPLIT = 100_000  # in a row; far beyond chance for any usable fraction


def is_held_out(document: str, fraction: float) -> bool:
    """Whether ``document`` belongs to the held-out split: the first 8 bytes of its BLAKE2b digest, read as a
    fraction of 2^64, fall below ``fraction`` (deterministic, independent of the process and of any seed)."""
    digest = hashlib.blake2b(document.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


class TextSource(ABC):
    validation_fraction: float = 0.0

    @abstractmethod
    def all_documents(self, seed: int) -> Iterator[str]:
        """Endless stream of non-empty documents of both splits, shuffled with ``seed``."""

    def documents(self, seed: int, split: Split = "train") -> Iterator[str]:
        """Endless stream of the documents of one split, shuffled with ``seed``. Raises ValueError naming the flag
        if the split stays empty for ``MAX_DOCUMENTS_OUTSIDE_SPLIT`` documents in a row (e.g. a tiny file)."""
        held_out = split == "validation"
        if held_out and self.validation_fraction == 0:
            raise ValueError("--validation_fraction: is 0, so there are no held-out documents to evaluate on (pass "
                             "--eval_batches 0 to evaluate nothing)")
        outside = 0
        for document in self.all_documents(seed):
            if is_held_out(document, self.validation_fraction) == held_out:
                outside = 0
                yield document
            else:
                outside += 1
                if outside == MAX_DOCUMENTS_OUTSIDE_SPLIT:
                    raise ValueError(f"--validation_fraction: {outside} documents in a row fell outside the {split} "
                                     f"split (fraction {self.validation_fraction:g}); the dataset is too small or "
                                     f"the fraction too extreme")


class EmbeddedSource(TextSource):
    """Documents sampled from the embedded Markov corpus; the chain is shared (``corpus_seed``), the trajectory is
    the peer's own."""

    def __init__(self, corpus_seed: int):
        self.corpus = MarkovCorpus.generate(corpus_seed)

    def all_documents(self, seed: int) -> Iterator[str]:
        return self.corpus.documents(seed)


class FileSource(TextSource):
    """Paragraphs (blocks separated by blank lines) of local UTF-8 text files, endlessly re-read: each pass visits
    the files in a new order and mixes paragraphs through a shuffle buffer."""

    def __init__(self, pattern: str, shuffle_buffer_size: int):
        self.files = sorted(path for path in glob.glob(os.path.expanduser(pattern), recursive=True)
                            if os.path.isfile(path))
        if not self.files:
            raise FileNotFoundError(f"--dataset: no files match {pattern!r}")
        if not any(map(_has_text, self.files)):  # the endless reader would loop forever
            raise ValueError(f"--dataset: the files matching {pattern!r} hold no text")
        self.shuffle_buffer_size = shuffle_buffer_size

    def _paragraphs(self, rng: random.Random) -> Iterator[str]:
        while True:
            for path in rng.sample(self.files, len(self.files)):
                with open(path, encoding="utf-8", errors="replace") as file:
                    paragraph: list[str] = []
                    for line in file:
                        if line.strip():
                            paragraph.append(line.strip())
                        elif paragraph:
                            yield " ".join(paragraph)
                            paragraph = []
                    if paragraph:
                        yield " ".join(paragraph)

    def all_documents(self, seed: int) -> Iterator[str]:
        rng = random.Random(seed)
        return shuffle_buffer(self._paragraphs(rng), self.shuffle_buffer_size, rng)


class HuggingFaceSource(TextSource):
    """A Hugging Face dataset, streamed (nothing is downloaded in advance) and shuffled by ``datasets`` itself."""

    def __init__(self, name: str, config: Optional[str], split: str, text_field: str, shuffle_buffer_size: int):
        import datasets

        try:
            self.dataset = datasets.load_dataset(name, config, split=split, streaming=True)
        except Exception as e:  # datasets raises many types: missing dataset, no network, bad config, ...
            raise ValueError(f"--dataset: cannot open Hugging Face dataset {name!r} "
                             f"({type(e).__name__}: {e})") from None
        columns = self.dataset.column_names
        if columns is not None and text_field not in columns:
            raise ValueError(f"--dataset_text_field: {name!r} has no column {text_field!r} (columns: {columns})")
        self.text_field, self.shuffle_buffer_size = text_field, shuffle_buffer_size

    def all_documents(self, seed: int) -> Iterator[str]:
        shuffled = self.dataset.shuffle(seed=seed % 2**32, buffer_size=self.shuffle_buffer_size)
        epoch = 0
        while True:
            shuffled.set_epoch(epoch)
            for example in shuffled:
                text = example[self.text_field]
                if isinstance(text, str) and text.strip():
                    yield text
            epoch += 1


def _has_text(path: str, chunk_size: int = 2**16) -> bool:
    with open(path, encoding="utf-8", errors="replace") as file:
        while chunk := file.read(chunk_size):
            if not chunk.isspace():
                return True
    return False


def shuffle_buffer(items: Iterable[T], buffer_size: int, rng: random.Random) -> Iterator[T]:
    """Yield the items in a random order, holding at most ``buffer_size`` of them (for endless streams)."""
    buffer: list[T] = []
    for item in items:
        if len(buffer) < buffer_size:
            buffer.append(item)
            continue
        index = rng.randrange(buffer_size)
        yield buffer[index]
        buffer[index] = item
    rng.shuffle(buffer)
    yield from buffer


def make_text_source(args: TaskArguments) -> TextSource:
    """Open the source named by ``--dataset``, split by ``--validation_fraction``; raises FileNotFoundError /
    ValueError naming the flag if unusable."""
    source: TextSource
    if args.dataset == "embedded":
        source = EmbeddedSource(args.corpus_seed)
    elif args.dataset.startswith("hf:"):
        name, _, config = args.dataset[len("hf:"):].partition(":")
        if not name:
            raise ValueError(f"--dataset: {args.dataset!r} names no dataset; use hf:NAME or hf:NAME:CONFIG")
        source = HuggingFaceSource(name, config or None, args.dataset_split, args.dataset_text_field,
                                   args.shuffle_buffer_size)
    else:
        source = FileSource(args.dataset, args.shuffle_buffer_size)
    source.validation_fraction = args.validation_fraction
    return source
