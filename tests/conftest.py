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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Swarm tests run real peers that share 2 CPU cores: hivemind's matchmaking sometimes misses every round
    under that load ("could not find a group"), so such a test gets up to 2 fresh re-runs (its fixtures rebuilt)."""
    for item in items:
        if item.get_closest_marker("swarm"):
            item.add_marker(pytest.mark.flaky(reruns=2))
