"""A trainer 10x slower than the rest keeps averaging and downloads the swarm's state only when it joins (issue 23
item 4), in a real loopback swarm: a bootstrap DHT, two trainers and a slow one, gradient-averaging mode.

Every trainer runs through tests/slow_trainer.py, which sleeps before each micro-batch: the two "fast" ones 0.5 s,
the slow one 5 s, so the slow one computes ~1/10 of their samples whatever else runs on the box. Its micro-batch is
5 matchmaking windows long, more than twice what its groupmates wait for a member to start its all-reduce: before
SwarmOptimizer joined rounds mid micro-batch (EarlyJoin), the slow trainer was in 4 of the swarm's 6 rounds after its
first, its groupmates applied partial averages ("Averaging: received 35.1% results"), and it downloaded the state
twice; after, it was in all 8, and downloaded nothing after joining.

Seen on CI earlier, with a 1 s micro-batch and a 2 s window: the slow trainer began matchmaking only after the
micro-batch that followed its epoch, too late on a loaded box (now the EarlyJoin thread pre-schedules); and it
stepped in the same rounds as the others under an epoch label one lower, which hivemind's once-per-epoch check took
for "out of sync" (SwarmOptimizer now takes its group's label).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from aux_utils import PeerProcess, start_peer, stop_all
from swarm_utils import transitions

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]

EPOCHS = 8
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def trainer(name: str, root: Path, initial: list[str], delay: float) -> PeerProcess:
    # epochs of ~6 s (96 samples at ~16 samples/s): about one slow micro-batch each, 5x the matchmaking window
    argv = ["tests/slow_trainer.py", "run_trainer.py", "--run_id", "slow", "--host_maddrs", "/ip4/127.0.0.1/tcp/0",
            "--initial_peers", *initial, "--target_batch_size", "96", "--per_device_batch_size", "4",
            "--max_sequence_length", "32", "--max_epochs", str(EPOCHS), "--matchmaking_time", "1",
            "--averaging_timeout", "10", "--progress_every", "5", "--output_dir", str(root / name)]
    return start_peer(name, argv, root, dict(ENV, SLOW_BATCH_SECONDS=str(delay)))


def samples_per_second(peer: PeerProcess) -> float:
    last = peer.events("progress")[-1]
    return last["samples"] / last["wall_seconds"]


def gradient_rounds(peer: PeerProcess) -> list[dict]:
    """The peer's gradient rounds as they ended: averaged (with its group size) or missed."""
    return [event for event in peer.events()
            if event["event"] in ("averaged", "round_missed") and event.get("kind") == "gradients"]


def rounds_by_time(peers: list[PeerProcess], start: float) -> str:
    """Each peer's gradient rounds, one line each: epoch:group size (- if missed)@seconds since ``start``."""
    return "\n".join(f"{peer.name}: " + " ".join(
        f"{event['epoch']}:{event.get('group_size') or '-'}@{event['time'] - start:.1f}"
        for event in gradient_rounds(peer)) for peer in peers)


def test_a_slow_trainer_averages_every_epoch_and_downloads_only_at_join(tmp_path: Path):
    boot = start_peer("boot", ["-m", "hivemind.hivemind_cli.run_dht", "--host_maddrs", "/ip4/127.0.0.1/tcp/0"],
                      tmp_path, ENV, events=False)
    peers = [boot]
    try:
        initial = boot.wait_for(r"Full list of visible multiaddresses: (.+)$", 60).group(1).split()
        fast = [trainer(f"fast{i}", tmp_path, initial, 0.5) for i in (1, 2)]
        slow = trainer("slow", tmp_path, initial, 5.0)
        peers += [*fast, slow]
        assert [peer.wait(150) for peer in (*fast, slow)] == [0, 0, 0], slow.log_tail()
    finally:
        stop_all(peers)

    assert samples_per_second(slow) < min(map(samples_per_second, fast)) / 5, "the slow trainer is not slow"
    epochs = transitions(slow)
    assert epochs and epochs[-1] == EPOCHS
    # from its first round on, it was in the group of (nearly) every round the swarm held, as the fast trainers saw
    # their groups: with weight 0 when the epoch ended before it finished a micro-batch. Counted in the fast trainers'
    # rounds, not in the slow one's epochs: taking its group's label (SwarmOptimizer) is an epoch without a round
    averaged = [event for event in gradient_rounds(slow) if event["event"] == "averaged"]
    first = min(event["time"] for event in averaged if event["group_size"] >= 2)
    swarm_rounds = [event for event in gradient_rounds(fast[0])
                    if event["event"] == "averaged" and event["time"] >= first - 0.5]
    with_all = sum(event["group_size"] == 3 for event in swarm_rounds)
    assert len(swarm_rounds) >= EPOCHS // 2 and with_all >= 0.8 * len(swarm_rounds), \
        rounds_by_time([*fast, slow], first)
    # its micro-batches outlast the others' patience, so it joined rounds before finishing them (EarlyJoin), and the
    # samples of a micro-batch it carried over went into a later round
    joined = slow.events("joined_early")
    assert joined and any(event["samples"] > 0 for event in joined), rounds_by_time([*fast, slow], first)
    # no download once it has averaged: before that, joining at an epoch's end can truly miss the swarm's step (seen:
    # downloaded epoch 0's state at join, the swarm stepped before its first slow epoch ended, so epoch 1's too)
    events = slow.events()
    first_round = next(i for i, event in enumerate(events)
                       if event["event"] == "averaged" and (event.get("group_size") or 0) >= 2)
    assert not [event for event in events[first_round:] if event["event"] == "state_downloaded"], slow.log_tail()
