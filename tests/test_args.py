"""The trainer's command line: defaults, --help, and one clear line for every bad value."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from arguments import (CollaborationSettings, NetworkSettings, TaskArguments, TrainingSettings, build_parser,
                       parse_arguments)

TRAINER = [NetworkSettings, CollaborationSettings, TrainingSettings, TaskArguments]
ROOT = Path(__file__).resolve().parent.parent
PEER_ID = "12D3KooWDNh6GZkBqi2zGzKXH27ZXhcm2aMoKHjZ3YdYXTndzrRs"


def test_defaults():
    network, collaboration, training, task = parse_arguments(TRAINER, ["--run_id", "my_run"])
    assert network.run_id == "my_run" and network.initial_peers == []
    assert network.host_maddrs == ["/ip4/0.0.0.0/tcp/0"]
    assert collaboration.grad_compression == "size_adaptive" and collaboration.offload_optimizer
    assert task.task == "causal_lm" and task.dataset == "embedded" and task.tokenizer_path is None
    assert task.validation_fraction == 0.01
    assert training.stop_epoch == training.total_steps and training.checkpointing_option() is False


def test_values_are_parsed_into_the_right_types():
    network, collaboration, training, task = parse_arguments(TRAINER, [
        "--run_id", "r", "--initial_peers", f"/ip4/10.0.0.1/tcp/31337/p2p/{PEER_ID}", f"/dns/a.b/tcp/1/p2p/{PEER_ID}",
        "--client_mode", "--no_use_relay", "--target_batch_size", "128", "--matchmaking_time", "2.5",
        "--grad_compression", "float16", "--bf16", "--gradient_checkpointing", "3", "--max_epochs", "7",
        "--task", "mlm", "--dataset", "hf:wikitext:wikitext-2-raw-v1"])
    assert len(network.initial_peers) == 2 and network.client_mode and not network.use_relay
    assert collaboration.target_batch_size == 128 and collaboration.matchmaking_time == 2.5
    assert collaboration.grad_compression == "float16"
    assert training.bf16 and training.checkpointing_option() == 3 and training.stop_epoch == 7
    assert task.task == "mlm" and task.dataset.startswith("hf:")


@pytest.mark.parametrize("value, expected", [("false", False), ("true", True), ("True", True), ("2", 2)])
def test_gradient_checkpointing_option(value, expected):
    training, = parse_arguments([TrainingSettings], ["--gradient_checkpointing", value])
    assert training.checkpointing_option() == expected


def test_every_field_has_help_and_help_shows_every_group():
    for group in TRAINER:
        for field in dataclasses.fields(group):
            assert len(field.metadata.get("help", "")) > 15, f"{group.__name__}.{field.name} has no real help"
    text = build_parser(TRAINER, "Join a swarm.").format_help()
    for group in TRAINER:
        assert group._argument_group_name in text
    for field in ("--run_id", "--initial_peers", "--target_batch_size", "--per_device_batch_size", "--task",
                  "--sequence_length_warmup_steps", "--identity_path", "--backup_every_epochs"):
        assert field in text


BAD = {
    "missing run_id": ([], "--run_id"),
    "run_id with a slash": (["--run_id", "a/b"], "--run_id"),
    "unknown task": (["--task", "translation"], "--task: unknown task"),
    "garbage multiaddr": (["--initial_peers", "garbage"], "--initial_peers: 'garbage' is not a valid multiaddr"),
    "multiaddr without peer id": (["--initial_peers", "/ip4/127.0.0.1/tcp/1234"], "no /p2p/<peer id> part"),
    "malformed host maddr": (["--host_maddrs", "/ip4/300.0.0.1/tcp/1"], "--host_maddrs"),
    "missing config": (["--model_config_path", "/nonexistent.json"], "--model_config_path: /nonexistent.json"),
    "missing tokenizer": (["--tokenizer_path", "/nonexistent/tok"], "--tokenizer_path"),
    "missing resume dir": (["--resume_from", "/nonexistent/dir"], "--resume_from"),
    "identity in a missing dir": (["--identity_path", "/nonexistent/dir/id.key"], "--identity_path"),
    "zero target batch": (["--target_batch_size", "0"], "--target_batch_size: must be positive"),
    "fp16 and bf16": (["--fp16", "--bf16"], "mutually exclusive"),
    "block scaling without fp16": (["--block_grad_scaling"], "--block_grad_scaling: needs --fp16"),
    "block scaling with bf16 weights": (["--fp16", "--block_grad_scaling", "--model_dtype", "bfloat16"],
                                        "--block_grad_scaling: needs float32 weights"),
    "block scaling with host gradients": (["--fp16", "--block_grad_scaling", "--offload_gradients", "true"],
                                          "--block_grad_scaling: not available with --offload_gradients true"),
    "grad averaging delay alone": (["--delay_grad_averaging"], "--delay_grad_averaging: needs"),
    "sequence warmup above max": (["--initial_sequence_length", "512", "--max_sequence_length", "128"],
                                  "--initial_sequence_length"),
    "bad checkpointing": (["--gradient_checkpointing", "sometimes"], "--gradient_checkpointing"),
    "zero backward chunks": (["--backward_chunks", "0"], "--backward_chunks: must be positive"),
    "zero device accumulation": (["--device_accumulation", "0"], "--device_accumulation: must be positive"),
    "device sums without host gradients": (["--device_accumulation", "4", "--offload_gradients", "false"],
                                           "--device_accumulation: sums host gradients on the device"),
    "unknown compression": (["--grad_compression", "zip"], "--grad_compression"),
    "not a number": (["--learning_rate", "fast"], "--learning_rate"),
    "validation fraction of 1": (["--validation_fraction", "1"], "--validation_fraction: must be in [0, 1), got 1.0"),
    "negative local steps": (["--local_steps", "-1"], "--local_steps: must be non-negative"),
    "zero outer lr": (["--outer_lr", "0"], "--outer_lr: must be positive"),
    "outer momentum of 1": (["--outer_momentum", "1"], "--outer_momentum: must be in [0, 1)"),
    "top-k fraction above 1": (["--outer_topk_fraction", "1.5"], "--outer_topk_fraction"),
    "branch depth beyond the history": (["--outer_branch_depth", "5"], "--outer_branch_depth: must be in [0, 4]"),
    "unknown outer compression": (["--outer_compression", "zip"], "--outer_compression"),
    "local steps with delayed steps": (["--local_steps", "5", "--delay_optimizer_step"],
                                       "--delay_optimizer_step: does not apply with --local_steps"),
    "unknown aggregation": (["--aggregation", "median"], "--aggregation"),
}


def test_diloco_flags_and_the_run_settings_every_peer_must_share():
    from tasks import get_task

    network, collaboration, training, task_args = parse_arguments(TRAINER, [
        "--run_id", "r", "--local_steps", "50", "--outer_lr", "0.5", "--outer_overlap", "--outer_compression", "topk",
        "--outer_topk_fraction", "0.05"])
    assert collaboration.local_steps == 50 and collaboration.outer_overlap and collaboration.outer_lr == 0.5
    assert collaboration.outer_momentum == 0.9 and collaboration.outer_compression == "topk"
    assert collaboration.aggregation == "centered_clip"  # the default, top-k included
    settings = get_task(task_args.task)(task_args, training).swarm_settings(collaboration)
    assert {name: settings[name] for name in ("local_steps", "outer_lr", "outer_momentum", "outer_overlap",
                                             "outer_compression", "outer_topk_fraction")} == dict(
        local_steps=50, outer_lr=0.5, outer_momentum=0.9, outer_overlap=True, outer_compression="topk",
        outer_topk_fraction=0.05)


@pytest.mark.parametrize("name", list(BAD))
def test_bad_value_exits_with_one_line(name, capsys):
    argv, fragment = BAD[name]
    if name != "missing run_id" and "--run_id" not in argv:
        argv = ["--run_id", "r", *argv]
    with pytest.raises(SystemExit) as exit_info:
        parse_arguments(TRAINER, argv)
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.startswith(f"{build_parser(TRAINER).prog}: error: ") and fragment in stderr, stderr


def test_every_agreed_setting_reaches_the_swarm_settings_and_no_other():
    """The fields marked ``agree`` (library and task) are exactly the flag-named entries of the swarm settings, beside
    the task's own (its name, the tokenizer's fingerprint, the model config spelled out)."""
    from tasks import get_task

    network, collaboration, training, task_args = parse_arguments(TRAINER, ["--run_id", "r"])
    settings = get_task(task_args.task)(task_args, training).swarm_settings(collaboration)
    agreed = {item.name for group in TRAINER for item in dataclasses.fields(group) if item.metadata.get("agree")}
    assert {"learning_rate", "target_batch_size", "local_steps", "outer_topk_fraction", "validation_fraction",
            "aggregation"} <= agreed
    assert not any(item.metadata.get("agree") for item in dataclasses.fields(NetworkSettings))
    flagged = {name for name in settings if not name.startswith("model_config_path (")}
    assert flagged == agreed | {"task", "tokenizer_path"}, flagged ^ (agreed | {"task", "tokenizer_path"})


HEAVY = ("torch", "transformers", "hivemind")


@pytest.mark.parametrize("script", ["run_trainer.py", "run_aux_peer.py"])
@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["--run_id", "r", "--bogus"], 2),
                                        (["--run_id", "r", "--target_batch_size", "many"], 2),
                                        (["--run_id", "a/b"], 2), (["--run_id", "r", "--fp16", "--bf16"], 2)])
def test_flags_parse_without_loading_torch_transformers_or_hivemind(script, argv, code):
    """--help and a bad flag return before the heavy libraries load (figure: benchmarks/results/cli_startup.json)."""
    probe = (f"import runpy, sys; sys.argv = [{script!r}, *{argv!r}]\n"
             f"try:\n    runpy.run_path({script!r}, run_name='__main__')\n"
             f"except SystemExit as e:\n    print('exit', e.code)\n"
             f"print('loaded', *sorted(name for name in {HEAVY!r} if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = result.stdout.splitlines()
    assert lines[-2:] == [f"exit {code}", "loaded"], (result.stdout[-2000:], result.stderr[-2000:])


@pytest.mark.parametrize("argv, device, bf16_gpu, expected", [
    ([], "cuda", True, ("bfloat16", True)),
    (["--offload_gradients", "false"], "cuda", True, ("float32", False)),  # found on an H200: this used to refuse to run
    (["--fp16", "--block_grad_scaling"], "cuda", True, ("float32", False)),
    ([], "cuda", False, ("float32", True)),
    ([], "cpu", False, ("float32", False)),
    (["--model_dtype", "float16"], "cuda", True, ("float16", True)),
])
def test_auto_weight_dtype_follows_where_the_gradients_go(monkeypatch, argv, device, bf16_gpu, expected):
    """--model_dtype auto is bfloat16 on a bf16 GPU only when the gradients go to the host: the float32 master weights
    need float32 gradients, so --offload_gradients false alone gives a valid float32 GPU trainer."""
    import torch

    from lean_transformer.swarm.peers.trainer import model_dtype, offload_gradients

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16_gpu)  # the GPU's capability
    training = parse_arguments(TRAINER, ["--run_id", "r", *argv])[2]
    host_gradients = offload_gradients(training, torch.device(device))
    assert (str(model_dtype(training, torch.device(device), host_gradients)).removeprefix("torch."),
            host_gradients) == expected
