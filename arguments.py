"""Command-line flags of the swarm's peers: the library's settings (:mod:`lean_transformer.swarm.protocol.settings`,
where every flag the library reads is declared once, with its check and whether the swarm must agree on it) plus the
application's own: the task (:mod:`tasks.settings`). ``run_trainer.py`` and ``run_aux_peer.py`` parse them with one
:class:`~lean_transformer.cli.SettingsParser`.

Cheap to import: parsing flags (``--help``, a mistyped flag, a bad value) loads neither torch, transformers nor
hivemind.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from lean_transformer.cli import SettingsParser
from lean_transformer.swarm.protocol.settings import (AuxSettings, CollaborationSettings, NetworkSettings,
                                                      TrainingSettings)
from tasks.settings import TaskArguments

__all__ = ["AuxSettings", "AuxTrainingArguments", "CollaborationSettings", "NetworkSettings", "TaskArguments",
           "TrainingSettings", "build_parser", "parse_arguments"]


@dataclass
class AuxTrainingArguments(TrainingSettings):
    """The trainers' optimizer and schedule flags: an aux peer needs the same ones, because they shape the optimizer
    state it downloads and writes into checkpoints (pass it the flags you pass the trainers)."""

    _argument_group_name = "optimizer and schedule (the same flags as the trainers)"

    resume_from: Optional[str] = field(default=None, metadata={
        "help": "Seed the swarm from this checkpoint: a checkpoint directory, a folder of them (the newest is "
                "used), or a Hugging Face Hub repo id (owner/name) that an aux peer uploaded to. Trainers that "
                "join continue from its epoch and weights."})
    events_path: Optional[str] = field(default=None, metadata={
        "help": "JSON-lines file of this peer's events (swarm epochs, checkpoints, evaluations, averaging rounds), "
                "for programs; appended to (default: events.jsonl beside --metrics_path)."})


def build_parser(dataclass_types: Sequence[type], description: Optional[str] = None) -> SettingsParser:
    return SettingsParser(dataclass_types, description)


def parse_arguments(dataclass_types: Sequence[type], argv: Optional[Sequence[str]] = None, *,
                    description: Optional[str] = None) -> tuple:
    """Parse ``argv`` into one instance of each dataclass; a bad value exits with one line on stderr (code 2)."""
    return build_parser(dataclass_types, description).parse_into(argv)
