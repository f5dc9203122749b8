"""DiLoCo mode (``--local_steps``) end to end: real peers on 127.0.0.1, each its own process, every wait bounded.

One swarm: an aux peer (metrics, a checkpoint every 2 epochs) and two trainers taking local 8-bit LAMB steps, 3 of
them per outer round each (``--target_batch_size`` 8 = 2 trainers x 4 samples), until each has taken 3 outer steps
with the other (the first may train alone until the second joins); then SIGTERM. Then a new swarm is seeded from the
aux peer's checkpoint (``--resume_from``, the aux peer assisting in averaging) and a trainer joins it.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import List

import pytest
import torch
from safetensors.torch import load_file

from aux_utils import PeerProcess, start_peer, stop_all, wait_until
from swarm_utils import assert_readable_logs, epoch_reports, epochs_after_outer_steps, transitions, untrained_loss
from lean_transformer.demo.local_swarm import command_line
from lean_transformer.swarm.storage.checkpoint_dir import CheckpointDir
from lean_transformer.swarm.storage.training_state import TRAINING_STATE_FILE

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

ROUNDS, LOCAL_STEPS = 3, 3  # outer steps the two trainers must take together
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def args(run_id: str, **overrides) -> List[str]:
    options = dict(run_id=run_id, host_maddrs="/ip4/127.0.0.1/tcp/0", target_batch_size=8, per_device_batch_size=4,
                   max_sequence_length=32, matchmaking_time=2, averaging_timeout=15, startup_timeout=60,
                   local_steps=LOCAL_STEPS, learning_rate=0.01, warmup_steps=2)
    options.update(overrides)
    return command_line(options)


def backup(root: Path, name: str, epoch: int) -> Path:
    return root / name / "backups" / f"epoch-{epoch:06d}"


def anchor_of(checkpoint: Path) -> List[torch.Tensor]:
    state = torch.load(checkpoint / TRAINING_STATE_FILE, weights_only=True)
    return state["outer"][:len(state["outer"]) // 2]


@pytest.fixture(scope="module")
def diloco_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("diloco")
    peers: List[PeerProcess] = []
    try:
        aux = start_peer("aux", ["run_aux_peer.py", *args("diloco"), "--checkpoint_dir", str(root / "checkpoints"),
                                  "--checkpoint_every_epochs", "2", "--metrics_path", str(root / "swarm.jsonl"),
                                  "--refresh_period", "0.5", "--wandb_project", ""], root, ENV)
        peers.append(aux)
        initial_peers = aux.initial_peers()
        trainers = [start_peer(name, ["run_trainer.py", *args("diloco"), "--initial_peers", *initial_peers,
                                       "--max_epochs", "1000", "--backup_every_epochs", "1",
                                       "--keep_backups", "100", "--output_dir", str(root / name)], root, ENV)
                    for name in ("t1", "t2")]
        peers += trainers
        # the aux peer checkpoints from a trainer's served state, so the trainers train on until it has one: stopped
        # as soon as they had taken their rounds, they left in the middle of its first download (CI), and it had
        # nobody left to download from
        wait_until(lambda: all(len(epochs_after_outer_steps(trainer, 2)) >= ROUNDS for trainer in trainers)
                   and CheckpointDir(root / "checkpoints", keep_last=3).checkpoints(), timeout=150,
                   what=f"{ROUNDS} outer steps of both trainers together, and an aux checkpoint", peers=trainers)
        assert stop_all(trainers) == [0, 0], [trainer.stderr[-3000:] for trainer in trainers]
        assert aux.stop() == 0, aux.stderr[-3000:]
        yield root, aux, trainers
    finally:
        for peer in peers:
            peer.kill()


def backups_after_outer_steps(root: Path, trainer: PeerProcess) -> dict[int, Path]:
    """By count of outer steps, the backup a trainer took right after an outer step with its partner; not its last
    epoch's (SIGTERM's final backup, taken mid-round, replaces that one). By count, not by epoch label: a trainer
    whose round failed while its partner downloaded the aux peer's state keeps an epoch label one higher than the
    partner's for the same state (CI on 2 xdist workers: t2's epoch 8 held t1's epoch 7, both after 7 outer steps)."""
    last = max(transitions(trainer))
    found = {}
    for epoch in epochs_after_outer_steps(trainer, 2):
        if epoch < last:
            state = torch.load(backup(root, trainer.name, epoch) / TRAINING_STATE_FILE, weights_only=True)
            found[int(state["outer"][-1].item())] = backup(root, trainer.name, epoch)
    return found


def test_trainers_take_outer_steps_together_and_stay_identical(diloco_run):
    root, _, trainers = diloco_run
    together = [backups_after_outer_steps(root, trainer) for trainer in trainers]
    steps = max(together[0].keys() & together[1].keys())
    # right after an outer step both trainers' parameters are the shared anchor: equal
    first, second = (load_file(found[steps] / "model.safetensors") for found in together)
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=1e-4, atol=1e-5, msg=name)
    for a, b in zip(anchor_of(together[0][steps]), anchor_of(together[1][steps])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # honest partners never refuse each other's states (the newcomer's first round often names its donor's state
    # one outer step on, which it once refused as worse on a batch: see SwarmOptimizer._trusted_donors)
    assert [trainer.events("state_rejected") for trainer in trainers] == [[], []]
    for trainer in trainers:  # a download left unscored is from the donor of the one before
        downloads = trainer.events("state_downloaded")
        for before, after in zip(downloads, downloads[1:]):
            assert after["scored"] or after["source"] == before["source"], downloads
        # each says why; only a joining trainer's download precedes its joined event
        joined = trainer.events("joined")[0]["time"]
        assert all(d["reason"] == "join" if d["time"] <= joined else d["reason"] in ("epoch", "outer_state")
                   for d in downloads), downloads


def test_logs_hold_no_traceback_and_no_tracker_chatter(diloco_run):
    _root, aux, trainers = diloco_run
    for peer in (aux, *trainers):
        assert_readable_logs(peer)


def test_loss_falls_over_the_rounds(diloco_run):
    """Each trainer ends below the swarm's first epoch loss (:func:`untrained_loss`; an epoch's mean over a few
    micro-batches is noisy: a late joiner once logged 2.78, 4.11, 3.28, 2.72 in its 4 epochs)."""
    _, _, trainers = diloco_run
    losses = {trainer.name: {epoch: report.mean_loss for epoch, report in epoch_reports(trainer).items()}
              for trainer in trainers}
    untrained = untrained_loss(losses)
    for name, by_epoch in losses.items():
        assert by_epoch[max(by_epoch)] < untrained - 0.1, (name, losses)


def test_aux_peer_logs_metrics_and_checkpoints_the_anchor(diloco_run):
    root, aux, _ = diloco_run
    rows = [json.loads(line) for line in (root / "swarm.jsonl").read_text().splitlines()]
    swarm_rows = [row for row in rows if "alive_peers" in row]  # the others: checkpoints' validation losses
    assert any(row["alive_peers"] == 2 for row in swarm_rows), rows
    assert all(math.isfinite(row["validation_loss"]) for row in rows if "validation_loss" in row), rows
    for epoch, checkpoint in CheckpointDir(root / "checkpoints", keep_last=3).checkpoints():
        state = torch.load(checkpoint / TRAINING_STATE_FILE, weights_only=True)
        assert state["epoch"] == epoch and len(state["outer"]) > 0
        # the checkpoint's weights are the swarm's anchor at that epoch, which a trainer backed up (a state served
        # between a round's outer step and the epoch's advance once paired epoch 8 with epoch 9's anchor)
        model = load_file(checkpoint / "model.safetensors")
        anchor = state["outer"][:len(state["outer"]) // 2]
        trainer_anchors = [anchor_of(backup(root, name, epoch)) for name in ("t1", "t2")
                           if backup(root, name, epoch).exists()]
        assert any(all(torch.equal(a, b) for a, b in zip(anchor, theirs)) for theirs in trainer_anchors), epoch
        assert any(torch.equal(weight.float(), anchor[0]) for weight in model.values()
                   if weight.shape == anchor[0].shape)
        assert epoch in [saved["epoch"] for saved in aux.events("checkpoint")]
    assert {download["reason"] for download in aux.events("state_downloaded")} == {"checkpoint"}


def test_resume_from_the_aux_checkpoint_with_the_aux_peer_assisting(diloco_run, tmp_path: Path):
    root, _, _ = diloco_run
    epoch, checkpoint = CheckpointDir(root / "checkpoints", keep_last=3).checkpoints()[-1]
    peers: List[PeerProcess] = []
    try:
        aux = start_peer("aux-resumed", ["run_aux_peer.py", *args("diloco-resume", target_batch_size=4),
                                          "--resume_from", str(checkpoint),
                                          "--checkpoint_dir", str(tmp_path / "checkpoints"), "--assist_in_averaging",
                                          "--metrics_path", str(tmp_path / "swarm.jsonl"), "--refresh_period", "0.5",
                                          "--wandb_project", ""], tmp_path, ENV)
        peers.append(aux)
        trainer = start_peer("joiner", ["run_trainer.py", *args("diloco-resume", target_batch_size=4),
                                         "--initial_peers", *aux.initial_peers(), "--max_epochs", str(epoch + 1),
                                         "--output_dir", str(tmp_path / "joiner"), "--backup_every_epochs", "1"],
                              tmp_path, ENV)
        peers.append(trainer)
        assert trainer.wait(120) == 0, trainer.stderr[-3000:]
        assert [joined["epoch"] for joined in trainer.events("joined")] == [epoch]
        # it continues the checkpoint's outer steps (the count travels with the anchor)
        steps = int(torch.load(checkpoint / TRAINING_STATE_FILE, weights_only=True)["outer"][-1])
        assert steps + 1 in [step["outer_steps"] for step in trainer.events("outer_step")], trainer.stderr[-3000:]
        assert stop_all([aux]) == [0]
    finally:
        for peer in peers:
            peer.kill()
