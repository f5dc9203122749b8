"""Training tasks: a registry from ``--task`` names to Task classes (imported lazily, so that checking a name does
not load the model code)."""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.base import Task

TASKS = {"causal_lm": "tasks.causal_lm:CausalLMTask", "mlm": "tasks.mlm:MLMTask"}


def get_task(name: str) -> type[Task]:
    if name not in TASKS:
        raise ValueError(f"--task: unknown task {name!r}, choose one of {', '.join(TASKS)}")
    module, _, cls = TASKS[name].partition(":")
    return getattr(import_module(module), cls)
