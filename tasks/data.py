"""Where a peer's training text comes from: the embedded Markov corpus, local text files, or a streamed Hugging Face
dataset. A source is opened (and checked) once at start-up; ``documents(seed)`` then gives an endless stream of
documents in an order that depends on ``seed``, which each peer derives from its identity."""
from __future__ import annotations

import glob
import os
import random
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Iterable, Iterator, Optional, TypeVar

from lean_transformer.demo.markov import MarkovCorpus

if TYPE_CHECKING:
    from arguments import TaskArguments

T = TypeVar("T")


class TextSource(ABC):
    @abstractmethod
    def documents(self, seed: int) -> Iterator[str]:
        """Endless stream of non-empty documents, shuffled with ``seed``."""


class EmbeddedSource(TextSource):
    """Documents sampled from the embedded Markov corpus; the chain is shared (``corpus_seed``), the trajectory is
    the peer's own."""

    def __init__(self, corpus_seed: int):
        self.corpus = MarkovCorpus.generate(corpus_seed)

    def documents(self, seed: int) -> Iterator[str]:
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

    def documents(self, seed: int) -> Iterator[str]:
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

    def documents(self, seed: int) -> Iterator[str]:
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
    """Open the source named by ``--dataset``; raises FileNotFoundError / ValueError naming the flag if unusable."""
    if args.dataset == "embedded":
        return EmbeddedSource(args.corpus_seed)
    if args.dataset.startswith("hf:"):
        name, _, config = args.dataset[len("hf:"):].partition(":")
        if not name:
            raise ValueError(f"--dataset: {args.dataset!r} names no dataset; use hf:NAME or hf:NAME:CONFIG")
        return HuggingFaceSource(name, config or None, args.dataset_split, args.dataset_text_field,
                                 args.shuffle_buffer_size)
    return FileSource(args.dataset, args.shuffle_buffer_size)
