"""Validation: the held-out split no trainer sees, the aux peer's evaluation (exactly the model's loss on the
held-out batches) and where the validation loss goes (JSONL, plot, wandb). The same code runs in a real swarm in
tests/test_aux_swarm.py."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tasks.data
from arguments import AuxTrainingArguments, CollaborationSettings, TaskArguments
from lean_transformer.swarm.monitoring.aggregation import SwarmStats
from lean_transformer.swarm.monitoring.evaluation import Evaluation, evaluate
from lean_transformer.swarm.monitoring.plot import redraw_plot
from lean_transformer.swarm.monitoring.run_history import RunHistory, read_evaluations, read_rows
from tasks.causal_lm import CausalLMTask
from tasks.data import is_held_out, make_text_source
from tasks.mlm import MLMTask

from aux_utils import assert_valid_png, parse_wandb_history, wait_for_wandb_history

EOS = 257  # the byte tokenizer's end-of-text id


def tiny_task(task_class=CausalLMTask, **task_args) -> CausalLMTask:
    return task_class(TaskArguments(task=task_class.name, **task_args),
                      AuxTrainingArguments(per_device_batch_size=4, max_sequence_length=64))


def documents_in(batches: list[dict]) -> list[str]:
    """The complete documents in consecutive packed batches (the text between two end-of-text tokens)."""
    ids = torch.cat([batch["input_ids"].flatten() for batch in batches]).tolist()
    ends = [i for i, token in enumerate(ids) if token == EOS]
    return [bytes(ids[start + 1:end]).decode() for start, end in zip(ends, ends[1:])]


def test_held_out_documents_are_never_training_documents():
    task = tiny_task()
    source = task.text_source
    validation = [document for _, document in zip(range(8), source.documents(seed=0, split="validation"))]
    mixed = [document for _, document in zip(range(600), source.all_documents(seed=1))]
    training = [document for _, document in zip(range(300), source.documents(seed=1))]
    assert all(is_held_out(document, 0.01) for document in validation)
    assert not any(is_held_out(document, 0.01) for document in training)
    assert not set(validation) & set(training) and len(set(validation)) == 8
    # the trainer of seed 1 reads its trajectory's documents minus the held-out ones (about 1% of them)
    assert training == [document for document in mixed if not is_held_out(document, 0.01)][:300]
    assert 1 <= sum(is_held_out(document, 0.01) for document in mixed) <= 15  # Binomial(600, 0.01): 6 +- 2.4
    # what the trainers' batches hold, and what the aux peer evaluates on
    trained_on = []
    for seed in (2, 3):
        batcher = task.batches(seed)
        trained_on += documents_in([batcher.next_batch(8, 256) for _ in range(8)])
    assert len(trained_on) >= 16 and not any(is_held_out(document, 0.01) for document in trained_on)
    batches = task.validation_batches(12)
    evaluated = documents_in(batches)
    assert evaluated and all(is_held_out(document, 0.01) for document in evaluated)
    again = tiny_task().validation_batches(12)  # another process's task: the same batches
    assert all(torch.equal(a[name], b[name]) for a, b in zip(batches, again) for name in a)
    assert [tuple(batch["input_ids"].shape) for batch in batches] == [(4, 64)] * 12


def test_split_fraction_zero_and_a_source_without_held_out_documents_fail_with_the_flag(tmp_path, monkeypatch):
    assert tiny_task().swarm_settings(CollaborationSettings())["validation_fraction"] == 0.01  # agreed swarm-wide
    with pytest.raises(ValueError, match=r"^--validation_fraction: is 0, so there are no held-out documents"):
        tiny_task(validation_fraction=0.0).validation_batches(1)
    assert next(tiny_task(validation_fraction=0.0).batches(1).documents)  # training reads everything
    (tmp_path / "one.txt").write_text("a single paragraph")
    monkeypatch.setattr(tasks.data, "MAX_DOCUMENTS_OUTSIDE_SPLIT", 50)
    source = make_text_source(TaskArguments(dataset=str(tmp_path / "*.txt"), validation_fraction=0.5))
    split = "validation" if not is_held_out("a single paragraph", 0.5) else "train"  # the split it is not in
    with pytest.raises(ValueError, match=rf"^--validation_fraction: 50 documents in a row fell outside the {split}"):
        next(source.documents(seed=0, split=split))


def test_evaluation_is_the_models_loss_on_the_held_out_batches():
    """evaluate() against the loss written out by hand (full logits, float64 cross-entropy), with dropout in the
    config: evaluation runs in eval mode and gives the model its mode back."""
    task = tiny_task()
    task.config.hidden_dropout_prob = 0.1
    model = task.build_model()
    batches = task.validation_batches(3)
    model.eval()
    with torch.no_grad():
        direct = [F.cross_entropy(model(batch["input_ids"]).logits[:, :-1].double().flatten(0, 1),
                                  batch["labels"][:, 1:].flatten()).item() for batch in batches]
    model.train()
    loss = evaluate(model, batches)
    assert model.training
    assert loss == pytest.approx(sum(direct) / len(direct), rel=1e-5, abs=1e-6)
    assert loss == evaluate(model, batches)  # no dropout, no state: the same value again
    assert 0 < loss and math.isfinite(loss)
    with pytest.raises(ValueError, match="at least one batch"):
        evaluate(model, [])


def test_evaluation_of_the_mlm_task_is_its_masked_lm_plus_sentence_order_loss():
    task = tiny_task(MLMTask)
    model = task.build_model().eval()
    batches = task.validation_batches(2)
    assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(batches, tiny_task(MLMTask).validation_batches(2)))
    with torch.no_grad():
        direct = []
        for batch in batches:
            output = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                           token_type_ids=batch["token_type_ids"])
            mlm = F.cross_entropy(output.prediction_logits.double().flatten(0, 1), batch["labels"].flatten(),
                                  ignore_index=-100)
            sop = F.cross_entropy(output.sop_logits.double(), batch["sentence_order_label"])
            direct.append((mlm + sop).item())
    assert evaluate(model, batches) == pytest.approx(sum(direct) / len(direct), rel=1e-5, abs=1e-6)


def stats(epoch: int, loss: float) -> SwarmStats:
    return SwarmStats(epoch=epoch, alive_peers=2, loss=loss, samples_per_second=10.0 + epoch, samples_in_epoch=16,
                      mini_steps=4, time=60.0 * epoch)


def test_history_keeps_validation_losses_beside_the_training_rows(tmp_path: Path):
    path = tmp_path / "swarm.jsonl"
    history = RunHistory(path, max_rows=10)
    rows = [stats(epoch, 5.0 - epoch / 2) for epoch in range(5)]
    evaluations = [Evaluation(2, 3.9, 150.0), Evaluation(4, 3.1, 250.0)]
    for row in rows[:3]:
        history.append(row)
    history.append(evaluations[0])
    for row in rows[3:]:
        history.append(row)
    history.append(evaluations[1])
    assert history.last_epoch == 4 and list(history.evaluations) == evaluations
    assert list(read_rows(path)) == rows and list(read_evaluations(path)) == evaluations
    assert json.loads(path.read_text().splitlines()[3]) == dict(epoch=2, validation_loss=3.9, time=150.0)
    reopened = RunHistory(path)
    assert list(reopened.rows) == rows and list(reopened.evaluations) == evaluations


def test_plot_draws_training_and_validation_loss(tmp_path: Path):
    rows = [stats(epoch, 5.0 - epoch / 2) for epoch in range(6)]
    evaluations = [Evaluation(2, 4.4, 150.0), Evaluation(4, 3.6, 270.0)]
    figure = redraw_plot(rows, tmp_path / "plot.png", title="run", evaluations=evaluations)
    training, validation = figure.axes[0].get_lines()
    assert list(training.get_ydata()) == [row.loss for row in rows]
    assert list(training.get_xdata()) == [float(epoch) for epoch in range(6)]  # minutes since the first row
    assert list(validation.get_ydata()) == [4.4, 3.6] and list(validation.get_xdata()) == [2.5, 4.5]
    assert [text.get_text() for text in figure.axes[0].get_legend().get_texts()] == [
        "training loss", "validation loss (checkpoints)"]
    assert_valid_png(tmp_path / "plot.png")
    without = redraw_plot(rows, tmp_path / "plot.png")
    assert len(without.axes[0].get_lines()) == 1 and without.axes[0].get_legend() is None


def test_wandb_logs_validation_loss_against_the_epoch(tmp_path: Path, wandb_offline: None):
    """A checkpoint's evaluation may come after rows of later epochs: it is logged anyway (wandb drops rows whose
    explicit step goes back), with its epoch, which is every chart's x axis."""
    from lean_transformer.swarm.monitoring.wandb_log import WandbLogger

    rng = random.Random(0)
    rows = [stats(epoch, rng.uniform(1, 5)) for epoch in range(4)]
    logger = WandbLogger(project="lean-test", run_name="aux", config={}, directory=str(tmp_path))
    for row in rows:
        logger.log(row)
    logger.log(Evaluation(2, 2.5, 0.0))
    logger.finish()
    logged = wait_for_wandb_history(tmp_path, rows=5)
    assert [(entry["epoch"], "loss" in entry, "validation_loss" in entry) for entry in logged] == [
        (0, True, False), (1, True, False), (2, True, False), (3, True, False), (2, False, True)]
    assert logged[-1]["validation_loss"] == 2.5
    assert [entry["loss"] for entry in logged[:4]] == pytest.approx([row.loss for row in rows], rel=1e-6)
    # the file as wandb's service process may leave it while writing: every cut reads as the rows written before it
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    for cut in range(len(data) + 1):
        partial = parse_wandb_history(data[:cut])
        assert partial == logged[:len(partial)], cut
