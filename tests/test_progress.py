"""The trainer's progress line: tokens/s since the last line, on a GPU the peak GPU memory, the samples computed and
the compute utilization; the progress event's DHT lookup time."""
from __future__ import annotations

import logging
import math
import time
from types import SimpleNamespace

import hivemind
import pytest
import torch
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from lean_transformer.swarm.monitoring.events import peer_events, read_events
from lean_transformer.swarm.peers.processes import wait_until
from lean_transformer.swarm.peers.progress import ProgressLine, format_progress, visible_peers
from lean_transformer.swarm.protocol.dht import TimedLookups, visible_maddrs


def optimizer_view(samples: int = 96, peers: int = 2) -> SimpleNamespace:
    """What format_progress reads from a hivemind.Optimizer."""
    swarm = SimpleNamespace(samples_accumulated=samples, eta_next_epoch=math.inf, num_peers=peers)
    tracker = SimpleNamespace(global_progress=swarm, performance_ema=SimpleNamespace(samples_per_second=186.44),
                              _parse_swarm_progress_data=lambda metadata: swarm)
    return SimpleNamespace(local_epoch=2, target_batch_size=256, tracker=tracker,
                           dht_lookups=SimpleNamespace(recent=[0.25]))


def test_line_shows_tokens_per_second_and_peak_gpu_memory():
    line = format_progress(optimizer_view(), 5.36312, tokens_per_second=23861.6, peak_gpu_bytes=3 * 2 ** 30 + 2 ** 29)
    assert line == ("epoch 2 | 96/256 samples (38%, ETA unknown) | loss 5.3631 | 186.4 samples/s, 23862 tokens/s | "
                    "2 peers | peak GPU 3.50 GiB")
    assert format_progress(optimizer_view(peers=1), math.nan).endswith("| loss n/a | 186.4 samples/s | 1 peer")


def test_tokens_per_second_counts_the_tokens_since_the_last_line(caplog, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("lean_transformer.swarm.peers.progress.time.monotonic", lambda: clock[0])
    progress = ProgressLine(every_seconds=5.0, device=torch.device("cpu"))
    progress.count_tokens(4000)
    clock[0] = 104.0
    with caplog.at_level(logging.INFO, logger="lean_transformer.swarm.peers.progress"):
        progress.maybe_report(optimizer_view(), 1.0)  # too early: nothing
        progress.count_tokens(6000)
        clock[0] = 110.0
        progress.maybe_report(optimizer_view(), 1.0)
    assert [record.getMessage().split(" | ")[3] for record in caplog.records] == ["186.4 samples/s, 1000 tokens/s"]
    assert "peak GPU" not in caplog.records[0].getMessage()  # a CPU peer


def test_compute_utilization_is_the_time_inside_computing_over_the_wall_time(caplog, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("lean_transformer.swarm.peers.progress.time.monotonic", lambda: clock[0])
    progress = ProgressLine(every_seconds=5.0)
    for _ in range(3):  # 3 steps: 1.5 s computing, then 0.5 s waiting for the swarm
        progress.count_tokens(128, samples=2)
        with progress.computing():
            clock[0] += 1.5
        clock[0] += 0.5
        progress.count_losses([2.0])
    with pytest.raises(RuntimeError), progress.computing():  # a step that fails still counts its time
        clock[0] += 2.0
        raise RuntimeError
    assert progress.compute_seconds == pytest.approx(6.5) and progress.utilization() == pytest.approx(6.5 / 8)
    progress.count_losses([3.0, 4.0])
    with caplog.at_level(logging.INFO, logger="lean_transformer.swarm.peers.progress"):
        progress.maybe_report(optimizer_view(), 1.0)
    assert caplog.records[0].getMessage().endswith(
        "| 2 peers | 6 samples computed, compute 81.2% (6.50 s of 8.00 s), mean loss 2.6000 over 5 micro-batches")
    assert progress.summary() == ("Compute utilization 81.2%: 6.5 s in forward, backward and inner steps of 8.0 s "
                                  "training (6 samples)")


def test_time_waiting_inside_computing_is_not_compute(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("lean_transformer.swarm.peers.progress.time.monotonic", lambda: clock[0])
    progress = ProgressLine(every_seconds=5.0)
    with progress.computing():  # a DiLoCo step: 1 s inner step, 3 s outer round (a nested wait too), 0.5 s more
        clock[0] += 1.0
        with progress.waiting():
            clock[0] += 2.0
            with progress.waiting():  # nested (a download inside an outer round): taken back once
                clock[0] += 1.0
        with progress.computing():
            clock[0] += 0.5
    with progress.waiting():  # outside computing(): nothing to take back
        clock[0] += 1.0
    assert progress.compute_seconds == pytest.approx(1.5) and progress.utilization() == pytest.approx(1.5 / 5.5)
    assert progress.waiting_seconds == pytest.approx(4.0)  # the nested wait once


def test_compute_cpu_seconds_are_the_training_threads_and_leave_out_waits():
    """The training thread's CPU time inside computing(), less the waits within: 0.1 s of busy compute, not the
    0.3 s busy inside waiting() (each busy loop runs until the thread has used that much CPU)."""
    def busy(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    progress = ProgressLine(every_seconds=5.0)
    with progress.computing():
        busy(0.05)
        with progress.waiting():
            busy(0.3)
        busy(0.05)
    assert 0.1 <= progress.compute_cpu_seconds < 0.2 and progress.compute_seconds >= 0.1
    assert progress.waiting_seconds >= 0.3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peer_shows_its_peak_memory(caplog):
    block = torch.empty(2 ** 28, dtype=torch.uint8, device="cuda")  # 0.25 GiB
    progress = ProgressLine(every_seconds=0.0, device=torch.device("cuda"))
    with caplog.at_level(logging.INFO, logger="lean_transformer.swarm.peers.progress"):
        progress.maybe_report(optimizer_view(), 1.0)
    peak = float(caplog.records[0].getMessage().split("peak GPU ")[1].split()[0])
    assert peak >= 0.25
    del block


def test_visible_peers_are_those_whose_progress_records_the_last_fetch_saw():
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=visible_maddrs(first))
    trackers = [ProgressTracker(dht, "visible", 1000, min_refresh_period=0.1, max_refresh_period=0.2,
                                default_refresh_period=0.2, private_key=RSAPrivateKey(), start=True)
                for dht in (first, second)]  # a key each: the process-wide one would give both records one subkey
    try:
        assert visible_peers(trackers[0]) == []  # no fetch seen yet
        for tracker in trackers:
            tracker.report_local_progress(0, 4)
        both = sorted(str(dht.peer_id) for dht in (first, second))
        wait_until(lambda: visible_peers(trackers[0]) == both, 30, "both peers' records")
    finally:
        for tracker in trackers:
            tracker.shutdown()
        for dht in (first, second):
            dht.shutdown()


def test_timed_lookups_note_how_long_each_dht_lookup_took():
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    lookups = TimedLookups(dht, keep=3)
    try:
        assert dht.store("key", "value", get_dht_time() + 60)
        for count in range(1, 5):
            started = time.perf_counter()
            assert lookups.get("key", latest=True).value == "value"
            took = time.perf_counter() - started
            wait_until(lambda: len(lookups.recent) == min(count, 3), 10, "the lookup's time")  # noted as it answers
            assert 0 < lookups.recent[-1] <= took
        assert lookups.get("key", return_future=True).result(10).value == "value"
        assert lookups.peer_id == dht.peer_id  # the rest is the DHT's own
    finally:
        dht.shutdown()


def test_progress_event_carries_the_last_lookup_time(tmp_path):
    progress = ProgressLine(every_seconds=0.0)
    view = optimizer_view()
    with peer_events(tmp_path / "events.jsonl", "trainer"):
        progress.maybe_report(view, 1.0)
        view.dht_lookups.recent = []
        progress.maybe_report(view, 1.0)
    events = read_events(tmp_path / "events.jsonl", "progress")
    assert [event["dht_lookup_seconds"] for event in events] == [0.25, None]
