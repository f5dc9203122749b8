"""The peer event stream (lean_transformer/swarm/monitoring/events.py): its schema, JSON's limits, appends from
forked processes, incremental reading."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import pytest

import preloaded
from lean_transformer.swarm.monitoring import events
from lean_transformer.swarm.monitoring.events import (SCHEMA_VERSION, EventReader, close_events, emit, open_events,
                                                      peer_events, read_events, set_peer)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def no_stream_left_open():
    yield
    close_events()


def test_an_event_is_one_json_line_with_the_common_fields(tmp_path):
    path = tmp_path / "events.jsonl"
    open_events(path, "trainer")
    emit("joined", epoch=0, client_mode=False, initial_peers=[], from_swarm=False)  # before the DHT: no peer yet
    set_peer("12D3KooWpeer")
    emit("epoch", epoch=3, loss=1.5, samples=64, mini_steps=8, skipped=0, compute_seconds=1.0, wall_seconds=2.0)
    close_events()

    lines = path.read_text().splitlines()
    assert len(lines) == 2
    joined, epoch = map(json.loads, lines)
    assert set(joined) == {"v", "time", "peer", "role", "event", "epoch", "client_mode", "initial_peers",
                           "from_swarm"}
    assert (joined["v"], joined["peer"], joined["role"], joined["event"]) == (SCHEMA_VERSION, None, "trainer", "joined")
    assert epoch == dict(epoch, v=1, peer="12D3KooWpeer", role="trainer", event="epoch", epoch=3, loss=1.5, samples=64,
                         mini_steps=8, skipped=0, compute_seconds=1.0, wall_seconds=2.0)
    assert joined["time"] <= epoch["time"]


def test_non_finite_numbers_become_null_and_other_values_plain_json(tmp_path):
    path = tmp_path / "events.jsonl"
    open_events(path, "aux")
    emit("swarm_epoch", epoch=1, loss=math.nan, samples=0, samples_per_second=math.inf, alive_peers=2)
    emit("settings_mismatch", differences={"lr": (-math.inf, 0.1)})
    emit("checkpoint", epoch=2, path=tmp_path)
    swarm_epoch, mismatch, checkpoint = read_events(path)
    assert swarm_epoch["loss"] is None and swarm_epoch["samples_per_second"] is None
    assert mismatch["differences"] == {"lr": [None, 0.1]}
    assert checkpoint["path"] == str(tmp_path)
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()


def test_unknown_events_are_refused_and_nothing_is_written_without_a_stream(tmp_path):
    emit("epoch", epoch=1)  # no stream open: the library works without events
    path = tmp_path / "events.jsonl"
    open_events(path, "trainer")
    with pytest.raises(ValueError, match="unknown event 'epochs'"):
        emit("epochs", epoch=1)
    assert not path.read_text()


def test_forked_children_append_whole_lines(tmp_path):
    """hivemind's averagers emit from forked processes: lines of several writers must not interleave."""
    path = tmp_path / "events.jsonl"
    open_events(path, "trainer")
    children, per_child, payload = 4, 200, "x" * 3000  # lines well above a pipe's atomic 512 bytes
    pids = []
    for child in range(children):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                for index in range(per_child):
                    emit("round_missed", kind="gradients", epoch=child, reason=f"{index} {payload}")
            finally:
                os._exit(0)
        pids.append(pid)
    for index in range(per_child):
        emit("round_missed", kind="parameters", epoch=-1, reason=f"{index} {payload}")
    for pid in pids:
        assert os.waitpid(pid, 0)[1] == 0

    records = read_events(path)
    assert len(path.read_text().splitlines()) == len(records) == (children + 1) * per_child
    for writer in range(-1, children):
        indices = [int(record["reason"].split()[0]) for record in records if record["epoch"] == writer]
        assert indices == list(range(per_child))  # each writer's lines complete and in its order
    assert all(record["reason"].endswith(payload) for record in records)


def test_the_reader_returns_complete_new_lines_only(tmp_path):
    path = tmp_path / "events.jsonl"
    reader = EventReader(path)
    assert list(reader.new()) == []  # no file yet
    open_events(path, "trainer")
    emit("epoch", epoch=1)
    emit("averaged", kind="gradients", epoch=None, group_size=2, bytes=None)
    assert [record["event"] for record in reader.new()] == ["epoch", "averaged"]
    assert list(reader.new()) == []
    emit("epoch", epoch=2)
    line = json.dumps(dict(v=1, time=0.0, peer=None, role="trainer", event="epoch", epoch=3)) + "\n"
    with path.open("a") as file:  # a line that is still being written
        file.write(line[:10])
        file.flush()
        assert [record["epoch"] for record in reader.new("epoch")] == [2]
        file.write(line[10:])
    assert [record["epoch"] for record in reader.new("epoch")] == [3]
    assert [record["epoch"] for record in read_events(path, "epoch")] == [1, 2, 3]


def test_a_peers_run_ends_with_its_shutdown_event(tmp_path):
    path = tmp_path / "events.jsonl"
    with peer_events(path, "trainer") as ending:
        ending.update(reason="finished", epoch=4)
    with pytest.raises(RuntimeError):
        with peer_events(path, "trainer") as ending:
            ending["epoch"] = 7
            raise RuntimeError("disk on fire")
    assert events._current is None
    clean, failed = read_events(path, "shutdown")
    assert (clean["reason"], clean["epoch"], clean["clean"]) == ("finished", 4, True)
    assert (failed["reason"], failed["epoch"], failed["clean"], failed["error"]) == (
        "error", 7, False, "RuntimeError: disk on fire")


@pytest.mark.swarm
def test_averaging_rounds_are_reported_from_the_averagers_processes(tmp_path):
    """Two gradient averagers on 127.0.0.1 in one process (run as a script: hivemind installs signal handlers) with
    one event stream: a round cancelled alone, then a round of both, then A's rounds as it leaves: one cancelled
    alone, one that had found its group (it serves B with weight 0, as hivemind's shutdown has it). Both are missed
    for the reason ``leaving``, which the benchmarks do not count as a missed round."""
    path = tmp_path / "events.jsonl"
    done = preloaded.run([sys.executable, __file__, str(path)], 120, dict(os.environ, **preloaded.PEER_ENV), cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rounds = [(event["event"], event["kind"], event["epoch"], event.get("group_size"), event.get("reason"))
              for event in read_events(path) if event["event"] in ("round_started", "averaged", "round_missed")]
    assert rounds.count(("round_started", "gradients", None, None, None)) == 6, rounds  # A, A B, A, A B (A leaving)
    assert rounds.count(("round_missed", "gradients", None, None, "cancelled")) == 1, rounds
    assert rounds.count(("averaged", "gradients", None, 2, None)) == 3, rounds  # both, then B with A's weight 0
    assert rounds.count(("round_missed", "gradients", None, None, "leaving")) == 2, rounds
    assert len(rounds) == 12, rounds
    assert {event["peer"] for event in read_events(path)} == {"12D3KooWaverager"}  # the stream's, inherited


def average_twice(path: str) -> None:
    import hivemind
    import torch

    from lean_transformer.swarm.averaging.averagers import GradientAverager

    open_events(path, "trainer")
    set_peer("12D3KooWaverager")
    maddrs = ["/ip4/127.0.0.1/tcp/0"]
    dhts = [hivemind.DHT(start=True, host_maddrs=maddrs)]
    dhts.append(hivemind.DHT(start=True, host_maddrs=maddrs, initial_peers=dhts[0].get_visible_maddrs()))
    params = [torch.nn.Parameter(torch.ones(2)) for _ in dhts]
    peers = [GradientAverager([param], dht=dht, prefix="events_grad_averager", target_group_size=2,
                              min_matchmaking_time=2.0, request_timeout=1.0, allreduce_timeout=10, start=True)
             for param, dht in zip(params, dhts)]
    for peer, param in zip(peers, params):
        param.grad = torch.ones_like(param)
        peer.accumulate_grads_(batch_size=1)
    alone = peers[0].schedule_step(timeout=10)
    time.sleep(0.5)  # it looks for a group
    alone.cancel()
    time.sleep(0.5)
    steps = [peer.step(timeout=10, wait=False) for peer in peers]
    assert [len(step.result(timeout=30)) for step in steps] == [2, 2]
    peers[0].mark_leaving()  # as SwarmOptimizer.shutdown does before it cancels its rounds
    leaving = peers[0].schedule_step(timeout=10)
    time.sleep(0.5)
    leaving.cancel()
    time.sleep(0.5)
    served, other = [peer.schedule_step(timeout=10) for peer in peers]  # e.g. pre-scheduled after its last epoch
    time.sleep(3)  # their group forms (2 s of matchmaking); A leaves before its trigger, as hivemind's shutdown does
    served.weight = 0
    served.allow_allreduce()
    peers[1].accumulate_grads_(batch_size=1)  # B's weight: its samples since the last round
    assert len(peers[1].step(control=other, timeout=10)) == 2
    time.sleep(0.5)  # the averagers write their events right after the results
    for each in (*peers, *dhts):
        each.shutdown()


if __name__ == "__main__":
    average_twice(sys.argv[1])
