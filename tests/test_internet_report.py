"""benchmarks/internet.py's count of a DiLoCo trainer's rounds: a round still in flight when the trainer left is
neither averaged nor missed, also when its epoch had ended (``--outer_overlap``). Event streams shaped like those of
two trainers of a 16-trainer run (times in seconds). Its check of the aux peer's rows against the trainers'
epochs. And its DHT connectivity: who sees whose record, per 10 s bucket. And its split of a peer's CPU between using a
core and waiting for one."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from benchmarks.internet import (Slot, aux_note, aux_rows, aux_tables, dht_buckets, process_kind, process_times,
                                 rounds_cut_by_leaving, sample_usage, usage_by_kind)


def event(time: float, name: str, **fields) -> dict:
    return dict(time=time, event=name, **fields)


def overlapped_trainer(prescheduled_at_the_end: bool) -> list:
    """Three epochs ended (rounds started just before each end), two rounds averaged during the next epoch, the
    third in flight when the window closed; with ``prescheduled_at_the_end`` a fourth round was declared for the
    epoch still running, and it is that one the trainer left."""
    stream = [event(2190.7, "epoch", epoch=1)]
    for started, ended, averaged in ((2208.8, 2225.7, 2305.5), (2307.5, 2317.1, 2378.4), (2379.9, 2380.0, None)):
        stream += [event(started, "round_started", kind="outer"), event(ended, "epoch")]
        if averaged is not None:
            stream.append(event(averaged, "averaged", kind="outer", group_size=8))
    if prescheduled_at_the_end:
        stream.append(event(2405.0, "round_started", kind="outer"))
    stream.append(event(2412.1, "round_missed", kind="outer", reason="leaving"))
    return sorted(stream, key=lambda each: each["time"])


def test_a_round_of_an_ended_epoch_cut_by_leaving_is_not_counted():
    assert rounds_cut_by_leaving(overlapped_trainer(False), "outer") == 1  # the third of 3 ended epochs: 2 of 2


def test_a_round_of_the_running_epoch_cut_by_leaving_was_never_counted():
    assert rounds_cut_by_leaving(overlapped_trainer(True), "outer") == 0  # 2 of 3 ended epochs averaged


def test_other_misses_and_other_kinds_are_counted():
    stream = overlapped_trainer(False)
    other_reason = [dict(each, reason="could not find a group") if each.get("reason") else each for each in stream]
    assert rounds_cut_by_leaving(other_reason, "outer") == 0
    assert rounds_cut_by_leaving(stream, "gradients") == 0


def test_aux_rows_are_checked_against_the_trainers_that_reached_each_epoch(tmp_path):
    trainers = {"t0": [event(1.0, "epoch", epoch=1), event(2.0, "epoch", epoch=2)],
                "t1": [event(1.1, "epoch", epoch=1), event(1.9, "label_taken", epoch=2), event(2.1, "epoch", epoch=2),
                       event(2.2, "epoch", epoch=2)],  # restored from a backup: epoch 2 twice, one trainer
                "t2": [event(2.3, "epoch", epoch=2), event(3.0, "epoch", epoch=3)]}  # joined during epoch 1
    aux = [event(1.5, "swarm_epoch", epoch=1, alive_peers=1), event(2.5, "swarm_epoch", epoch=2, alive_peers=3),
           event(3.5, "swarm_epoch", epoch=3, alive_peers=1), event(3.6, "progress")]
    result = aux_rows(aux, trainers)
    assert result == {"rows": 3, "exact": 2, "off": [[1, 1, 2, []]]}
    assert aux_note(result) == "aux rows counting every trainer that reached their epoch: 2 of 3 (off: epoch 1: 1 of 2)"
    # the aux peer's table written with each row names whom it missed: t1, whose record of epoch 1 was not in yet,
    # and t2, SIGKILLed 0.2 s after reaching epoch 3
    tables = tmp_path / "aux_metrics.jsonl"
    tables.write_text("\n".join(json.dumps(row) for row in [
        {"epoch": 1, "alive_peers": 1}, {"peers": [{"peer_id": "P0", "epoch": 1}, {"peer_id": "P1", "epoch": 0}]},
        {"epoch": 2, "alive_peers": 3}, {"epoch": 3, "alive_peers": 0},
        {"peers": [{"peer_id": "P0", "epoch": 2}, {"peer_id": "P1", "epoch": 2}, {"peer_id": "P2", "epoch": 2}]}]))
    assert aux_tables(tables) == {1: {"P0": 1, "P1": 0}, 2: {"P0": 2, "P1": 2, "P2": 2},
                                  3: {"P0": 2, "P1": 2, "P2": 2}}
    assert aux_tables(tmp_path / "none.jsonl") == {}
    aux[2]["alive_peers"] = 0
    result = aux_rows(aux, trainers, {"t1": ("SIGTERM", 9.0), "t2": ("SIGKILL", 3.2)}, aux_tables(tables),
                      {"t0": "P0", "t1": "P1", "t2": "P2"})
    assert result == {"rows": 3, "exact": 1, "off": [[1, 1, 2, [["t1", "reached it -0.4 s from the row"]]],
                                                     [3, 0, 1, [["t2", "sent SIGKILL 0.2 s after reaching it"]]]]}
    assert aux_note(result) == ("aux rows counting every trainer that reached their epoch: 1 of 3 (off: epoch 1: 1 "
                                "of 2 (t1 reached it -0.4 s from the row), epoch 3: 0 of 1 (t2 sent SIGKILL 0.2 s "
                                "after reaching it))")
    assert aux_note(None) == "no aux rows"


def test_two_trainers_that_see_the_record_of_a_live_third_read_one_dht():
    """The first bucket of a 16-trainer gradient run (seed 0, 2026-12-02): trainer1 saw trainer0 and itself,
    trainer3 only trainer0, and trainer0 had not reported yet: one DHT, not a split. Had trainer0 left before the
    bucket, its record would join nothing (both halves of a split DHT keep it until it expires)."""
    def slot(name: str, stopped=None) -> Slot:
        return Slot(0, name, 50.0, 50.0, 0.05, False, 0.0, started=900.0, stopped=stopped)

    ids = {"trainer0": "Z", "trainer1": "A", "trainer3": "B"}
    events = {"trainer1": [event(1001.0, "progress", visible=["Z", "A"])],
              "trainer3": [event(1003.0, "progress", visible=["Z"]), event(1005.0, "progress", visible=[])],
              "trainer0": [event(1004.0, "progress", visible=[])]}  # no records fetched yet: no view
    live = [slot("trainer0"), slot("trainer1"), slot("trainer3")]
    assert dht_buckets(events, ids, live, 1000.0, 1010.0) == [dict(time=0.0, reporting=2, components=1)]
    left = [slot("trainer0", stopped=990.0), slot("trainer1"), slot("trainer3")]
    assert dht_buckets(events, ids, left, 1000.0, 1010.0) == [dict(time=0.0, reporting=2, components=2)]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity")
def test_a_busy_process_sharing_its_core_waits_for_it_and_is_never_idle():
    busy = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"
    core = min(os.sched_getaffinity(0))  # one this test may use (a container may not offer core 0)
    processes = [subprocess.Popen([sys.executable, "-c", busy]) for _ in range(2)]
    try:
        for process in processes:
            os.sched_setaffinity(process.pid, {core})
        slot = Slot(index=1, name="trainer0", rate_mbit=20, rtt_ms=20, cores=1, nat=False, joins_at=0)
        slot.process = processes[0]
        sample_usage([slot])  # its tree: the first process, the main one
        time.sleep(2)
        sample_usage([slot])
        usage = usage_by_kind(slot)["main"]
        other = process_times(psutil.Process(processes[1].pid))
    finally:
        for process in processes:
            process.kill()
            process.wait()
    assert process_kind(psutil.Process(os.getpid()), psutil.Process(os.getpid())) == "main"
    assert set(usage_by_kind(slot)) == {"main"}
    # the other busy process takes about half of the core (more if the suite's own work shares it): the first waits
    # at least a third of the time, and a busy thread is always running or runnable, never asleep
    assert usage["waited"] > 0.3 and abs(usage["cores"] + usage["waited"] - 1) < 0.15, usage
    assert other[2] > 0.3, other
