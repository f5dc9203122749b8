"""Shared fixtures: tiny model configs (fast on 2 busy CPU cores), the report of the fault and security cases, and
the box's share between pytest-xdist's workers (files marked ``alone`` run with the box to themselves, and first)."""
from __future__ import annotations

import fcntl
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

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


CASE_REPORT = "case report"  # the user_properties name of a report line: pytest-xdist sends them with each report
REPORT_LINES: Dict[str, List[str]] = {}  # test file -> its report lines, in the order the tests ended


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Records one report line of this test (what a case tried, what held), shown at the end of the run: `make test`
    runs pytest without -s, which swallows print()."""
    return lambda line: request.node.user_properties.append((CASE_REPORT, line))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Collects a test's report lines once it is over (its teardown's report carries all of them), in this process
    or, under pytest-xdist, in the controller, from the workers' reports."""
    if report.when == "teardown":
        lines = [value for name, value in report.user_properties if name == CASE_REPORT]
        if lines:
            REPORT_LINES.setdefault(report.nodeid.split("::")[0], []).extend(lines)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Prints the report lines under one heading, grouped by test file; nothing if no test reported."""
    if not REPORT_LINES:
        return
    terminalreporter.section("case report: what each case tried, what held")
    for path, lines in REPORT_LINES.items():
        terminalreporter.write_line(path)
        for line in lines:
            terminalreporter.write_line(f"  {line}")


class BoxShare:
    """Under pytest-xdist (``make test`` runs 2 workers, one per core): a test file holds a shared lock on the box
    while its tests run, and a file marked ``alone`` an exclusive one, so that no other file's peers run beside it.
    Most swarm tests wait for epochs and timeouts more than for the CPU and share the 2 cores well (the suite took
    23.5 min on 2 workers against 34.8-36.3 serially); a file marked ``alone`` needs the CPU it promises its peers.
    Held per file, not per test: a module's swarm fixture lives across its tests. A writer first takes the gate,
    so a worker that keeps starting files does not starve the one waiting to run a file alone."""

    WAIT = 1800.0  # seconds: longer than any file takes (the longest, ~5 min), so reaching it means a stuck worker

    def __init__(self, folder: Path):
        self.gate, self.box = (folder / "gate").open("a"), (folder / "box").open("a")
        self.file: Optional[Path] = None  # the file whose lock this worker holds
        self.alone = False

    def enter(self, item: pytest.Item) -> None:
        alone = item.get_closest_marker("alone") is not None
        if self.file == item.path and self.alone == alone:
            return
        self.leave()
        self._lock(self.gate, fcntl.LOCK_EX)
        try:
            self._lock(self.box, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self.gate, fcntl.LOCK_UN)
        self.file, self.alone = item.path, alone

    def leave(self) -> None:
        if self.file is not None:
            fcntl.flock(self.box, fcntl.LOCK_UN)
            self.file = None

    def _lock(self, handle, kind: int) -> None:
        deadline = time.monotonic() + self.WAIT
        while True:
            try:
                fcntl.flock(handle, kind | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the other pytest-xdist worker held the box for {self.WAIT:.0f} s") from None
                time.sleep(0.2)


BOX_SHARE, BOX_FOLDER = pytest.StashKey[BoxShare](), pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)  # a pytest-xdist worker's
    if workerinput is not None and "box_share" in workerinput:
        config.stash[BOX_SHARE] = BoxShare(Path(workerinput["box_share"]))
    elif getattr(config.option, "numprocesses", None):  # the controller of pytest-xdist's workers: the locks' folder
        config.stash[BOX_FOLDER] = Path(tempfile.mkdtemp(prefix="lean-transformer-tests-"))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's
def pytest_configure_node(node: Any) -> None:
    folder = node.config.stash.get(BOX_FOLDER, None)
    if folder is not None:
        node.workerinput["box_share"] = str(folder)


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(BOX_FOLDER, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Files marked ``alone`` first, then by number of tests (pytest-xdist's own order, which ``make test`` turns off
    with ``--no-loadscope-reorder`` for this one). A worker that reaches an alone file in mid-run idles until the
    other's current file ends (a swarm file: up to 6 min); at the start both begin together, and the alone files cost
    only their own time (estimated from a CI run's file times: ~100 s less; the next CI run fit 211 s more of summed
    test time into the same 24:20)."""
    per_file = Counter(item.path for item in items)
    alone = {item.path for item in items if item.get_closest_marker("alone") is not None}
    items.sort(key=lambda item: (item.path not in alone, -per_file[item.path]))  # stable: in-file order kept


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outside pytest-timeout's: the wait is not the test's time
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Iterator[None]:
    share = item.config.stash.get(BOX_SHARE, None)
    if share is not None:
        share.enter(item)
    yield
    if share is not None and (nextitem is None or nextitem.path != item.path):
        share.leave()
