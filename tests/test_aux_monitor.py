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
    """A record as an older trainer writes it: its latest epoch only."""

    epoch: int
    samples_per_second: float
    samples_accumulated: int
    loss_sum: float
    mini_steps: int

    def reports(self):
        return [self]


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


def test_collector_counts_a_trainer_two_labels_behind_that_moves_with_the_swarm():
    """Trainer b trains two labels behind a (as a cluster behind a round a kill delayed did in benchmarks/internet.py),
    and the aux peer sees each of a's epochs one refresh before b's: each row waits for b's report, where "some peer
    is two epochs past it" wrote it without b."""
    rng = random.Random(5)
    collector, rows, reports = EpochCollector(), [], {}
    a, b = random_record(rng, 2), random_record(rng, 0)
    for step in range(12):
        if step % 2:
            a = random_record(rng, a.epoch + 1)
        elif step:
            b = random_record(rng, b.epoch + 1)
        for record in (a, b):
            reports.setdefault(record.epoch, {})[id(record)] = record
        rows += collector.update({"a": a, "b": b}, now=float(step))
    assert [row.epoch for row in rows] == [0, 1, 2, 3, 4, 5]
    assert [row.alive_peers for row in rows] == [1, 1, 2, 2, 2, 2]
    assert rows == [aggregate(row.epoch, list(reports[row.epoch].values()), now=row.time) for row in rows]


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


def test_wandb_offline_run_holds_the_rows(tmp_path: Path, wandb_offline: None):
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


# ---------------------------------------------------------------- records with histories, the table of contributors

def peer_id(name: str) -> str:
    return f"12D3KooW{name}{name}{name}"  # base58, like a libp2p ID


def simulate_swarm(epochs: int = 40, refresh_every: int = 5, strip_history: bool = False):
    """Three trainers publish a record per epoch through MetricsReporter: ``a`` trains epochs 1-40, ``b`` 1-30 (then
    leaves; its last record stays), ``c`` joins at 10; ``b`` is always one epoch behind when the aux peer looks. The
    aux peer reads the records every ``refresh_every`` epochs. Returns what each trainer reported per epoch and the
    rows the collector released."""
    from lean_transformer.swarm.peers.reporting import MetricsReporter

    rng = random.Random(11)
    spans = {"a": (1, epochs), "b": (1, 30), "c": (10, epochs)}
    reporters = {name: MetricsReporter(peer_id(name), client_mode=name == "c") for name in spans}
    latest, reported = {}, {}
    collector, rows = EpochCollector(), []
    for epoch in range(1, epochs + 1):
        visible_b = latest.get("b")
        for name, (first, last) in spans.items():
            if first <= epoch <= last:
                latest[name] = reporters[name].record(epoch, rng.uniform(10, 100), samples=rng.randint(1, 64),
                                                      loss_sum=rng.uniform(1, 40), mini_steps=rng.randint(1, 16))
                reported.setdefault(epoch, {})[name] = latest[name].reports()[-1]
        if epoch % refresh_every == 0:
            visible = {**latest, "b": visible_b} if visible_b is not None else dict(latest)
            if strip_history:
                visible = {name: record.model_copy(update={"history": ()}) for name, record in visible.items()}
            rows += collector.update(visible, now=float(epoch))
    for _ in range(2):
        rows += collector.update(latest, now=float(epochs + 1))
    return reported, rows


def test_collector_counts_every_trainer_when_epochs_are_shorter_than_the_refresh():
    """Each row aggregates exactly the trainers that trained in its epoch, every epoch gets a row (the refresh comes
    every 5 epochs, within the records' 8-epoch history), and a trainer that left holds nothing back."""
    reported, rows = simulate_swarm()
    assert [row.epoch for row in rows] == list(range(1, 39))  # 39, 40: c and a may still be joined by b's report
    for row in rows:
        reports = list(reported[row.epoch].values())
        expected = aggregate(row.epoch, reports, now=row.time)
        assert row.to_dict() == pytest.approx(expected.to_dict(), rel=1e-12)  # floats summed in another order
        assert row.alive_peers == (3 if 10 <= row.epoch <= 30 else 2)

    # the same swarm with records that carry no history (older trainers): most epochs get no row or too few peers
    _, old_rows = simulate_swarm(strip_history=True)
    exact = [row for row in old_rows if row.alive_peers == len(reported[row.epoch])]
    assert len(exact) < len(rows) / 2


def test_collector_waits_for_the_trainers_that_joined_before_releasing_an_epoch():
    """Trainers publish a record as they join (``MetricsReporter.joined``): the aux peer knows them before their first
    epoch, and releases the swarm's first epoch once all three reached it. Without those records, the first trainer to
    reach it was all the aux peer knew of, and the row counted 1 of 3 (benchmarks/internet.py: 1-2 of 16). A joining
    record adds no row and counts in none: a newcomer that joins at epoch 5 trained in no earlier epoch."""
    from lean_transformer.swarm.peers.reporting import MetricsReporter
    from lean_transformer.swarm.protocol.metrics import LocalMetrics

    reporters = {name: MetricsReporter(peer_id(name), client_mode=False) for name in "abc"}
    joined = {name: reporter.joined(0) for name, reporter in reporters.items()}
    for record in joined.values():
        assert LocalMetrics.model_validate(record.model_dump()).reports() == []  # valid as the DHT checks it
    first = {name: reporter.record(1, 10.0, samples=8, loss_sum=4.0, mini_steps=2)
             for name, reporter in reporters.items()}
    assert EpochCollector().update({"a": first["a"]}, now=1.0) == [aggregate(1, first["a"].reports(), now=1.0)]

    collector = EpochCollector()
    assert collector.update(joined, now=0.5) == []  # no row of their own
    assert collector.update({**joined, "a": first["a"]}, now=1.0) == []  # b and c have not reached epoch 1
    assert collector.update({**joined, "a": first["a"], "b": first["b"]}, now=1.5) == []
    released = collector.update(first, now=2.0)
    assert released == [aggregate(1, [record.reports()[-1] for record in first.values()], now=2.0)]
    assert released[0].alive_peers == 3
    newcomer = MetricsReporter(peer_id("d"), client_mode=False)
    late = {name: reporter.record(epoch, 10.0, samples=8, loss_sum=4.0, mini_steps=2)
            for name, reporter in reporters.items() for epoch in range(2, 6)}
    rows = collector.update({**late, "d": newcomer.joined(5)}, now=3.0)
    assert [(row.epoch, row.alive_peers) for row in rows] == [(2, 3), (3, 3), (4, 3), (5, 3)]
    sixth = {name: reporter.record(6, 10.0, samples=8, loss_sum=4.0, mini_steps=2)
             for name, reporter in {**reporters, "d": newcomer}.items()}
    assert [(row.epoch, row.alive_peers) for row in collector.update(sixth, now=4.0)] == [(6, 4)]


def test_reporter_keeps_a_bounded_history_and_counts_averaged_epochs(tmp_path: Path):
    from lean_transformer.swarm.monitoring.events import EventLog
    from lean_transformer.swarm.peers.reporting import MetricsReporter
    from lean_transformer.swarm.protocol.metrics import HISTORY_LENGTH, LocalMetrics

    events_path = tmp_path / "events.jsonl"
    log = EventLog(events_path, "trainer")
    log.emit("averaged", kind="gradients", epoch=None, group_size=2, bytes=None)  # an earlier run's: not counted
    reporter = MetricsReporter(peer_id("x"), client_mode=False, events_path=events_path)
    rounds = {1: [("gradients", 3)], 2: [("gradients", 1)], 3: [("parameters", 2)], 4: [], 5: [("outer", 2)],
              6: [("gradients", 2), ("gradients", 2)],  # one of epoch 5 landed late
              7: [("gradients", 2)] * 10}  # never more averaged rounds than epochs
    for epoch in range(1, 13):
        for kind, size in rounds.get(epoch, []):
            log.emit("averaged", kind=kind, epoch=None, group_size=size, bytes=None)
        record = reporter.record(epoch, 5.0, samples=epoch, loss_sum=1.0, mini_steps=1)
        LocalMetrics.model_validate(record.model_dump())  # valid as the DHT would check it
        assert [report.epoch for report in record.reports()] == list(range(max(1, epoch - HISTORY_LENGTH), epoch + 1))
        assert [report.samples_accumulated for report in record.reports()] == [r.epoch for r in record.reports()]
        assert (record.peer_id, record.client_mode, record.rounds_attempted) == (peer_id("x"), False, epoch)
        assert record.rounds_averaged == {1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 6: 4}.get(epoch, 7)
    # a backup of an earlier epoch was restored: the history drops the epochs that are now ahead of the record
    record = reporter.record(9, 5.0, samples=1, loss_sum=1.0, mini_steps=1)
    assert [report.epoch for report in record.reports()] == [5, 6, 7, 8, 9]
    LocalMetrics.model_validate(record.model_dump())
    assert MetricsReporter(peer_id("y"), client_mode=True).record(1, 1.0, 1, 1.0, 1).rounds_attempted is None
    log.close()


def test_peer_table_counts_each_epoch_once_and_survives_a_restart(tmp_path: Path):
    from lean_transformer.swarm.monitoring.peer_table import PeerTable, key_id, summary
    from lean_transformer.swarm.peers.reporting import MetricsReporter

    reporters = {name: MetricsReporter(peer_id(name), client_mode=name == "c") for name in "ab"}
    samples = {"a": 0, "b": 0}
    table = PeerTable()
    records = {}
    for epoch in range(1, 19):
        for name, reporter in reporters.items():
            if name == "b" and epoch > 12:
                continue  # b left after epoch 12
            records[name.encode()] = reporter.record(epoch, 10.0 * epoch, samples=epoch, loss_sum=1.0, mini_steps=1)
            samples[name] += epoch
        if epoch % 3 == 0:  # overlapping histories: the same epochs are seen up to 3 times
            table.update({key: record for key, record in records.items() if key != b"b" or epoch <= 12},
                         now=float(epoch))
    rows = {row.peer_id: row for row in table.rows()}
    a, b = rows[peer_id("a")], rows[peer_id("b")]
    assert (a.samples, a.epoch, a.samples_per_second, a.last_seen, a.alive) == (samples["a"], 18, 180.0, 18.0, True)
    assert (b.samples, b.epoch, b.last_seen, b.alive) == (samples["b"], 12, 12.0, False)
    assert a.key == key_id(b"a") and a.client_mode is False and a.excluded is False
    assert table.rows()[0] is a or table.rows()[0] == a  # most samples first
    assert summary(table.rows()) == "1 trainer (0 client mode)"  # no event stream: rounds unknown

    history = RunHistory(tmp_path / "h.jsonl")
    history.append(aggregate(1, [Record(1, 1.0, 1, 1.0, 1)], now=1.0))
    history.append(table.snapshot(now=21.0))
    assert [row.epoch for row in read_rows(tmp_path / "h.jsonl")] == [1]  # the table is a row kind of its own
    reopened = RunHistory(tmp_path / "h.jsonl")
    assert reopened.peers == table.snapshot(now=21.0) and len(reopened.rows) == 1
    restarted = PeerTable()
    restarted.restore(reopened.peers)
    records[b"a"] = reporters["a"].record(19, 1.0, samples=19, loss_sum=1.0, mini_steps=1)
    restarted.update({b"a": records[b"a"]}, now=22.0)
    assert {row.peer_id: row.samples for row in restarted.rows()} == {peer_id("a"): samples["a"] + 19,
                                                                      peer_id("b"): samples["b"]}
    small = PeerTable(max_peers=1)
    small.update({b"a": records[b"a"]}, now=1.0)
    small.update({b"b": records[b"b"]}, now=2.0)
    assert [row.key for row in small.rows()] == [key_id(b"b")]


def test_status_line_summarizes_the_table():
    from lean_transformer.swarm.monitoring.peer_table import PeerRow, summary

    def row(name: str, client: bool, attempted: int, averaged: int, alive: bool = True) -> PeerRow:
        return PeerRow(key=name, peer_id=peer_id(name), client_mode=client, epoch=3, samples_per_second=1.0,
                       samples=10, last_seen=0.0, rounds_attempted=attempted, rounds_averaged=averaged, alive=alive)

    rows = [row("a", False, 10, 10), row("b", True, 10, 5), row("c", True, 4, 0, alive=False)]
    lowest = f"lowest 50%: ...{peer_id('b')[-8:]}"
    assert summary(rows) == f"2 trainers (1 client mode), averaged in 75% of rounds ({lowest})"
    assert summary([]) == "no trainer reporting"
