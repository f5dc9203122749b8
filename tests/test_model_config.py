"""Invalid configs and runtime-option combinations fail early with a ValueError naming the field."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from lean_transformer import LeanGPTConfig, LeanGPTForCausalLM

BAD_CONFIGS = [
    # (overrides of the tiny config, regex the message must match: it names the field)
    # integers: type and range (a bool is not an integer, a float is not either)
    (dict(vocab_size=0), "vocab_size"),
    (dict(hidden_size=None), "hidden_size"),  # reported as hidden_size, not through its derived defaults
    (dict(hidden_size=32.0), "hidden_size"),
    (dict(num_hidden_layers=True), "num_hidden_layers"),
    (dict(num_attention_heads=0), "num_attention_heads"),
    (dict(embedding_size=-8), "embedding_size"),
    (dict(intermediate_size=-4), "intermediate_size"),
    (dict(max_position_embeddings="32"), "max_position_embeddings"),
    (dict(num_hidden_groups=0), "num_hidden_groups"),
    (dict(num_inner_groups=1.5), "num_inner_groups"),
    (dict(num_shared_matrices=0), "num_shared_matrices"),
    (dict(adapter_dim=-1), "adapter_dim"),
    (dict(lowrank_dim=True), "lowrank_dim"),
    # real numbers: type, sign, finiteness
    (dict(rotary_base=-1.0), "rotary_base"),
    (dict(rotary_base=float("nan")), "rotary_base"),
    (dict(layer_norm_eps=-1), "layer_norm_eps"),
    (dict(layer_norm_eps=0.0), "layer_norm_eps"),
    (dict(initializer_range=-0.02), "initializer_range"),
    (dict(hidden_dropout_prob=1.0), "hidden_dropout_prob"),
    (dict(hidden_dropout_prob=False), "hidden_dropout_prob"),
    (dict(attention_probs_dropout_prob=-0.1), "attention_probs_dropout_prob"),
    (dict(attention_probs_dropout_prob="0.1"), "attention_probs_dropout_prob"),
    # booleans
    (dict(reversible="yes"), "reversible"),
    (dict(tie_word_embeddings="no"), "tie_word_embeddings"),
    (dict(sandwich_norm=1), "sandwich_norm"),
    (dict(fp32_residual=None), "fp32_residual"),
    (dict(share_large_matrices=0), "share_large_matrices"),
    # special token ids: None or inside the vocabulary
    (dict(pad_token_id=61), "pad_token_id"),
    (dict(bos_token_id=-1), "bos_token_id"),
    (dict(eos_token_id="0"), "eos_token_id"),
    # choices
    (dict(hidden_act="tanh"), "hidden_act"),
    (dict(hidden_act=None), "hidden_act"),
    (dict(position_embedding_type="alibi"), "position_embedding_type"),
    # rules combining fields
    (dict(hidden_size=30, num_attention_heads=4), "hidden_size"),
    (dict(hidden_size=24, num_attention_heads=8), "rotary"),  # head_dim 3 cannot be rotated in pairs
    (dict(num_hidden_layers=4, num_hidden_groups=3), "num_hidden_groups"),
    (dict(num_hidden_layers=4, num_hidden_groups=2, num_inner_groups=4), "num_inner_groups"),
    (dict(adapter_dim=4), "adapter_dim"),
    (dict(num_shared_matrices=2), "num_shared_matrices"),  # without share_large_matrices
    (dict(share_large_matrices=True, num_hidden_groups=1, num_inner_groups=2, num_shared_matrices=3),
     "num_shared_matrices"),  # more sets than distinct layers
    (dict(lowrank_dim=4), "lowrank_dim"),
    # block-sparse layouts: fail at construction, not when the model is built
    (dict(weight_layout="no-such-layout"), "weight_layout"),
    (dict(weight_layout=64), "weight_layout"),
    (dict(weight_layout="pixelfly(block_size=0)"), "weight_layout.*block_size"),
    (dict(weight_layout="pixelfly(block_size=64)"), "weight_layout.*does not divide hidden_size"),
    (dict(hidden_size=64, intermediate_size=48, weight_layout="pixelfly(block_size=32)"),
     "weight_layout.*does not divide intermediate_size"),
    (dict(hidden_size=64, intermediate_size=96, weight_layout="pixelfly(block_size=16)"),
     "weight_layout.*multiple"),  # 6x4 blocks: pixelfly cannot tile the feed-forward matrices
]


@pytest.mark.parametrize("overrides, field", BAD_CONFIGS, ids=[f"{field}-{i}" for i, (_, field) in
                                                               enumerate(BAD_CONFIGS)])
def test_bad_config_raises(gpt_config, overrides, field):
    with pytest.raises(ValueError, match=field):
        gpt_config(**overrides)


@pytest.mark.parametrize("overrides, field", [(dict(type_vocab_size=-1), "type_vocab_size"),
                                              (dict(type_vocab_size=2.0), "type_vocab_size"),
                                              (dict(classifier_dropout_prob=1.5), "classifier_dropout_prob"),
                                              (dict(classifier_dropout_prob=None), "classifier_dropout_prob"),
                                              (dict(num_hidden_groups=3), "num_hidden_groups")])
def test_bad_albert_config_raises(albert_config, overrides, field):
    with pytest.raises(ValueError, match=field):
        albert_config(**overrides)


def test_good_config_builds(gpt_config):
    assert LeanGPTForCausalLM(gpt_config(num_hidden_groups=2, num_inner_groups=2, share_large_matrices=True,
                                         adapter_dim=2, hidden_act="geglu")) is not None


# edge values that are valid: integers where floats are expected (as JSON writes 10000.0), zero dropout, token ids
# at the ends of the vocabulary, sharing with as many matrix sets as distinct layers, a layout that tiles them all
EDGE_VALUES = dict(rotary_base=10_000, layer_norm_eps=1, hidden_dropout_prob=0, tie_word_embeddings=False,
                   pad_token_id=0, eos_token_id=60, bos_token_id=None, num_hidden_groups=2, num_inner_groups=2,
                   share_large_matrices=True, num_shared_matrices=4, adapter_dim=2, hidden_act="swiglu",
                   intermediate_size=64, weight_layout="pixelfly(block_size=8)", lowrank_dim=2)


@pytest.mark.parametrize("factory", ["gpt_config", "albert_config"])
def test_valid_config_round_trips(request, factory, tmp_path):
    config = request.getfixturevalue(factory)(**EDGE_VALUES)
    config.save_pretrained(tmp_path)
    loaded = type(config).from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()
    assert loaded.tie_word_embeddings is False and loaded.pad_token_id == 0


def test_bad_saved_config_fails_on_load(gpt_config, tmp_path):
    gpt_config().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "layer_norm_eps": -1.0}))
    with pytest.raises(ValueError, match="layer_norm_eps"):
        LeanGPTConfig.from_pretrained(tmp_path)


BAD_OPTIONS = [
    (dict(reversible=True), dict(gradient_checkpointing=True), "gradient_checkpointing"),
    (dict(reversible=True), dict(gradient_checkpointing=2), "gradient_checkpointing"),
    (dict(), dict(gradient_checkpointing=0), "gradient_checkpointing"),
    (dict(), dict(gradient_checkpointing=5), "gradient_checkpointing"),
    (dict(), dict(gradient_checkpointing="yes"), "gradient_checkpointing"),
    (dict(), dict(ffn_custom_grad=1), "ffn_custom_grad"),
    (dict(), dict(checkpoint_attention_core=None), "checkpoint_attention_core"),
    (dict(), dict(preserve_rng_state="no"), "preserve_rng_state"),
]


@pytest.mark.parametrize("config_overrides, options, field", BAD_OPTIONS)
def test_bad_runtime_options_raise(gpt_config, config_overrides, options, field):
    model = LeanGPTForCausalLM(gpt_config(**config_overrides))
    with pytest.raises(ValueError, match=field):
        model.set_optimizations(**options)


def test_runtime_options_are_keyword_only(gpt_config):
    with pytest.raises(TypeError):
        LeanGPTForCausalLM(gpt_config()).set_optimizations(True)


def test_too_long_input_raises(gpt_config):
    model = LeanGPTForCausalLM(gpt_config(max_position_embeddings=8, position_embedding_type="absolute"))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("overrides", [dict(layer_norm_eps=-1.0), dict(reversible="yes")])
def test_bad_override_fails_on_load(gpt_config, tmp_path, overrides):
    """from_pretrained applies keyword overrides after constructing the config: they are validated too."""
    gpt_config().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=next(iter(overrides))):
        AutoConfig.from_pretrained(tmp_path, **overrides)
    assert LeanGPTConfig.from_pretrained(tmp_path, reversible=True).reversible is True
