"""The aux peer's bookkeeping without a swarm: aggregation, the JSONL history, the PNG plot, wandb offline, flat
memory. The same code runs against a real swarm in tests/test_aux_swarm.py."""
from __future__ import annotations

import gc
import json
import math
import random
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import pytest

from lean_transformer.swarm.monitoring.aggregation import EpochCollector, SwarmStats, aggregate
from lean_transformer.swarm.monitoring.plot import redraw_plot
from lean_transformer.swarm.monitoring.run_history import RunHistory, read_rows

from aux_utils import assert_valid_png, wait_for_wandb_history


@dataclass
class Record:
    epoch: int
    samples_per_second: float
    samples_accumulated: int
    loss_sum: float
    mini_steps: int


def random_record(rng: random.Random, epoch: int) -> Record:
    return Record(epoch, rng.uniform(1, 100), rng.randint(1, 64), rng.uniform(0, 50), rng.randint(1, 16))


def test_aggregate_weights_loss_by_mini_steps():
    rng = random.Random(0)
    records = [random_record(rng, epoch=3) for _ in range(5)]
    stats = aggregate(3, records, now=123.0)
    assert stats.epoch == 3 and stats.alive_peers == 5 and stats.time == 123.0
    assert stats.loss == pytest.approx(sum(r.loss_sum for r in records) / sum(r.mini_steps for r in records))
    assert stats.loss != pytest.approx(sum(r.loss_sum / r.mini_steps for r in records) / len(records))
    assert stats.samples_per_second == pytest.approx(sum(r.samples_per_second for r in records))
    assert stats.samples_in_epoch == sum(r.samples_accumulated for r in records)
    assert stats.mini_steps == sum(r.mini_steps for r in records)


def test_aggregate_without_mini_steps_has_no_loss():
    stats = aggregate(0, [Record(0, 1.0, 0, 0.0, 0)], now=0.0)
    assert math.isnan(stats.loss)
    assert stats.to_dict()["loss"] is None
    assert math.isnan(SwarmStats.from_dict(json.loads(json.dumps(stats.to_dict()))).loss)


def test_collector_waits_for_every_alive_peer_then_releases_each_epoch_once():
    rng = random.Random(1)
    collector = EpochCollector()
    a0, b0 = random_record(rng, 0), random_record(rng, 0)
    assert collector.update({"a": a0, "b": Record(0, 0.0, 0, 0.0, 0)}, now=1.0) == [
        aggregate(0, [a0, Record(0, 0.0, 0, 0.0, 0)], now=1.0)
    ]
    # b has not reported epoch 1 yet: epoch 1 stays open while a's record for it is kept
    a1 = random_record(rng, 1)
    assert collector.update({"a": a1, "b": b0}, now=2.0) == []
    b1 = random_record(rng, 1)
    released = collector.update({"a": a1, "b": b1}, now=3.0)
    assert released == [aggregate(1, [a1, b1], now=3.0)]
    assert collector.update({"a": a1, "b": b1}, now=4.0) == []  # never twice


def test_collector_releases_an_epoch_when_a_later_one_appears():
    """A peer that stopped reporting (its old record still alive) must not block the log forever; epochs that
    were skipped between two refreshes are released in order."""
    rng = random.Random(2)
    collector = EpochCollector()
    stale = random_record(rng, 0)
    a1 = random_record(rng, 1)
    assert collector.update({"a": a1, "stale": stale}, now=1.0) == [aggregate(0, [stale], now=1.0)]
    a3 = random_record(rng, 3)
    released = collector.update({"a": a3, "stale": stale}, now=2.0)
    assert [s.epoch for s in released] == [1]
    assert released[0] == aggregate(1, [a1], now=2.0)


def test_collector_skips_epochs_already_logged_before_a_restart():
    rng = random.Random(3)
    collector = EpochCollector(last_released_epoch=5)
    old, new = random_record(rng, 5), random_record(rng, 6)
    assert collector.update({"a": old, "b": new}, now=1.0) == []
    assert [s.epoch for s in collector.update({"a": random_record(rng, 6), "b": new}, now=2.0)] == [6]


def test_history_appends_jsonl_and_survives_restarts_and_torn_lines(tmp_path: Path):
    path = tmp_path / "metrics" / "swarm.jsonl"
    rng = random.Random(4)
    rows = [aggregate(epoch, [random_record(rng, epoch)], now=float(epoch)) for epoch in range(5)]
    history = RunHistory(path, max_rows=3)
    for row in rows[:4]:
        history.append(row)
    assert [r.epoch for r in history.rows] == [1, 2, 3]  # bounded in memory...
    assert list(read_rows(path)) == rows[:4]  # ...complete on disk
    with path.open("a") as file:
        file.write('{"epoch": 4, "alive_pe')  # a crash in the middle of a line
    reopened = RunHistory(path, max_rows=10)
    assert reopened.last_epoch == 3
    reopened.append(rows[4])
    assert list(read_rows(path)) == rows
    assert json.loads(path.read_text().splitlines()[-1]) == rows[4].to_dict()


def test_plot_is_a_valid_png_and_replaced_atomically(tmp_path: Path):
    rng = random.Random(5)
    rows = [aggregate(epoch, [random_record(rng, epoch) for _ in range(2)], now=60.0 * epoch) for epoch in range(4)]
    path = tmp_path / "swarm.png"
    redraw_plot(rows[:2], path, title="run")
    first = path.read_bytes()
    redraw_plot(rows, path, title="run")
    assert path.read_bytes() != first
    assert_valid_png(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["swarm.png"]  # no temporary file left behind


def test_wandb_offline_run_holds_the_rows(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    from lean_transformer.swarm.monitoring.wandb_log import WandbLogger

    rng = random.Random(6)
    rows = [aggregate(epoch, [random_record(rng, epoch)], now=float(epoch)) for epoch in range(3)]
    logger = WandbLogger(project="lean-test", run_name="aux", config={"run_id": "x"}, directory=str(tmp_path))
    for row in rows:
        logger.log(row)
    logger.finish()
    logged = wait_for_wandb_history(tmp_path, rows=3)
    assert [entry["_step"] for entry in logged] == [0, 1, 2]
    for entry, row in zip(logged, rows):
        assert entry["loss"] == pytest.approx(row.loss, rel=1e-6)
        assert entry["samples_per_second"] == pytest.approx(row.samples_per_second, rel=1e-6)
        assert entry["alive_peers"] == row.alive_peers


def test_monitor_memory_stays_flat(tmp_path: Path):
    """Hours of refreshes must not grow memory: run thousands of epochs through the collector and the history and
    compare the Python heap after a warm-up (a full history window) with the heap at the end."""
    rng = random.Random(7)
    collector, history = EpochCollector(), RunHistory(tmp_path / "h.jsonl", max_rows=100)
    peers = [f"peer{i}" for i in range(8)]

    def run_epochs(start: int, count: int) -> None:
        for epoch in range(start, start + count):
            for row in collector.update({peer: random_record(rng, epoch) for peer in peers}, now=float(epoch)):
                history.append(row)

    run_epochs(0, 200)
    gc.collect()
    tracemalloc.start()
    try:
        run_epochs(200, 100)
        gc.collect()
        warm, _ = tracemalloc.get_traced_memory()
        run_epochs(300, 2000)
        gc.collect()
        end, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert end - warm < 64 * 1024, f"heap grew by {(end - warm) / 1024:.0f} KiB over 2000 epochs"


def test_plot_keeps_no_figures_alive(tmp_path: Path):
    """Redrawing must not accumulate figures (pyplot's global registry would keep every one of them)."""
    from matplotlib.figure import Figure

    rng = random.Random(8)
    rows = [aggregate(epoch, [random_record(rng, epoch)], now=float(epoch)) for epoch in range(10)]
    for end in range(2, 6):
        redraw_plot(rows[:end], tmp_path / "p.png")
    gc.collect()
    assert not [obj for obj in gc.get_objects() if type(obj) is Figure]
