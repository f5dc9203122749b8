"""run_aux_peer.py's arguments, and bad input: one readable line on stderr and a non-zero exit code, no traceback."""
from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from arguments import (AuxSettings, AuxTrainingArguments, CollaborationSettings, NetworkSettings,
                       TaskArguments, build_parser, parse_arguments)

from aux_utils import REPO, closed_port

AUX = [NetworkSettings, CollaborationSettings, TaskArguments, AuxTrainingArguments, AuxSettings]


def test_help_shows_every_aux_option():
    text = build_parser(AUX, "aux").format_help()
    for field in dataclasses.fields(AuxSettings):
        assert len(field.metadata.get("help", "")) > 15, f"{field.name} has no real help"
        assert f"--{field.name}" in text
    assert AuxSettings._argument_group_name in text and AuxTrainingArguments._argument_group_name in text
    assert "Hub repo id" in text  # --resume_from's help is the aux peer's, not the trainer's


def test_aux_options_are_parsed(tmp_path: Path):
    *_, training, aux = parse_arguments(AUX, [
        "--run_id", "r", "--refresh_period", "2.5", "--checkpoint_every_epochs", "3", "--keep_checkpoints", "4",
        "--assist_in_averaging", "--hub_repo_id", "me/lean", "--resume_from", str(tmp_path), "--learning_rate", "0.01",
        "--eval_batches", "2"])
    assert (aux.refresh_period, aux.checkpoint_every_epochs, aux.keep_checkpoints) == (2.5, 3, 4)
    assert aux.assist_in_averaging and aux.hub_repo_id == "me/lean" and aux.eval_batches == 2
    assert not aux.hub_public and not aux.upload_training_state  # private, weights only: by default
    *_, aux = parse_arguments(AUX, ["--run_id", "r", "--hub_public", "--upload_training_state"])
    assert aux.hub_public and aux.upload_training_state
    assert (aux.dashboard_port, aux.dashboard_host) == (None, "127.0.0.1")  # no page unless asked, and only locally
    *_, aux = parse_arguments(AUX, ["--run_id", "r", "--dashboard_port", "0", "--dashboard_host", "0.0.0.0"])
    assert (aux.dashboard_port, aux.dashboard_host) == (0, "0.0.0.0")
    assert training.resume_from == str(tmp_path) and training.learning_rate == 0.01
    *_, training, _ = parse_arguments(AUX, ["--run_id", "r", "--resume_from", "someone/checkpoints"])
    assert training.resume_from == "someone/checkpoints"  # a Hub repo, downloaded when the peer starts


@pytest.mark.parametrize("args, message", [
    (["--keep_checkpoints", "0"], "--keep_checkpoints: must be positive, got 0"),
    (["--checkpoint_every_epochs", "-1"], "--checkpoint_every_epochs: must be non-negative, got -1"),
    (["--resume_from", "no/such/dir"], "--resume_from: no/such/dir is neither a directory nor a Hub repo id"),
    (["--hub_repo_id", "not a repo"], "--hub_repo_id: 'not a repo' is not a Hub repo id"),
    (["--eval_batches", "-1"], "--eval_batches: must be non-negative, got -1"),
    (["--dashboard_port", "70000"], "--dashboard_port: must be a TCP port (0-65535), got 70000"),
    (["--dashboard_port", "8080", "--dashboard_host", " "], "--dashboard_host: must be an address to listen on"),
])
def test_bad_option_exits_with_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_arguments(AUX, ["--run_id", "r", *args])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"error: {message}" in lines[0], lines


@pytest.mark.parametrize("args, code, message", [
    (["--assist_in_averaging", "--client_mode"], 1, "--assist_in_averaging: averaging through this peer needs "
                                                     "incoming connections"),
    (["--resume_from", "someone/missing-checkpoint"], 1, "--resume_from: someone/missing-checkpoint is not a local "
                                                         "directory and could not be downloaded as a Hub repo"),
    (["--resume_from", "WEIGHTS_ONLY"], 1, "holds a model without its training state (training_state.pt: optimizer, "
                                           "LR schedule, epoch), so a swarm cannot resume from it; an aux peer "
                                           "uploads that state to the Hub only with --upload_training_state"),
    (["--validation_fraction", "0"], 1, "--validation_fraction: is 0, so there are no held-out documents to "
                                        "evaluate on (pass --eval_batches 0 to evaluate nothing)"),
    (["--dashboard_port", "BUSY_PORT"], 1, "--dashboard_port: cannot listen on 127.0.0.1:"),
])
def test_bad_input_gives_one_line(args, code, message, tmp_path: Path):
    if "WEIGHTS_ONLY" in args:  # what a default Hub upload holds: the model and its tokenizer, no training state
        from lean_transformer import LeanGPTConfig, LeanGPTForCausalLM

        LeanGPTForCausalLM(LeanGPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32)).save_pretrained(tmp_path / "weights")
        args = [str(tmp_path / "weights") if arg == "WEIGHTS_ONLY" else arg for arg in args]
    busy = socket.create_server(("127.0.0.1", 0))  # the live page's port is taken: refused before joining
    args = [str(busy.getsockname()[1]) if arg == "BUSY_PORT" else arg for arg in args]
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}", "WANDB_MODE": "disabled",
           "HF_HUB_DOWNLOAD_TIMEOUT": "5"}
    with busy:
        result = subprocess.run(
            [sys.executable, "run_aux_peer.py", "--run_id", "cli-test", "--host_maddrs", "/ip4/127.0.0.1/tcp/0",
             "--checkpoint_dir", str(tmp_path / "ckpt"), "--metrics_path", str(tmp_path / "m.jsonl"), *args],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == code, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "Traceback" not in result.stderr
