"""Trainers whose gradients leave the model during backward (``--offload_gradients true``) and whose weights are in
bfloat16 or float16 (``--model_dtype``), in real hivemind swarms on 127.0.0.1: on the CPU, and on a GPU where there
is one (``make gpu-check``; the trainers take it by default).

- "pair": a trainer with bfloat16 weights and host gradients (as on a GPU) and a plain float32 trainer (as on a CPU),
  2 micro-batches per local step each, average their gradients through hivemind for 3 epochs;
- "fp16": one trainer alone with float16 weights for 3 epochs, its loss scaled and its gradients unscaled on the host;
- two bad combinations stop with one error line naming the flag;
- DiLoCo (``--local_steps``): lone trainers with and without host gradients take the same steps.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from aux_utils import REPO, PeerProcess, start_peer
from swarm_utils import epoch_reports, group_sizes, untrained_loss

pytestmark = pytest.mark.swarm

ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# the loss falls by ~0.7 nats in the first 3 epochs on either peer kind (the tests want 0.2)
PAIR_EPOCHS, FP16_EPOCHS = 3, 3
DILOCO_EPOCHS = 4  # outer rounds of the lone DiLoCo trainers
# a pair's epoch must outlast the 3 s matchmaking window, whatever the machine: each of its micro-batches (8 samples)
# first sleeps PAIR_BATCH_SECONDS (tests/slow_trainer.py), so the pair makes at most ~53 samples/s and an epoch of
# PAIR_TARGET_BATCH lasts >= 4.8 s. Without a bound, trainers ran their 3 epochs alone: one at ~400 samples/s on an
# H100, and both on this CPU in CI (324 samples/s, epochs of 0.8 s, each round "no other peers")
PAIR_TARGET_BATCH, PAIR_BATCH_SECONDS = 256, "0.3"


def trainer_argv(run_id: str, name: str, root, initial_peers: list[str], epochs: int, target_batch: int,
                 *extra: str) -> list[str]:
    return ["run_trainer.py", "--run_id", run_id, "--host_maddrs", "/ip4/127.0.0.1/tcp/0",
            *(["--initial_peers", *initial_peers] if initial_peers else []), "--target_batch_size", str(target_batch),
            "--per_device_batch_size", "8", "--gradient_accumulation_steps", "2", "--max_sequence_length", "64",
            "--learning_rate", "0.02", "--warmup_steps", "1", "--total_steps", "100", "--max_epochs", str(epochs),
            "--matchmaking_time", "3", "--averaging_timeout", "20", "--backup_every_epochs", "0",
            "--progress_every", "2", "--offload_gradients", "true", "--output_dir", str(root / name), *extra]


@pytest.fixture(scope="module")
def peers(tmp_path_factory) -> dict[str, PeerProcess]:
    root = tmp_path_factory.mktemp("host_gradients")
    boot = start_peer("boot", ["-m", "hivemind.hivemind_cli.run_dht", "--host_maddrs", "/ip4/127.0.0.1/tcp/0"],
                       root, ENV, events=False)
    started = {"boot": boot}
    try:
        # the fp16 trainer needs no swarm: it starts while the bootstrap node does
        started["fp16"] = start_peer("fp16", trainer_argv("fp16", "fp16", root, [], FP16_EPOCHS, 64,
                                                           "--model_dtype", "float16"), root, ENV)
        initial = boot.wait_for(r"Full list of visible multiaddresses: (.+)$", 60).group(1).split()
        for name, kind in (("a", ["--model_dtype", "bfloat16"]), ("b", ["--offload_gradients", "false"])):
            argv = trainer_argv("pair", name, root, initial, PAIR_EPOCHS, PAIR_TARGET_BATCH, *kind)
            started[name] = start_peer(name, ["tests/slow_trainer.py", *argv], root,
                                       dict(ENV, SLOW_BATCH_SECONDS=PAIR_BATCH_SECONDS))
        for name in ("a", "b", "fp16"):
            started[name].wait(300)
        return started
    finally:
        for peer in started.values():
            peer.terminate()
        for peer in started.values():
            peer.wait(40)


def epochs(peer: PeerProcess) -> dict[int, tuple[float, int]]:
    """epoch -> (mean loss, skipped micro-batches)"""
    return {epoch: (report.mean_loss, report.skipped) for epoch, report in epoch_reports(peer).items()}


def test_host_gradient_and_plain_trainers_average_together_and_learn(peers):
    """Their averagers speak the same RPC names (hivemind_fixes/rpc_names.py): before, the two never averaged. Each
    trainer ends below the swarm's first epoch loss (:func:`untrained_loss`)."""
    reports = {name: epochs(peers[name]) for name in ("a", "b")}
    for name, by_epoch in reports.items():
        peer = peers[name]
        assert peer.process.returncode == 0, peer.stderr[-3000:]
        assert 2 in group_sizes(peer), peer.stderr[-3000:]
        assert max(by_epoch) == PAIR_EPOCHS and all(skipped == 0 for _, skipped in by_epoch.values()), by_epoch
    untrained = untrained_loss({name: {epoch: loss for epoch, (loss, _) in by_epoch.items()}
                                for name, by_epoch in reports.items()})
    for name, by_epoch in reports.items():
        assert by_epoch[PAIR_EPOCHS][0] < untrained - 0.2, reports


def test_float16_weights_train_with_loss_scaling_on_the_host(peers):
    peer = peers["fp16"]
    assert peer.process.returncode == 0, peer.stderr[-3000:]
    reports = epochs(peer)
    assert sorted(reports) == list(range(1, FP16_EPOCHS + 1)), reports
    assert reports[FP16_EPOCHS][0] < reports[1][0] - 0.2, reports


@pytest.mark.parametrize("extra, message", [
    (["--model_dtype", "bfloat16", "--offload_gradients", "false"], "--model_dtype: bfloat16 weights need"),
    (["--offload_gradients", "true", "--delay_optimizer_step"], "--offload_gradients: needs --offload_optimizer and"),
])
def test_bad_combinations_name_the_flag(tmp_path, extra, message):
    argv = [sys.executable, "run_trainer.py", "--run_id", "bad", "--host_maddrs", "/ip4/127.0.0.1/tcp/0",
            "--output_dir", str(tmp_path), *extra]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **ENV})
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("run_trainer.py: error:")]
    assert len(errors) == 1 and message in errors[0], done.stderr[-2000:]


def test_diloco_local_steps_take_the_same_steps_with_host_gradients(tmp_path, report):
    """--offload_gradients is a memory option in DiLoCo mode too: a lone trainer (float32 weights, 2 micro-batches per
    local LAMB step, 3 local steps per outer round, the same identity hence the same data) ends with the same weights
    whether its gradients are accumulated in .grad or on the host; with bfloat16 weights, or float16 weights and the
    loss scale unscaled on the host (host gradients, float32 master copies), it learns."""
    from safetensors.torch import load_file

    from lean_transformer.swarm.auth import load_identity_key

    identity = tmp_path / "peer.id"
    load_identity_key(identity, create=True)
    runs = {"grad": ["--offload_gradients", "false", "--model_dtype", "float32"],
            "host": ["--offload_gradients", "true", "--model_dtype", "float32"],
            "bf16": ["--offload_gradients", "true", "--model_dtype", "bfloat16"],
            "fp16": ["--offload_gradients", "true", "--model_dtype", "float16"]}
    peers = {name: start_peer(name, trainer_argv(f"diloco_{name}", name, tmp_path, [], DILOCO_EPOCHS, 16,
                                                  "--local_steps", "3", "--identity_path", str(identity), *extra),
                               tmp_path, ENV)
             for name, extra in runs.items()}
    try:
        for peer in peers.values():
            peer.wait(240)
    finally:
        for peer in peers.values():
            peer.kill()
    for name, peer in peers.items():
        assert peer.process.returncode == 0, peer.stderr[-3000:]
        assert [step["group_size"] for step in peer.events("outer_step")] == [1] * DILOCO_EPOCHS, peer.stderr[-3000:]
    weights = {name: load_file(max((tmp_path / name / "backups").glob("epoch-*")) / "model.safetensors")
               for name in ("grad", "host")}
    assert weights["grad"].keys() == weights["host"].keys()
    for key, value in weights["grad"].items():
        torch.testing.assert_close(weights["host"][key], value, rtol=0, atol=0, msg=key)
    losses = {}
    for name in ("bf16", "fp16"):
        by_epoch = epochs(peers[name])
        assert sorted(by_epoch) == list(range(1, DILOCO_EPOCHS + 1)), by_epoch
        assert by_epoch[DILOCO_EPOCHS][0] < by_epoch[1][0] - 0.2, by_epoch
        losses[name] = f"{by_epoch[1][0]:.3f} -> {by_epoch[DILOCO_EPOCHS][0]:.3f}"
    report(f"DiLoCo, lone trainer, {DILOCO_EPOCHS} outer rounds of 3 local steps: weights bit-identical with "
           f"--offload_gradients true and false; loss with bfloat16 weights {losses['bf16']}, float16 {losses['fp16']}")
