"""Checkpoints as a user gets them: the model and its tokenizer load from the directory alone (offline, with
transformers' Auto classes), and what a Hub upload holds by default (private, no optimizer state)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from huggingface_hub.utils import filter_repo_objects
from transformers import AutoModelForCausalLM, AutoTokenizer

from arguments import TaskArguments, TrainingSettings
from lean_transformer.data.markov import MarkovCorpus
from lean_transformer.swarm.storage.hub import resolve_checkpoint, upload_arguments
from lean_transformer.swarm.storage.training_state import TRAINING_STATE_FILE
from tasks.causal_lm import CausalLMTask
from tasks.tokenizer import ByteTokenizer

TEXTS = ["", "plain ascii.", "héllo wörld, 日本語 and 🙂", " \t\n leading and trailing whitespace \r\n",
         "special names as text: <pad> </s> <mask> <cls> <sep>", bytes(range(1, 128)).decode("ascii"),
         *(document[:500] for _, document in zip(range(3), MarkovCorpus.generate(0).documents(seed=1)))]


def test_byte_tokenizer_saves_as_a_hugging_face_tokenizer_with_the_same_ids(tmp_path: Path):
    ours = ByteTokenizer()
    ours.save_pretrained(str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert len(loaded) == len(ours) == 261
    for name in ("pad_token_id", "eos_token_id", "mask_token_id", "cls_token_id", "sep_token_id"):
        assert getattr(loaded, name) == getattr(ours, name), name
    for text in TEXTS:
        ids = ours.encode(text)
        assert loaded(text)["input_ids"] == loaded.encode(text) == ids, text  # no special tokens added
        assert loaded.decode(ids) == ours.decode(ids) == text
    assert loaded.decode([ours.eos_token_id, *ours.encode("ab")], skip_special_tokens=True) == "ab"
    assert loaded.decode([0xE6, 0x97]) == ours.decode([0xE6, 0x97]) == "\ufffd"  # a cut multi-byte character


def test_a_checkpoint_loads_with_from_pretrained_and_its_tokenizer(tmp_path: Path):
    """What the aux peer writes besides the training state: model (save_pretrained) + task.save_tokenizer. A user
    needs nothing else: Auto classes, offline, give the same loss as the model that was saved."""
    task = CausalLMTask(TaskArguments(), TrainingSettings())
    model = task.build_model().eval()
    model.save_pretrained(tmp_path)
    task.save_tokenizer(str(tmp_path))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        path.name for path in tmp_path.iterdir()}

    tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    assert type(loaded) is type(model)
    text = TEXTS[-1]
    input_ids = torch.tensor([[tokenizer.eos_token_id, *tokenizer.encode(text)]])
    assert input_ids[0, 1:].tolist() == task.tokenizer.encode(text)
    with torch.no_grad():
        expected, actual = model(input_ids, labels=input_ids), loaded(input_ids, labels=input_ids)
    torch.testing.assert_close(actual.logits, expected.logits, rtol=1e-5, atol=1e-6)
    assert actual.loss.item() == pytest.approx(expected.loss.item(), rel=1e-6)


def checkpoint_files(directory: Path) -> list[str]:
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file())


def test_hub_upload_is_private_and_leaves_the_training_state_out_by_default(tmp_path: Path):
    """The arguments the uploader passes to HfApi.create_repo / upload_folder; the files are filtered with the same
    function huggingface_hub's upload_folder applies to ignore_patterns."""
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", TRAINING_STATE_FILE):
        (tmp_path / name).write_bytes(b"x")
    files = checkpoint_files(tmp_path)

    create, upload = upload_arguments("me/lean", tmp_path, epoch=7)
    assert create == dict(repo_id="me/lean", private=True, exist_ok=True)
    assert upload["repo_id"] == "me/lean" and upload["folder_path"] == tmp_path
    assert upload["commit_message"] == "Swarm checkpoint at epoch 7" and upload["delete_patterns"] == ["*"]
    uploaded = list(filter_repo_objects(files, allow_patterns=None, ignore_patterns=upload["ignore_patterns"]))
    assert uploaded == [name for name in files if name != TRAINING_STATE_FILE]

    create, upload = upload_arguments("me/lean", tmp_path, epoch=7, public=True, include_training_state=True)
    assert create["private"] is False
    assert list(filter_repo_objects(files, allow_patterns=None, ignore_patterns=upload["ignore_patterns"])) == files


def test_resume_from_weights_without_training_state_names_the_flag(tmp_path: Path):
    """A default Hub upload (model + tokenizer) cannot seed a swarm: one error naming --upload_training_state; with
    the training state it resolves to the checkpoint."""
    task = CausalLMTask(TaskArguments(), TrainingSettings())
    task.build_model().save_pretrained(tmp_path / "weights")
    task.save_tokenizer(str(tmp_path / "weights"))
    with pytest.raises(FileNotFoundError, match=r"^--resume_from: .*weights holds a model without its training state "
                                                r"\(training_state.pt.*only with --upload_training_state$"):
        resolve_checkpoint(str(tmp_path / "weights"), tmp_path / "downloads")
    (tmp_path / "weights" / TRAINING_STATE_FILE).write_bytes(b"")
    assert resolve_checkpoint(str(tmp_path / "weights"), tmp_path / "downloads") == tmp_path / "weights"
