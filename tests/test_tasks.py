"""Tasks without a swarm: the embedded corpus and its entropy floor, data sources, tokenizers, batches (packing,
whole-word masking, sentence order), param groups and schedules."""
from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from arguments import TaskArguments, TrainingSettings
from tasks import get_task
from tasks.causal_lm import PackedBatcher
from tasks.data import FileSource, HuggingFaceSource, make_text_source
from lean_transformer.data.markov import MarkovCorpus
from tasks.mlm import IGNORE_INDEX, SentencePairBatcher
from tasks.schedules import learning_rate_factor, sequence_length
from tasks.tokenizer import ByteTokenizer, HFTokenizer


@pytest.fixture(scope="module")
def corpus() -> MarkovCorpus:
    return MarkovCorpus.generate(seed=0)


def test_markov_stationary_distribution(corpus):
    pi = corpus.stationary_distribution
    assert pi.min() > 0 and math.isclose(pi.sum(), 1.0)
    np.testing.assert_allclose(pi @ corpus.transition_matrix(), pi, rtol=0, atol=1e-12)


def test_markov_entropy_rate_matches_a_long_sample(corpus):
    """The exact entropy rate equals the average surprise along one long trajectory (ergodic theorem)."""
    states = corpus.sample_states(np.random.default_rng(1), start=0, length=200_000)
    empirical = -corpus.log_likelihood(states) / (len(states) - 1)
    assert empirical == pytest.approx(corpus.entropy_per_state, rel=0.01)
    frequencies = np.bincount(states, minlength=corpus.num_states) / len(states)
    assert 0.5 * np.abs(frequencies - corpus.stationary_distribution).sum() < 0.03


def test_markov_entropy_per_byte_is_the_floor_of_a_byte_level_model(corpus):
    text = "".join(document for _, document in zip(range(200), corpus.documents(seed=2)))
    num_states = len(re.findall(r"[a-z]+|\.", text))
    assert len(text.encode()) / num_states == pytest.approx(corpus.bytes_per_state, rel=0.02)
    assert corpus.entropy_per_byte == pytest.approx(corpus.entropy_per_state / corpus.bytes_per_state)
    assert 0.05 < corpus.entropy_per_byte < math.log(256)


def test_markov_corpus_is_determined_by_its_seed(corpus):
    again, other = MarkovCorpus.generate(seed=0), MarkovCorpus.generate(seed=1)
    assert again.words == corpus.words and all(map(np.array_equal, again.successors, corpus.successors))
    assert other.words != corpus.words
    assert next(corpus.documents(seed=5)) == next(again.documents(seed=5)) != next(corpus.documents(seed=6))


def test_byte_tokenizer_round_trip_and_words():
    tok = ByteTokenizer()
    text = "naïve  bako\ttilu."
    assert tok.decode(tok.encode(text)) == text
    ids, word_ids = tok.encode_words("ab  cd e")
    assert ids == list(b"ab  cd e")
    assert word_ids == [0, 0, -1, -1, 1, 1, -1, 2]
    assert len({tok.pad_token_id, tok.eos_token_id, tok.mask_token_id, tok.cls_token_id, tok.sep_token_id}) == 5
    assert max(tok.pad_token_id, tok.sep_token_id) < len(tok)


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory, corpus) -> Path:
    """A word-level Hugging Face tokenizer trained on the embedded corpus and saved locally (no hub access)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    texts = [document for _, document in zip(range(100), corpus.documents(seed=0))]
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=specials))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]",
                                      cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    path = tmp_path_factory.mktemp("tokenizer")
    wrapped.save_pretrained(path)
    return path


def test_hf_tokenizer_from_a_local_directory(hf_tokenizer_dir):
    tok = HFTokenizer(str(hf_tokenizer_dir))
    ids, word_ids = tok.encode_words("le liludu lu.")
    assert len(ids) == 3 and word_ids == [0, 1, 2]
    assert tok.decode(ids) == "le liludu lu."
    assert tok.eos_token_id == tok.sep_token_id  # a BERT-like tokenizer has no eos: documents are split by [SEP]
    with pytest.raises(FileNotFoundError, match="--tokenizer_path"):
        HFTokenizer(str(hf_tokenizer_dir / "missing"))


def test_hf_tokenizer_saves_as_it_was_loaded(hf_tokenizer_dir, tmp_path):
    """What goes into every checkpoint with --tokenizer_path: the same tokenizer, loadable on its own."""
    ours = HFTokenizer(str(hf_tokenizer_dir))
    ours.save_pretrained(str(tmp_path))
    loaded = HFTokenizer(str(tmp_path))
    assert loaded.fingerprint() == ours.fingerprint()
    for text in ("le liludu lu.", "unknown words here", ""):
        assert loaded.encode(text) == ours.encode(text)


def documents_of_numbered_sentences():
    """Documents whose sentences say where they are: 'd3s0 w w. d3s1 w w w. ...'."""
    rng = np.random.default_rng(0)
    for doc in range(10**6):
        yield " ".join(f"d{doc}s{i}" + " w" * int(rng.integers(1, 6)) + "." for i in range(int(rng.integers(2, 8))))


def test_causal_batches_pack_documents_without_padding():
    tok = ByteTokenizer()
    batch = PackedBatcher(iter(["ab", "cde"] * 100), tok).next_batch(batch_size=2, sequence_length=6)
    assert batch["input_ids"].tolist() == [[97, 98, tok.eos_token_id, 99, 100, 101], [tok.eos_token_id, 97, 98,
                                                                                        tok.eos_token_id, 99, 100]]
    assert torch.equal(batch["labels"], batch["input_ids"]) and "attention_mask" not in batch  # unmasked attention


def test_mlm_examples_have_two_segments_in_or_out_of_order():
    tok = ByteTokenizer()
    batcher = SentencePairBatcher(documents_of_numbered_sentences(), tok, np.random.default_rng(0), 8)
    labels = []
    for _ in range(200):
        input_ids, word_ids, token_type_ids, swapped = batcher._example(sequence_length=96)
        assert input_ids[0] == tok.cls_token_id and input_ids[-1] == tok.sep_token_id
        (middle,) = np.flatnonzero(input_ids[1:-1] == tok.sep_token_id) + 1
        assert (token_type_ids[:middle + 1] == 0).all() and (token_type_ids[middle + 1:] == 1).all()
        assert (word_ids[[0, middle, -1]] == -1).all() and len(input_ids) <= 96
        first, second = (tok.decode(part.tolist()) for part in (input_ids[1:middle], input_ids[middle + 1:-1]))
        doc_first, doc_second = (re.findall(r"d(\d+)s(\d+)", text) for text in (first, second))
        if doc_first and doc_second:  # both segments kept a sentence marker after trimming
            assert doc_first[0][0] == doc_second[0][0]  # one document
            in_order = int(doc_first[-1][1]) < int(doc_second[0][1])
            assert in_order == (not swapped)
        labels.append(swapped)
    assert 0.35 < np.mean(labels) < 0.65


def test_mlm_masks_whole_words_about_15_percent_with_80_10_10():
    tok = ByteTokenizer()
    batcher = SentencePairBatcher(MarkovCorpus.generate(0).documents(seed=1), tok, np.random.default_rng(0), 8)
    picked = replaced_by_mask = kept = candidates = 0
    for _ in range(300):
        input_ids, word_ids, _, _ = batcher._example(sequence_length=128)
        masked, labels = batcher._mask_whole_words(input_ids, word_ids)
        is_picked = labels != IGNORE_INDEX
        for word in np.unique(word_ids[is_picked]):
            assert word >= 0 and is_picked[word_ids == word].all()  # whole words only
        assert (labels[is_picked] == input_ids[is_picked]).all()
        assert (masked[~is_picked] == input_ids[~is_picked]).all()
        picked += is_picked.sum()
        candidates += (word_ids >= 0).sum()
        replaced_by_mask += (masked[is_picked] == tok.mask_token_id).sum()
        kept += (masked[is_picked] == input_ids[is_picked]).sum()
    assert 0.12 < picked / candidates <= 0.15
    assert replaced_by_mask / picked == pytest.approx(0.8, abs=0.04)
    assert kept / picked == pytest.approx(0.1, abs=0.04)  # (plus the rare random replacement equal to the original)


def test_mlm_batches_are_padded_to_a_multiple():
    task = get_task("mlm")(TaskArguments(task="mlm"), TrainingSettings(pad_to_multiple_of=8))
    batch = task.batches(seed=0).next_batch(batch_size=4, sequence_length=100)
    length = batch["input_ids"].shape[1]
    assert length % 8 == 0 or length == 100
    assert ((batch["input_ids"] == task.tokenizer.pad_token_id) == (batch["attention_mask"] == 0)).all()
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()
    assert batch["sentence_order_label"].shape == (4,)


@pytest.mark.parametrize("name", ["causal_lm", "mlm"])
def test_tiny_models_train_on_their_batches(name):
    task = get_task(name)(TaskArguments(task=name), TrainingSettings())
    model = task.build_model()
    assert model.config.vocab_size == 264 >= len(task.tokenizer)
    batch = task.batches(seed=0).next_batch(batch_size=4, sequence_length=64)
    loss = model(**batch).loss
    uniform = math.log(model.config.vocab_size) + (math.log(2) if name == "mlm" else 0.0)
    assert loss.item() == pytest.approx(uniform, abs=0.5)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_models_are_initialized_identically_on_every_peer():
    task = get_task("causal_lm")(TaskArguments(), TrainingSettings(seed=3))
    first, second = task.build_model(), task.build_model()
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))


def test_peers_get_different_data():
    task = get_task("causal_lm")(TaskArguments(), TrainingSettings())
    a, b = (task.batches(seed=seed).next_batch(2, 32)["input_ids"] for seed in (1, 2))
    assert not torch.equal(a, b)
    assert torch.equal(a, task.batches(seed=1).next_batch(2, 32)["input_ids"])


def test_param_groups_exempt_biases_and_layernorm_weights_from_weight_decay():
    task = get_task("causal_lm")(TaskArguments(), TrainingSettings(weight_decay=0.05))
    model = task.build_model()
    names = {id(param): name for name, param in model.named_parameters()}
    decay, no_decay = task.param_groups(model)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert no_decay_names == {name for name in names.values() if name.endswith("bias") or "norm" in name}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()` before")
def test_optimizer_and_scheduler_factories():
    training = TrainingSettings(learning_rate=0.01, warmup_steps=2, total_steps=10, clamp_value=5.0)
    task = get_task("causal_lm")(TaskArguments(), training)
    model = task.build_model()
    optimizer = task.optimizer_factory()(task.param_groups(model))
    from lean_transformer.optim import CPULAMB8Bit

    assert isinstance(optimizer, CPULAMB8Bit) and optimizer.max_grad_norm == training.max_grad_norm
    assert optimizer.param_groups[0]["clamp_value"] == 5.0
    scheduler = task.scheduler_factory()(optimizer)
    lrs = []
    for _ in range(11):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    assert lrs[:4] == pytest.approx([0.005, 0.01, 0.01, 0.01 * 7 / 8]) and lrs[10] == 0.0


def test_learning_rate_schedules():
    assert learning_rate_factor(0, 4, 100) == 0.25 and learning_rate_factor(3, 4, 100) == 1.0
    assert learning_rate_factor(52, 4, 100) == pytest.approx(0.5)
    assert learning_rate_factor(52, 4, 100, "cosine") == pytest.approx(0.5)
    assert learning_rate_factor(28, 4, 100, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert learning_rate_factor(100, 4, 100) == 0.0 == learning_rate_factor(150, 4, 100, "cosine")
    with pytest.raises(ValueError, match="lr_schedule"):
        learning_rate_factor(10, 4, 100, "exponential")


def test_sequence_length_warmup():
    lengths = [sequence_length(epoch, 32, 128, 10, 8) for epoch in range(15)]
    assert lengths[0] == 32 and lengths[10:] == [128] * 5
    assert all(length % 8 == 0 for length in lengths) and lengths == sorted(lengths)
    assert sequence_length(3, 32, 128, 0, 8) == 128


def test_file_source_reads_paragraphs_shuffled_per_peer(tmp_path):
    for i in range(3):
        (tmp_path / f"part{i}.txt").write_text("\n\n".join(f"file {i} paragraph {j}\ncontinued" for j in range(20)))
    source = make_text_source(TaskArguments(dataset=str(tmp_path / "*.txt"), shuffle_buffer_size=16))
    assert isinstance(source, FileSource) and len(source.files) == 3
    first, second = ([document for _, document in zip(range(300), source.all_documents(seed))] for seed in (1, 2))
    expected = {f"file {i} paragraph {j} continued" for i in range(3) for j in range(20)}
    for documents in (first, second):  # five passes over the 60 paragraphs, mixed across pass boundaries
        counts = Counter(documents)
        assert set(counts) == expected and 3 <= min(counts.values()) <= max(counts.values()) <= 7
    assert first[:60] != second[:60]  # the order depends on the peer
    with pytest.raises(FileNotFoundError, match="--dataset: no files match"):
        make_text_source(TaskArguments(dataset=str(tmp_path / "*.json")))
    (tmp_path / "blank.md").write_text(" \n\n  \n")
    with pytest.raises(ValueError, match="--dataset: .* hold no text"):
        make_text_source(TaskArguments(dataset=str(tmp_path / "*.md")))


def test_hugging_face_source_streams_a_local_dataset(tmp_path):
    """hf:NAME goes through datasets.load_dataset(streaming=True); a local data directory exercises it offline."""
    (tmp_path / "train.jsonl").write_text("\n".join(f'{{"text": "document {i}", "id": {i}}}' for i in range(50)))
    source = make_text_source(TaskArguments(dataset=f"hf:{tmp_path}", shuffle_buffer_size=8))
    assert isinstance(source, HuggingFaceSource)
    documents = [document for _, document in zip(range(100), source.all_documents(seed=3))]
    assert set(documents) == {f"document {i}" for i in range(50)}  # two passes
    assert documents[:50] != [f"document {i}" for i in range(50)]
    with pytest.raises(ValueError, match="--dataset_text_field"):
        make_text_source(TaskArguments(dataset=f"hf:{tmp_path}", dataset_text_field="body"))


def test_config_follows_the_tokenizer_and_rejects_bad_files(tmp_path, hf_tokenizer_dir):
    task = get_task("mlm")(TaskArguments(task="mlm", tokenizer_path=str(hf_tokenizer_dir)), TrainingSettings())
    assert task.config.vocab_size % 8 == 0 and 0 <= task.config.vocab_size - len(task.tokenizer) < 8
    assert task.config.pad_token_id == task.tokenizer.pad_token_id
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="--model_config_path"):
        get_task("causal_lm")(TaskArguments(model_config_path=str(tmp_path / "broken.json")), TrainingSettings())
    (tmp_path / "odd.json").write_text('{"hidden_size": 30, "num_attention_heads": 4}')
    with pytest.raises(ValueError, match="--model_config_path.*hidden_size"):
        get_task("causal_lm")(TaskArguments(model_config_path=str(tmp_path / "odd.json")), TrainingSettings())
