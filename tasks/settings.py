"""The task's flags: what the swarm trains (objective, model architecture, tokenizer, data). The fields marked
``agree`` are run settings every peer must share (with the library's, see
:func:`lean_transformer.swarm.protocol.settings.agreed_settings`)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from lean_transformer.swarm.protocol.settings import require
from tasks import TASKS


@dataclass
class TaskArguments:
    """What the swarm trains: the objective, the model architecture, the tokenizer and the data."""

    _argument_group_name = "task (every peer that builds the model)"

    task: str = field(default="causal_lm", metadata={
        "help": "Training objective: causal_lm (LeanGPT) or mlm (LeanAlbert: whole-word masked LM and "
                "sentence-order prediction)."})
    model_config_path: Optional[str] = field(default=None, metadata={
        "help": "JSON file with the model's architecture (default: the task's tiny config in tasks/configs/). "
                "vocab_size is always set from the tokenizer."})
    tokenizer_path: Optional[str] = field(default=None, metadata={
        "help": "Directory of a Hugging Face tokenizer (loaded offline). Default: the built-in byte-level one."})
    dataset: str = field(default="embedded", metadata={
        "help": "Training text: 'embedded' (a generated corpus with a known entropy floor, no internet needed), "
                "a glob of local text files (e.g. 'data/**/*.txt'), or 'hf:NAME[:CONFIG]' to stream a Hugging "
                "Face dataset."})
    dataset_split: str = field(default="train", metadata={"help": "Split of a Hugging Face dataset."})
    dataset_text_field: str = field(default="text", metadata={"help": "Text column of a Hugging Face dataset."})
    shuffle_buffer_size: int = field(default=10_000, metadata={
        "help": "Documents held in the shuffle buffer; each peer shuffles with a seed derived from its identity."})
    corpus_seed: int = field(default=0, metadata={
        "help": "Seed of the embedded corpus's Markov chain; every peer must use the same one."})
    validation_fraction: float = field(default=0.01, metadata={"agree": True, 
        "help": "Fraction of the documents held out for validation (chosen by a hash of each document's text): "
                "trainers never read them, the aux peer evaluates checkpoints on them. Every peer must use the same "
                "one."})

    def __post_init__(self):
        require(self.task in TASKS, "task", f"unknown task {self.task!r}, choose one of {', '.join(TASKS)}")
        for name in ("model_config_path", "tokenizer_path"):
            path = getattr(self, name)
            require(path is None or os.path.exists(path), name, f"{path} does not exist")
        require(self.shuffle_buffer_size > 0, "shuffle_buffer_size",
                f"must be positive, got {self.shuffle_buffer_size}")
        require(0 <= self.validation_fraction < 1, "validation_fraction",
                f"must be in [0, 1), got {self.validation_fraction}")
