"""The aux peer in a real swarm: real hivemind on 127.0.0.1, every peer its own process, every wait bounded.

One swarm (the module fixture) serves several tests: an aux peer and two trainers train the tiny model for a few
epochs; the aux peer is stopped, restarted with the same identity and port on a slow disk and SIGKILLed in the
middle of writing a checkpoint; then the trainers stop. Resuming and assisting start small swarms of their own.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from safetensors.torch import load_file

from matplotlib.image import imread
from transformers import AutoTokenizer

from arguments import AuxTrainingArguments, TaskArguments
from aux_utils import assert_valid_png, closed_port, PeerProcess, read_wandb_history, start_peer, stop_all, wait_until
from grad_peer import check_rounds
from swarm_utils import epoch_reports, group_sizes
from lean_transformer import LeanGPTForCausalLM
from lean_transformer.swarm.storage.checkpoint_dir import CheckpointDir
from lean_transformer.demo.local_swarm import command_line
from lean_transformer.swarm.monitoring.evaluation import evaluate
from lean_transformer.swarm.storage.training_state import TRAINING_STATE_FILE
from tasks.causal_lm import CausalLMTask
from tasks.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

CHECKPOINT_EVERY = 2


def swarm_args(run_id: str, **overrides) -> List[str]:
    """Arguments every peer of a test swarm shares: the tiny model, short sequences, a small target batch."""
    options = dict(run_id=run_id, host_maddrs="/ip4/127.0.0.1/tcp/0", target_batch_size=16, per_device_batch_size=4,
                   max_sequence_length=32, matchmaking_time=3, averaging_timeout=10, startup_timeout=60)
    options.update(overrides)
    return command_line(options)


def start_trainer(name: str, root: Path, run_id: str, initial_peers: List[str], *extra: str) -> PeerProcess:
    return start_peer(name, ["run_trainer.py", *swarm_args(run_id), "--initial_peers", *initial_peers,
                              "--output_dir", str(root / name), *extra], root)


def read_jsonl(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def training_rows(path: Path) -> List[dict]:
    """The rows of the trainers' statistics (the others are evaluations of checkpoints: epoch, validation_loss, and
    tables of contributors: peers)."""
    return [row for row in read_jsonl(path) if "alive_peers" in row]


def evaluation_rows(path: Path) -> List[dict]:
    return [row for row in read_jsonl(path) if "validation_loss" in row]


def tree_digest(path: Path) -> Dict[str, str]:
    return {str(file.relative_to(path)): hashlib.sha256(file.read_bytes()).hexdigest()
            for file in sorted(path.rglob("*")) if file.is_file()}


def published_records(trainer: PeerProcess) -> Dict[int, tuple]:
    """epoch -> (mean loss, mini-steps, samples) as the trainer logged the metrics record it published."""
    return {epoch: (report.mean_loss, report.mini_steps, report.samples)
            for epoch, report in epoch_reports(trainer).items()}


@dataclass
class SwarmRun:
    root: Path
    aux: PeerProcess
    restarted_aux: PeerProcess
    trainers: List[PeerProcess]
    initial_peers: List[str]
    restarted_initial_peers: List[str]
    checkpoints_before_kill: Dict[str, Dict[str, str]]
    killed_while_writing: List[str]

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics" / "swarm.jsonl"

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoints"


@pytest.fixture(scope="module")
def swarm_run(tmp_path_factory) -> SwarmRun:
    root = tmp_path_factory.mktemp("aux_swarm")
    # the Hub "server" is a closed port on 127.0.0.1: every upload fails (and nothing leaves the machine)
    env = dict(WANDB_MODE="offline", WANDB_DIR=str(root), WANDB_API_KEY="", WANDB_SILENT="true",
               HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}", HF_TOKEN="hf_test_token")
    aux_args = ["run_aux_peer.py", *swarm_args("aux-test", host_maddrs=f"/ip4/127.0.0.1/tcp/{closed_port()}"),
                "--identity_path", str(root / "aux.key"), "--checkpoint_dir", str(root / "checkpoints"),
                "--checkpoint_every_epochs", str(CHECKPOINT_EVERY), "--keep_checkpoints", "2",
                "--metrics_path", str(root / "metrics" / "swarm.jsonl"), "--refresh_period", "0.5"]
    peers: List[PeerProcess] = []
    try:
        aux = start_peer("aux", [*aux_args, "--wandb_dir", str(root), "--hub_repo_id", "swarm/lean-test",
                                  "--hub_upload_interval", "0"], root, env)
        peers.append(aux)
        initial_peers = aux.initial_peers()
        trainers = [start_trainer(f"trainer{i}", root, "aux-test", initial_peers, "--backup_every_epochs", "1",
                                  "--keep_backups", "100") for i in (1, 2)]
        peers += trainers

        def ready():
            rows = training_rows(root / "metrics" / "swarm.jsonl")
            checkpoints = CheckpointDir(root / "checkpoints", keep_last=2).checkpoints()
            return sum(row["alive_peers"] == 2 for row in rows) >= 4 and len(checkpoints) == 2

        wait_until(ready, timeout=150, what="4 epochs with 2 trainers and 2 checkpoints", interval=0.5,
                   peers=trainers)
        assert aux.stop() == 0, aux.stderr[-3000:]

        # restart on a slow disk with the same identity and port; SIGKILL it while it writes a checkpoint
        checkpoints_before = {path.name: tree_digest(path) for path in (root / "checkpoints").glob("epoch-*")}
        # the trainers dropped the dead aux peer from their routing tables: like an operator, point it at one of them
        restarted = start_peer("aux-restarted", ["tests/slow_disk.py", *aux_args, "--wandb_project", "",
                                                  "--initial_peers", *trainers[0].initial_peers()], root,
                                dict(SLOW_FSYNC_SECONDS="1"))
        peers.append(restarted)
        restarted_initial_peers = restarted.initial_peers()
        in_progress = wait_until(lambda: [path.name for path in (root / "checkpoints").glob(".tmp-epoch-*")],
                                 timeout=90, what="the restarted aux peer to start writing a checkpoint", interval=0.02)
        restarted.kill()

        assert stop_all(trainers) == [0, 0], [trainer.stderr[-2000:] for trainer in trainers]
        yield SwarmRun(root, aux, restarted, trainers, initial_peers, restarted_initial_peers, checkpoints_before,
                       in_progress)
    finally:
        for peer in peers:
            peer.kill()


def test_restarted_aux_peer_keeps_its_address(swarm_run: SwarmRun):
    assert swarm_run.initial_peers == swarm_run.restarted_initial_peers
    assert all(address.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in address
               for address in swarm_run.initial_peers)


def test_failed_hub_uploads_are_logged_and_the_peer_goes_on(swarm_run: SwarmRun):
    failures = re.findall(r"Hub upload of epoch (\d+) to swarm/lean-test failed", swarm_run.aux.stderr)
    saved = [checkpoint["epoch"] for checkpoint in swarm_run.aux.events("checkpoint")]
    assert failures and saved and max(saved) > min(map(int, failures)), "checkpoints go on after a failed upload"
    assert swarm_run.aux.process.returncode == 0


def test_metrics_match_what_the_trainers_published(swarm_run: SwarmRun):
    published = [published_records(trainer) for trainer in swarm_run.trainers]
    rows = training_rows(swarm_run.metrics_path)
    assert [row["epoch"] for row in rows] == sorted({row["epoch"] for row in rows}), "an epoch was logged twice"
    checked_with_both = 0
    for row in rows:
        reporters = [records[row["epoch"]] for records in published if row["epoch"] in records]
        # the aggregate must be the sums over the trainers whose records it saw (both, unless one was overwritten
        # between two refreshes): loss = sum of loss sums / sum of mini-steps
        candidates = list(itertools.combinations(reporters, row["alive_peers"]))
        assert candidates, f"epoch {row['epoch']}: {row['alive_peers']} peers, but {len(reporters)} published"
        matches = [group for group in candidates
                   if sum(steps for _, steps, _ in group) == row["mini_steps"]
                   and sum(samples for _, _, samples in group) == row["samples_in_epoch"]
                   and row["loss"] == pytest.approx(sum(loss * steps for loss, steps, _ in group) / row["mini_steps"],
                                                    abs=1e-4)]  # trainers log the mean loss to 4 decimals
        assert matches, f"epoch {row['epoch']}: {row} does not aggregate the published records {reporters}"
        checked_with_both += row["alive_peers"] == 2
    assert checked_with_both >= 4


def test_table_of_contributors_lists_the_trainers(swarm_run: SwarmRun):
    """The JSONL file holds the table of contributors with each epoch: both trainers, as full peers, their samples
    never more than they published, their averaged rounds never more than their epochs."""
    rows = [row for row in read_jsonl(swarm_run.metrics_path) if "peers" in row or "alive_peers" in row]
    # a table follows every refresh that completed epochs (one or more: with epochs shorter than the refresh, a
    # refresh can complete several), and only such a refresh
    kinds = "".join("t" if "peers" in row else "e" for row in rows)
    assert kinds.startswith("e") and kinds.endswith("t") and "tt" not in kinds, kinds
    tables = [row["peers"] for row in rows if "peers" in row]
    names = {trainer.events("joined")[0]["peer"]: trainer for trainer in swarm_run.trainers}
    last = {peer["peer_id"]: peer for peer in tables[-1]}
    assert last.keys() == names.keys()
    for peer_id, peer in last.items():
        published = sum(samples for _, _, samples in published_records(names[peer_id]).values())
        assert peer["client_mode"] is False and peer["excluded"] is False
        assert 0 < peer["samples"] <= published and peer["samples_per_second"] > 0
        assert 0 <= peer["rounds_averaged"] <= peer["rounds_attempted"]
    assert any(peer["rounds_averaged"] > 0 for peer in last.values()), last


def test_wandb_offline_run_and_jsonl_hold_the_metrics(swarm_run: SwarmRun):
    rows = training_rows(swarm_run.metrics_path)
    history = read_wandb_history(swarm_run.root)
    logged = {entry["epoch"]: entry for entry in history if "alive_peers" in entry}
    first_run_rows = [row for row in rows if row["epoch"] in logged]
    assert len(first_run_rows) == len(logged) >= 4  # the first aux peer logged every row to both
    for row in first_run_rows:
        entry = logged[row["epoch"]]
        for key in ("loss", "samples_per_second"):
            assert entry[key] == pytest.approx(row[key], rel=1e-6)
        for key in ("alive_peers", "samples_in_epoch", "mini_steps"):
            assert entry[key] == row[key]
    validation = [(entry["epoch"], entry["validation_loss"]) for entry in history if "validation_loss" in entry]
    assert validation and validation == [(row["epoch"], pytest.approx(row["validation_loss"], rel=1e-6))
                                         for row in evaluation_rows(swarm_run.metrics_path)]


def test_plot_is_a_valid_png_with_the_validation_loss(swarm_run: SwarmRun):
    path = swarm_run.metrics_path.with_suffix(".png")
    assert_valid_png(path)
    red = torch.tensor([214, 39, 40]) / 255  # matplotlib's tab:red, the validation loss's markers and legend
    pixels = torch.from_numpy(imread(path)[..., :3])
    assert int(((pixels - red).abs().max(dim=-1).values < 0.05).sum()) >= 30, "no validation loss on the plot"


def test_each_checkpoint_is_evaluated_on_held_out_data(swarm_run: SwarmRun):
    """The aux peer logs, for every checkpoint it saved, the validation loss that its model gives on the held-out
    batches (rebuilt here from the same flags), and the checkpoint carries the tokenizer."""
    saved = [checkpoint["epoch"] for checkpoint in swarm_run.aux.events("checkpoint")]
    evaluations = {row["epoch"]: row["validation_loss"] for row in evaluation_rows(swarm_run.metrics_path)}
    assert len(saved) >= 2 and sorted(evaluations) == saved
    assert all(0 < loss < 6 for loss in evaluations.values()), evaluations  # finite, below chance (ln 261 = 5.56)
    task = CausalLMTask(TaskArguments(), AuxTrainingArguments(per_device_batch_size=4, max_sequence_length=32))
    batches = task.validation_batches(4)  # --eval_batches' default
    checkpoints = CheckpointDir(swarm_run.checkpoint_dir, keep_last=2).checkpoints()
    for epoch, path in checkpoints:
        model = LeanGPTForCausalLM.from_pretrained(path)
        assert evaluate(model, batches) == pytest.approx(evaluations[epoch], rel=1e-5, abs=1e-6)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        assert tokenizer.encode("la lu.") == ByteTokenizer().encode("la lu.")
    backups = list((swarm_run.root / "trainer1" / "backups").glob("epoch-*"))
    assert backups and all((path / "tokenizer.json").is_file() for path in backups)


def test_checkpoints_hold_the_swarm_state_of_their_epoch(swarm_run: SwarmRun):
    checkpoints = CheckpointDir(swarm_run.checkpoint_dir, keep_last=2).checkpoints()
    epochs = [epoch for epoch, _ in checkpoints]
    assert len(checkpoints) == 2, "keeps the newest 2"
    assert epochs[0] // CHECKPOINT_EVERY < epochs[1] // CHECKPOINT_EVERY and epochs[0] >= CHECKPOINT_EVERY
    # the trainers backed up their parameters at every epoch: the backup nearest to a checkpoint is of its epoch. A
    # trainer one epoch behind its group takes the group's epoch label E without a step (its `label_taken` event): it
    # holds, and may serve, the same parameters under E - 1 and E, so its backups of both count for both epochs
    backups = []  # (epochs, parameters)
    for trainer in swarm_run.trainers:
        taken = {event["epoch"] for event in trainer.events("label_taken")}
        for path in (swarm_run.root / trainer.name / "backups").glob("epoch-*"):
            label = int(path.name.split("-")[1])
            epochs_held = {label} | ({label + 1} & taken) | ({label - 1} if label in taken else set())
            backups.append((epochs_held, load_file(path / "model.safetensors")))
    for epoch, path in checkpoints:
        assert torch.load(path / TRAINING_STATE_FILE, map_location="cpu", weights_only=True)["epoch"] == epoch
        model = LeanGPTForCausalLM.from_pretrained(path)  # loads on its own, as anyone would load it
        params = {name: tensor.detach() for name, tensor in model.state_dict().items()}
        distances = [(sum(float((params[name] - backup[name]).norm()) for name in backup), sorted(epochs_held))
                     for epochs_held, backup in backups]
        of_its_epoch = min(distance for distance, epochs_held in distances if epoch in epochs_held)
        nearest_other = min((distance, epochs_held) for distance, epochs_held in distances if epoch not in epochs_held)
        assert of_its_epoch < 0.1 * nearest_other[0], (
            f"checkpoint {epoch}: {of_its_epoch:.4f} from a backup of its epoch, {nearest_other[0]:.4f} from one of "
            f"epochs {nearest_other[1]}")


def test_sigkill_while_writing_keeps_the_previous_checkpoint(swarm_run: SwarmRun):
    root = swarm_run.checkpoint_dir
    assert swarm_run.killed_while_writing, "the kill should land while a checkpoint is being written"
    assert {path.name: tree_digest(path) for path in root.glob("epoch-*")} == swarm_run.checkpoints_before_kill
    epoch, latest = CheckpointDir(root, keep_last=2).checkpoints()[-1]  # reopening removes the dead writer's files
    assert not list(root.glob(".tmp-*"))
    LeanGPTForCausalLM.from_pretrained(latest)
    assert torch.load(latest / TRAINING_STATE_FILE, weights_only=True)["epoch"] == epoch


def test_resume_seeds_a_new_swarm_with_the_checkpoint(swarm_run: SwarmRun, tmp_path: Path):
    epoch, checkpoint = CheckpointDir(swarm_run.checkpoint_dir, keep_last=2).checkpoints()[-1]
    peers: List[PeerProcess] = []
    try:
        aux = start_peer("aux-resumed", ["run_aux_peer.py", *swarm_args("aux-resume"), "--resume_from",
                                          str(swarm_run.checkpoint_dir), "--checkpoint_dir", str(tmp_path / "ckpt"),
                                          "--metrics_path", str(tmp_path / "m.jsonl"), "--wandb_project", "",
                                          "--refresh_period", "0.5"], tmp_path)
        peers.append(aux)
        initial_peers = aux.initial_peers()
        assert aux.events("joined")[0]["epoch"] == epoch  # seeded with the checkpoint
        # one trainer stops right after joining (its exit backup holds the parameters it would start from);
        # another one trains on
        joiner = start_trainer("joiner", tmp_path, "aux-resume", initial_peers, "--max_epochs", str(epoch))
        trainer = start_trainer("trainer", tmp_path, "aux-resume", initial_peers, "--max_epochs", str(epoch + 2),
                                "--backup_every_epochs", "0")
        peers += [joiner, trainer]
        assert joiner.wait(90) == 0, joiner.stderr[-3000:]
        assert trainer.wait(120) == 0, trainer.stderr[-3000:]
        for peer in (joiner, trainer):
            (joined,) = peer.events("joined")
            assert (joined["epoch"], joined["from_swarm"]) == (epoch, True), peer.name
        assert published_records(trainer).keys() >= {epoch + 1, epoch + 2}

        saved = load_file(checkpoint / "model.safetensors")
        joined = load_file(tmp_path / "joiner" / "backups" / CheckpointDir.name(epoch) / "model.safetensors")
        assert saved.keys() == joined.keys()
        assert all(torch.equal(saved[name], joined[name]) for name in saved)
        saved_state = torch.load(checkpoint / TRAINING_STATE_FILE, weights_only=True)
        joined_state = torch.load(tmp_path / "joiner" / "backups" / CheckpointDir.name(epoch) / TRAINING_STATE_FILE,
                                  weights_only=True)
        assert joined_state["epoch"] == saved_state["epoch"] == epoch
        assert joined_state["scheduler"]["last_epoch"] == saved_state["scheduler"]["last_epoch"]
        assert_same_optimizer_state(saved_state["optimizer"], joined_state["optimizer"])
        assert aux.stop() == 0, aux.stderr[-3000:]
    finally:
        for peer in peers:
            peer.kill()


def assert_same_optimizer_state(expected: dict, actual: dict) -> None:
    assert expected["state"].keys() == actual["state"].keys() and expected["state"]
    for index, state in expected["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, actual["state"][index][key]), (index, key)
            else:
                assert value == actual["state"][index][key], (index, key)


@pytest.mark.parametrize("mode", [[], ["--client_mode"]], ids=["full peers", "client-mode peers"])
def test_assisting_aux_peer_is_counted_and_leaves_the_averaged_gradients_unchanged(mode: List[str], tmp_path: Path):
    """Two peers with known gradients (batches 3 and 5, started together) average in rounds that the assisting aux
    peer joins (it is one of the group; for client-mode peers it is the only peer that can accept connections and
    reduce the parts): every round returns, on both, exactly the sample-weighted mean of the two peers' gradients, as
    if the aux peer were not there."""
    run = swarm_args("aux-assist", target_batch_size=48, grad_compression="none")
    batches = {1: 3, 2: 5}  # --grad_seed -> --per_device_batch_size
    start_file = tmp_path / "start"
    peers: List[PeerProcess] = []
    try:
        aux = start_peer("aux", ["run_aux_peer.py", *run, "--assist_in_averaging", "--assist_refresh_period", "0.2",
                                  "--checkpoint_every_epochs", "0", "--metrics_path", str(tmp_path / "m.jsonl"),
                                  "--wandb_project", ""], tmp_path)
        peers.append(aux)
        initial_peers = aux.initial_peers()
        workers = [start_peer(f"worker{seed}", ["tests/grad_peer.py", "--out", str(tmp_path / f"{seed}.pt"),
                                                 "--grad_seed", str(seed), "--rounds", "2", "--group_size", "3",
                                                 "--max_epochs", "15", "--start_file", str(start_file), *run,
                                                 "--per_device_batch_size", str(batch), *mode,
                                                 "--initial_peers", *initial_peers], tmp_path)
                   for seed, batch in batches.items()]
        peers += workers
        for worker in workers:
            worker.wait_for("^ready$", timeout=90, stream="stdout")
        start_file.touch()
        for worker in workers:
            assert worker.wait(120) == 0, worker.stderr[-3000:]
        assert aux.stop() == 0, aux.stderr[-3000:]
    finally:
        for peer in peers:
            peer.kill()

    dumps = {seed: torch.load(tmp_path / f"{seed}.pt", weights_only=True) for seed in batches}
    for seed, dump in dumps.items():  # a peer's weight is the samples it accumulated: whole batches of its size
        assert all(r["weight"] > 0 and r["weight"] % batches[seed] == 0 for r in dump["rounds"]), dump["rounds"]
    everyone = sorted([*(dump["peer_id"] for dump in dumps.values()), initial_peers[0].rsplit("/p2p/", 1)[1]])
    assert sum(r["group"] == everyone for r in dumps[1]["rounds"]) >= 2, dumps[1]["rounds"]
    assert check_rounds(dumps, outsiders=set()) >= 2, "the two peers should share rounds through the aux peer"
    assert 3 in group_sizes(aux)
