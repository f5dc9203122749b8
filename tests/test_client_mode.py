"""Client-mode peers (``--client_mode``: no incoming connections, as behind NAT) in a real swarm on 127.0.0.1.

Two client-mode peers cannot all-reduce with each other: each can only dial out, so every averaging group needs a
full peer that takes their tensors and reduces them. Here the only full peer is an aux peer with
``--assist_in_averaging``, which has no gradients of its own. Every peer runs in its own process; every wait is
bounded.

The module's swarm (~1 minute): two ``run_trainer.py --client_mode`` trainers train the tiny model through the aux
peer until each has averaged gradients in a few 3-peer rounds; then they get SIGTERM. That client-mode averages are
exact (peers with known gradients) is checked in test_aux_swarm.py, next to the same check for full peers.

hivemind derives the swarm's epoch from full trainers only (it ignores the epochs of client-mode peers, and auxiliary
peers publish no progress), so client-mode peers that raced alone through their first epochs keep different epoch
numbers while they average together.
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import pytest

from aux_utils import PeerProcess, start_peer, wait_until
from swarm_utils import assert_shut_down, epoch_reports, group_sizes

from lean_transformer.demo.local_swarm import command_line

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]

ROUNDS_WITH_BOTH = 3  # 3-peer gradient averaging rounds each trainer must log before it is stopped
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def swarm_args(run_id: str, **overrides) -> List[str]:
    """Flags every peer of a run shares: the tiny model, short sequences, a small target batch, 3 s matchmaking,
    parameter averaging at every epoch."""
    options = dict(run_id=run_id, host_maddrs="/ip4/127.0.0.1/tcp/0", target_batch_size=32, per_device_batch_size=4,
                   max_sequence_length=32, matchmaking_time=3, averaging_timeout=10, startup_timeout=60,
                   learning_rate=0.01, warmup_steps=2, total_steps=100,
                   average_state_every=1)  # parameter averaging through the aux peer, every epoch
    options.update(overrides)
    return command_line(options)


def start_assisting_aux_peer(root: Path, run: List[str]) -> PeerProcess:
    return start_peer("aux", ["run_aux_peer.py", *run, "--assist_in_averaging", "--assist_refresh_period", "0.2",
                               "--checkpoint_every_epochs", "0", "--refresh_period", "1",
                               "--metrics_path", str(root / "metrics.jsonl"), "--wandb_project", ""], root, ENV)


@dataclass
class ClientSwarm:
    aux: PeerProcess
    trainers: List[PeerProcess]
    exit_codes: Dict[str, int]
    exit_seconds: Dict[str, float]  # from SIGTERM to exit


@pytest.fixture(scope="module")
def swarm(tmp_path_factory) -> ClientSwarm:
    root = tmp_path_factory.mktemp("client_mode")
    run = swarm_args("client-mode")
    peers: List[PeerProcess] = []
    try:
        aux = start_assisting_aux_peer(root, run)
        peers.append(aux)
        initial_peers = aux.initial_peers()
        trainers = [start_peer(name, ["run_trainer.py", *run, "--client_mode", "--initial_peers", *initial_peers,
                                       "--output_dir", str(root / name), "--backup_every_epochs", "0",
                                       "--progress_every", "2"], root, ENV)
                    for name in ("trainer1", "trainer2")]
        peers += trainers

        def averaged_enough() -> bool:
            return all(group_sizes(trainer).count(3) >= ROUNDS_WITH_BOTH for trainer in trainers)

        wait_until(averaged_enough, timeout=120, what=f"{ROUNDS_WITH_BOTH} 3-peer rounds on each trainer",
                   interval=0.5, peers=trainers)
        for trainer in trainers:
            trainer.process.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        exits = {trainer.name: (trainer.wait(60), time.monotonic() - stopped) for trainer in trainers}
        exits["aux"] = (aux.stop(), time.monotonic() - stopped)
        yield ClientSwarm(aux, trainers, {name: code for name, (code, _) in exits.items()},
                          {name: seconds for name, (_, seconds) in exits.items()})
    finally:
        for peer in peers:
            peer.kill()


def test_trainers_average_gradients_through_the_aux_peer(swarm: ClientSwarm):
    """Each group holds both trainers and the aux peer, the only peer that can accept their connections."""
    for trainer in swarm.trainers:
        sizes = group_sizes(trainer)
        assert max(sizes) == 3, (trainer.name, sizes)  # the fixture waited for ROUNDS_WITH_BOTH 3-peer rounds
        assert 3 in group_sizes(trainer, "parameters"), trainer.name  # state averaging goes through too
    assert 3 in group_sizes(swarm.aux)


def test_trainers_stay_clients(swarm: ClientSwarm):
    """A client-mode trainer prints no --initial_peers line (nobody could dial it); the aux peer does."""
    for trainer in swarm.trainers:
        assert "--initial_peers" not in trainer.stdout, trainer.name
    assert swarm.aux.stdout.startswith("--initial_peers /ip4/127.0.0.1/tcp/")
    for trainer in swarm.trainers:
        (joined,) = trainer.events("joined")
        assert joined["client_mode"] and joined["initial_peers"] == [], trainer.name
    assert swarm.aux.events("joined")[0]["initial_peers"] == swarm.aux.stdout.split()[1:]


def test_epochs_advance_and_loss_falls(swarm: ClientSwarm):
    for trainer in swarm.trainers:
        reports = epoch_reports(trainer)
        epochs = sorted(reports)
        # every 3-peer round ended an epoch, and no epoch was skipped. At least as many epochs as those rounds, not
        # more: trainers that start together average from their first round (CI: [1, 2, 3] after 3 rounds of 3)
        assert len(epochs) >= ROUNDS_WITH_BOTH and epochs == list(range(epochs[0], epochs[-1] + 1)), \
            (trainer.name, epochs, group_sizes(trainer))
        first, last = reports[epochs[0]].mean_loss, reports[epochs[-1]].mean_loss
        assert last < first - 0.3, f"{trainer.name}: loss went from {first} to {last}"


def test_sigterm_stops_every_peer_cleanly(swarm: ClientSwarm):
    assert swarm.exit_codes == {"trainer1": 0, "trainer2": 0, "aux": 0}, swarm.exit_codes
    for trainer in swarm.trainers:
        assert swarm.exit_seconds[trainer.name] < 30, swarm.exit_seconds
        assert "Caught SIGTERM" in trainer.stderr, trainer.name  # told to the person who stopped it
        assert_shut_down(trainer)
    assert_shut_down(swarm.aux)
