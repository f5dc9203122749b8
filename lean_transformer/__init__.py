"""lean_transformer: a transformer that does not hog GPU memory.

Importing the package is cheap (the command-line flags of the peers are parsed before torch, transformers or hivemind
load); the model classes below load on first use, and ``import lean_transformer.models`` (which any of them does)
registers them with transformers' Auto classes.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lean_transformer.config import LeanAlbertConfig, LeanGPTConfig, LeanTransformerConfig
    from lean_transformer.models import (LeanAlbertForPreTraining, LeanGPTForCausalLM, LeanPreTrainedModel,
                                         LeanTransformerModel)

_EXPORTS = {"LeanAlbertConfig": "lean_transformer.config", "LeanGPTConfig": "lean_transformer.config",
            "LeanTransformerConfig": "lean_transformer.config", "LeanAlbertForPreTraining": "lean_transformer.models",
            "LeanGPTForCausalLM": "lean_transformer.models", "LeanPreTrainedModel": "lean_transformer.models",
            "LeanTransformerModel": "lean_transformer.models"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lean_transformer' has no attribute {name!r}")
    importlib.import_module("lean_transformer.models")  # registers the Auto classes, whichever name comes first
    return getattr(importlib.import_module(_EXPORTS[name]), name)
