"""Shared fixtures for the model-library tests: tiny configs (fast on 2 busy CPU cores)."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from lean_transformer import LeanAlbertConfig, LeanGPTConfig

TINY = dict(vocab_size=61, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@pytest.fixture
def gpt_config() -> Callable[..., LeanGPTConfig]:
    """A factory of tiny LeanGPT configs; keyword arguments override the defaults."""
    return lambda **overrides: LeanGPTConfig(**{**TINY, **overrides})


@pytest.fixture
def albert_config() -> Callable[..., LeanAlbertConfig]:
    return lambda **overrides: LeanAlbertConfig(**{**TINY, "classifier_dropout_prob": 0.0, **overrides})


# Tiny models run fastest on one thread, and several OpenMP threads on a shared, busy machine mostly spin.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
