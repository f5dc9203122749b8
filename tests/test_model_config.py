"""Invalid configs and runtime-option combinations fail early with a ValueError naming the field."""
from __future__ import annotations

import pytest
import torch

from lean_transformer import LeanGPTForCausalLM

BAD_CONFIGS = [
    (dict(hidden_size=30, num_attention_heads=4), "hidden_size"),
    (dict(hidden_size=24, num_attention_heads=8), "rotary"),  # head_dim 3 cannot be rotated in pairs
    (dict(hidden_act="tanh"), "hidden_act"),
    (dict(position_embedding_type="alibi"), "position_embedding_type"),
    (dict(num_hidden_layers=4, num_hidden_groups=3), "num_hidden_groups"),
    (dict(num_hidden_layers=4, num_hidden_groups=2, num_inner_groups=4), "num_inner_groups"),
    (dict(adapter_dim=4), "adapter_dim"),
    (dict(lowrank_dim=4), "lowrank_dim"),
    (dict(weight_layout="no-such-layout"), "weight_layout"),
    (dict(hidden_dropout_prob=1.0), "hidden_dropout_prob"),
    (dict(attention_probs_dropout_prob=-0.1), "attention_probs_dropout_prob"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(intermediate_size=-4), "intermediate_size"),
    (dict(num_shared_matrices=0), "num_shared_matrices"),
]


@pytest.mark.parametrize("overrides, field", BAD_CONFIGS, ids=[field for _, field in BAD_CONFIGS])
def test_bad_config_raises(gpt_config, overrides, field):
    with pytest.raises(ValueError, match=field):
        gpt_config(**overrides)


@pytest.mark.parametrize("overrides, field", [(dict(type_vocab_size=-1), "type_vocab_size"),
                                              (dict(classifier_dropout_prob=1.5), "classifier_dropout_prob"),
                                              (dict(num_hidden_groups=3), "num_hidden_groups")])
def test_bad_albert_config_raises(albert_config, overrides, field):
    with pytest.raises(ValueError, match=field):
        albert_config(**overrides)


def test_good_config_builds(gpt_config):
    assert LeanGPTForCausalLM(gpt_config(num_hidden_groups=2, num_inner_groups=2, share_large_matrices=True,
                                         adapter_dim=2, hidden_act="geglu")) is not None


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
