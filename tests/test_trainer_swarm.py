"""Trainer peers in a real hivemind swarm on 127.0.0.1, each in its own process.

One scenario (run once for the module, ~2 minutes) feeds the tests below:
  - a bootstrap DHT node (hivemind's own CLI), so that every trainer starts at the same moment;
  - "pair": trainers P1 and P2 (per-device batch b = 8) train the tiny LeanGPT for 10 epochs of 256 samples, backing
    up every epoch and averaging parameters every 2 epochs;
  - "solo": trainer P0 alone with batch 2b = 16, the same schedule and initialization;
  - "resume": once P1 has backed up epoch 2 (or a later one), trainer P4 starts a fresh run with --resume_from that
    backup (newer than its empty swarm); once it trains, a late trainer P3 joins it with --resume_from P1's oldest
    backup (older than the swarm), averages gradients with it, and both are stopped with SIGTERM. (P1, P2, P4 and P3
    start with P0 and wait, imported, for their moment: tests/start_when.py; the pair's is once all four have
    imported.)
Then five peers train alone: two diverge on purpose (learning rate 1e30), one with a backup to restore and one
without, and three train with mixed precision (fp16; MLM with bf16; fp16 with per-block gradient scales).
"""
from __future__ import annotations

import json
import math
import re
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aux_utils import PeerProcess, start_peer
from swarm_utils import assert_shut_down, epoch_reports, group_sizes, untrained_loss

# alone (tests/conftest.py): beside another file's peers on 2 cores, P2's last parameter round once failed after P1's
# had ended with both in its group (hivemind's all-reduce has no commit step): the pair's final states differed by 2e-4
pytestmark = [pytest.mark.swarm, pytest.mark.alone]

EPOCHS, TARGET_BATCH, BATCH = 10, 256, 8
MIXED_EPOCHS = 3  # the mixed-precision lone peers' loss falls by 0.4-0.75 in 3 epochs (the test wants 0.2)
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def trainer_argv(run_id: str, output_dir: Path, initial_peers: list[str], batch_size: int, max_epochs: int,
                 *extra: str) -> list[str]:
    return ["run_trainer.py", "--run_id", run_id, "--host_maddrs", "/ip4/127.0.0.1/tcp/0",
            *(["--initial_peers", *initial_peers] if initial_peers else []), "--target_batch_size", str(TARGET_BATCH),
            "--per_device_batch_size", str(batch_size), "--max_sequence_length", "64", "--learning_rate", "0.01",
            "--warmup_steps", "3", "--total_steps", "100", "--max_epochs", str(max_epochs),
            "--matchmaking_time", "3", "--averaging_timeout", "20", "--average_state_every", "2",
            "--backup_every_epochs", "1", "--keep_backups", "100", "--progress_every", "2",
            "--output_dir", str(output_dir), *extra]


def backup(output_dir: Path, epoch: int) -> Path:
    return output_dir / "backups" / f"epoch-{epoch:06d}"


def first_backup(output_dir: Path) -> Path:
    """The oldest backup: epoch 1's, unless the peer caught up past it with a download (seen on a fast GPU box)."""
    return min((output_dir / "backups").glob("epoch-*"))


def epoch_losses(peer: PeerProcess) -> dict[int, float]:
    return {epoch: report.mean_loss for epoch, report in epoch_reports(peer).items()}


@dataclass
class Scenario:
    root: Path
    pair: tuple[PeerProcess, PeerProcess]
    solo: PeerProcess
    resumed: PeerProcess
    late: PeerProcess
    resumed_from: int  # the epoch of P1's backup that P4 resumed from: 2, or later if P1 downloaded past 2
    late_started_at_epoch: int
    exit_codes: dict[str, int]
    exit_seconds: dict[str, float]  # from SIGTERM to exit


def stop_together(*peers: PeerProcess) -> dict[str, tuple[int, float]]:
    """SIGTERM the peers at once; their exit codes and the seconds each took to exit."""
    for peer in peers:
        peer.process.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    return {peer.name: (peer.wait(60), time.monotonic() - stopped) for peer in peers}


def go(go_file: Path, *args: object) -> None:
    """Lets a peer waiting in tests/start_when.py start, with ``args`` added to its command line."""
    partial = go_file.with_suffix(".partial")
    partial.write_text("".join(f"{arg}\n" for arg in args))
    partial.rename(go_file)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Scenario:
    root = tmp_path_factory.mktemp("swarm")
    boot = start_peer("boot", ["-m", "hivemind.hivemind_cli.run_dht", "--host_maddrs", "/ip4/127.0.0.1/tcp/0"],
                       root, ENV, events=False)
    peers = [boot]
    try:
        initial = boot.wait_for(r"Full list of visible multiaddresses: (.+)$", 60).group(1).split()
        # the pair starts together once both have imported: with their imports racing p0's, p3's and p4's on 2
        # cores, P2 once began training 2.7 s before P1, stepped alone twice (P1's progress not yet in the DHT) and
        # left P1 to download its way past epoch 2 (CI)
        p1, p2 = (start_peer(name, ["tests/start_when.py", str(root / f"{name}.go"), "300",
                                    *trainer_argv("pair", root / name, initial, BATCH, EPOCHS)], root, ENV)
                  for name in ("p1", "p2"))
        p0 = start_peer("p0", trainer_argv("solo", root / "p0", initial, 2 * BATCH, EPOCHS), root, ENV)
        peers += [p1, p2, p0]
        # the resuming peers start now and wait (imported) for their moment, their --resume_from in their go file
        slower = ["--target_batch_size", str(4 * TARGET_BATCH)]  # so that the late peer catches up in one download
        resumed, late = (start_peer(name, ["tests/start_when.py", str(root / f"{name}.go"), "300",
                                            *trainer_argv("resume", root / name, initial, BATCH, 1000, *slower)],
                                     root, ENV) for name in ("p4", "p3"))
        peers += [resumed, late]
        for peer in (p1, p2, resumed, late):
            peer.wait_for(r"start_when\.py: imported", 120)
        for name in ("p1", "p2"):
            go(root / f"{name}.go")

        # epoch 2's backup, or the first after it: the pair can still step alone for their first epochs (each sees
        # only itself until the other's first record arrives; the target fills in ~0.7 s), and P1 then downloads
        # past epoch 2 (CI: P2 stepped alone to 2 while P1 stepped to 1, and P1 downloaded epoch 3)
        resumed_from = int(p1.wait_for(r"Backed up epoch ([2-9]|\d{2,})\b", 150).group(1))
        go(root / "p4.go", "--resume_from", backup(root / "p1", resumed_from))
        resumed.wait_for_event("epoch", lambda event: event["epoch"] == resumed_from + 1, 150)
        late_started_at_epoch = max(epoch_losses(resumed))
        go(root / "p3.go", "--resume_from", first_backup(root / "p1"))
        late.wait_for_event("joined", timeout=150)
        # it trains with the swarm, not just alongside
        late.wait_for_event("averaged", lambda event: event["kind"] == "gradients" and event["group_size"] == 2, 120)

        exits = stop_together(late, resumed)
        exits.update({peer.name: (peer.wait(240), math.nan) for peer in (p1, p2, p0)})
        return Scenario(root, (p1, p2), p0, resumed, late, resumed_from, late_started_at_epoch,
                        {name: code for name, (code, _) in exits.items()},
                        {name: seconds for name, (_, seconds) in exits.items()})
    finally:
        for peer in peers:
            peer.terminate()
        for peer in peers:
            peer.wait(40)


def test_peers_finish_cleanly(scenario: Scenario):
    assert scenario.exit_codes == {"p0": 0, "p1": 0, "p2": 0, "p3": 0, "p4": 0}
    for peer in (*scenario.pair, scenario.solo):
        assert_shut_down(peer, "finished")
    for peer in (scenario.late, scenario.resumed):
        assert_shut_down(peer, "signal")


def test_pair_averages_with_two_peers_and_loss_falls(scenario: Scenario):
    untrained = untrained_loss({peer.name: epoch_losses(peer) for peer in scenario.pair})
    for peer in scenario.pair:
        assert 2 in group_sizes(peer) and 2 in group_sizes(peer, "parameters"), peer.name
        last = epoch_losses(peer)[EPOCHS]
        assert last < untrained - 0.5, f"{peer.name}: loss went from {untrained} (untrained) to {last}"


def test_pair_parameters_agree_after_state_averaging(scenario: Scenario):
    """A peer that reaches --max_epochs saves its final state after the last state-averaging round (epoch 10)."""
    p1, p2 = (load_file(backup(scenario.root / peer.name, EPOCHS) / "model.safetensors") for peer in scenario.pair)
    assert p1.keys() == p2.keys()
    differ = {name: (p1[name] - p2[name]).abs().max().item() for name in p1
              if not torch.allclose(p1[name], p2[name], rtol=1e-4, atol=1e-5)}
    assert not differ, f"{len(differ)} of {len(p1)} tensors differ (largest difference {max(differ.values()):.3g}, " \
                       f"{next(iter(differ))}); the pair's last events:\n" + "\n".join(
                           f"{peer.name}: {last_events(peer)}" for peer in scenario.pair)


def last_events(peer: PeerProcess, count: int = 25) -> str:
    """A peer's last events but its progress lines, one per line, for a failure message."""
    events = [event for event in peer.events() if event["event"] != "progress"][-count:]
    return "\n  ".join(json.dumps({key: value for key, value in event.items() if key not in ("v", "peer", "role")})
                        for event in events)


def test_averaging_matches_one_peer_with_twice_the_batch(scenario: Scenario):
    """Two peers with batch b and one peer with batch 2b reach the same held-out loss after the same epochs."""
    from lean_transformer import LeanGPTForCausalLM
    from tasks.causal_lm import PackedBatcher
    from lean_transformer.data.markov import MarkovCorpus
    from tasks.tokenizer import ByteTokenizer

    batcher = PackedBatcher(MarkovCorpus.generate(0).documents(seed=123_456), ByteTokenizer())
    held_out = [batcher.next_batch(16, 64) for _ in range(4)]

    def held_out_loss(checkpoint: Path) -> float:
        model = LeanGPTForCausalLM.from_pretrained(checkpoint).eval()
        with torch.no_grad():
            return sum(model(**batch).loss.item() for batch in held_out) / len(held_out)

    initial = held_out_loss(first_backup(scenario.root / "p1"))
    pair = held_out_loss(backup(scenario.root / "p1", EPOCHS))
    solo = held_out_loss(backup(scenario.root / "p0", EPOCHS))
    assert pair < initial - 0.5 and solo < initial - 0.5, (initial, pair, solo)
    assert abs(pair - solo) / solo < 0.05, f"2 peers x {BATCH}: {pair:.4f}, 1 peer x {2 * BATCH}: {solo:.4f} " \
                                           f"(initial {initial:.4f})"


def test_late_peer_loads_the_swarm_state_and_continues(scenario: Scenario):
    log = scenario.late.stderr
    oldest = first_backup(scenario.root / "p1").name
    assert re.search(rf"Loaded local checkpoint .*{oldest} \(epoch {int(oldest[6:])}\)", log)
    (joined,) = scenario.late.events("joined")
    assert joined["from_swarm"], log[-3000:]
    # the swarm's newer state won over the local one
    assert joined["epoch"] >= scenario.late_started_at_epoch > scenario.resumed_from, log[-3000:]
    assert max(epoch_losses(scenario.late)) > joined["epoch"]
    assert 2 in group_sizes(scenario.late)
    assert "Downloading parameters from peer" not in log  # hivemind's gradient averager downloads no gradients


def test_sigterm_exits_cleanly_within_30_seconds(scenario: Scenario):
    for peer in (scenario.late, scenario.resumed):
        assert scenario.exit_codes[peer.name] == 0 and scenario.exit_seconds[peer.name] < 30, peer.name
        assert "Caught SIGTERM" in peer.stderr, peer.name  # told to the person who stopped it
        assert_shut_down(peer, "signal")


def test_resume_keeps_a_local_checkpoint_newer_than_the_swarm(scenario: Scenario):
    log = scenario.resumed.stderr
    epoch = scenario.resumed_from
    assert re.search(rf"Loaded local checkpoint .*epoch-{epoch:06d} \(epoch {epoch}\)", log)
    assert [joined["epoch"] for joined in scenario.resumed.events("joined")] == [epoch]
    assert min(epoch_losses(scenario.resumed)) == epoch + 1


@pytest.fixture(scope="module")
def lone_peers(scenario: Scenario) -> dict[str, PeerProcess]:
    """Peers in swarms of their own, all at once: two whose learning rate (1e30) breaks the parameters at the first
    step (one with a backup of the solo run's last epoch in its output directory, one without backups), and two
    that train with mixed precision (one of them on the MLM task with gradient accumulation, sequence-length warmup
    and gradient checkpointing), and one with fp16 and per-block gradient scales, accumulating 2 micro-batches per
    local step in the model's .grad buffers (--reuse_grad_buffers)."""
    root = scenario.root / "lone"
    shutil.copytree(backup(scenario.root / "p0", EPOCHS), root / "restores" / "backups" / f"epoch-{EPOCHS:06d}")
    fp32_residual = root / "fp32_residual.json"
    fp32_residual.write_text(json.dumps({**json.loads(Path("tasks/configs/tiny_gpt.json").read_text()),
                                         "fp32_residual": True}))
    diverge = ["--learning_rate", "1e30"]
    healthy = ["--learning_rate", "0.02", "--warmup_steps", "1", "--target_batch_size", "64"]
    cases = {"restores": (EPOCHS + 2, diverge),
             "no_backup": (EPOCHS + 2, [*diverge, "--backup_every_epochs", "0"]),
             "fp16": (MIXED_EPOCHS, [*healthy, "--fp16"]),
             "fp16_blocks": (MIXED_EPOCHS, [*healthy, "--fp16", "--block_grad_scaling", "--reuse_grad_buffers",
                                 "--gradient_accumulation_steps", "2", "--model_config_path", str(fp32_residual)]),
             "mlm_bf16": (MIXED_EPOCHS, [*healthy, "--bf16", "--task", "mlm", "--gradient_accumulation_steps", "2",
                              "--initial_sequence_length", "32", "--sequence_length_warmup_steps", "2",
                              "--gradient_checkpointing", "true"])}
    peers = {name: start_peer(name, trainer_argv(name, root / name, [], 2 * BATCH, epochs, *extra), root, ENV)
             for name, (epochs, extra) in cases.items()}
    for peer in peers.values():
        peer.wait(240)
    return peers


def test_broken_parameters_are_restored_from_the_latest_backup(lone_peers):
    peer = lone_peers["restores"]
    assert peer.process.returncode == 0, peer.stderr[-2000:]
    log = peer.stderr
    assert re.search(rf"at epoch 1; restored the backup of epoch {EPOCHS} from .*epoch-{EPOCHS:06d}", log)
    assert EPOCHS + 2 in epoch_losses(peer)  # trained on from the backup (whose optimizer state has the sane LR)


def test_broken_parameters_without_a_backup_stop_the_peer_with_a_clear_error(lone_peers):
    peer = lone_peers["no_backup"]
    assert peer.process.returncode == 1
    lines = peer.stderr.strip().splitlines()
    errors = [i for i, line in enumerate(lines)
              if re.fullmatch(r"run_trainer.py: error: .* at epoch \d+ and there is no local backup in .*", line)]
    assert len(errors) == 1, peer.stderr[-2000:]
    # hivemind's event loop may still report a pending task while the interpreter exits, but no traceback follows
    assert not any(line.startswith("Traceback") for line in lines[errors[0]:]), peer.stderr[-2000:]


@pytest.mark.parametrize("name", ["fp16", "mlm_bf16", "fp16_blocks"])
def test_mixed_precision_training(lone_peers, name):
    peer = lone_peers[name]
    assert peer.process.returncode == 0, peer.stderr[-2000:]
    losses = epoch_losses(peer)
    assert sorted(losses) == list(range(1, MIXED_EPOCHS + 1))
    assert losses[MIXED_EPOCHS] < losses[1] - 0.2, losses
    if name == "fp16_blocks":  # each epoch line reports the blocks' overflows and the range of their scales
        lines = re.findall(r"Reached epoch \d+: .* block overflow\(s\), block scales 2\^", peer.stderr)
        assert len(lines) == MIXED_EPOCHS, lines


def test_short_epochs_get_one_line_of_advice():
    from lean_transformer.swarm.peers.trainer import short_epoch_warning

    advice = short_epoch_warning(target_batch_size=64, matchmaking_time=1.0, samples_per_second=150, num_peers=2)
    assert advice is not None and "--target_batch_size 320 or more" in advice and "\n" not in advice
    assert short_epoch_warning(target_batch_size=512, matchmaking_time=1.0, samples_per_second=150, num_peers=2) is None
    assert short_epoch_warning(target_batch_size=64, matchmaking_time=1.0, samples_per_second=0.0, num_peers=1) is None
