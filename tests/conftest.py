"""Shared fixtures: tiny model configs (fast on 2 busy CPU cores) and the report of the fault and security cases."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Iterator, List

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


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """wandb offline in this process, writing under the test's ``tmp_path``. wandb starts a service process for the
    test process and records it in ``WANDB_SERVICE``, which every later peer of the session would inherit:
    ``wandb.teardown()`` stops it and clears the variable."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield
    import wandb  # noqa: PLC0415 (only the tests that log import it)

    wandb.teardown()


REPORT_LINES = pytest.StashKey[Dict[str, List[str]]]()  # test node ID -> its report lines, in run order


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Records one report line of this test (what a case tried, what held), shown at the end of the run: `make test`
    runs pytest without -s, which swallows print()."""
    lines = request.config.stash.setdefault(REPORT_LINES, {})
    lines[request.node.nodeid] = []
    return lines[request.node.nodeid].append


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Prints the report lines under one heading, grouped by test file; nothing if no test reported."""
    by_file: Dict[str, List[str]] = {}
    for nodeid, lines in config.stash.get(REPORT_LINES, {}).items():
        by_file.setdefault(nodeid.split("::")[0], []).extend(lines)
    by_file = {path: lines for path, lines in by_file.items() if lines}
    if not by_file:
        return
    terminalreporter.section("case report: what each case tried, what held")
    for path, lines in by_file.items():
        terminalreporter.write_line(path)
        for line in lines:
            terminalreporter.write_line(f"  {line}")
