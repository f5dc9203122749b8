"""Parameter sharing counts parameters as designed, models never share storage, and save/load round-trips."""
from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForPreTraining

from lean_transformer import LeanAlbertForPreTraining, LeanGPTForCausalLM
from lean_transformer.modules.linear import SharedLinear


def count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_layer_groups_count_distinct_layers_only(gpt_config):
    grouped = LeanGPTForCausalLM(gpt_config(num_hidden_layers=8, num_hidden_groups=2, num_inner_groups=2))
    unshared = LeanGPTForCausalLM(gpt_config(num_hidden_layers=4))
    assert count(grouped) == count(unshared)
    assert grouped.transformer.encoder.layer_order() == [0, 1, 0, 1, 2, 3, 2, 3]


def test_shared_matrices_count(gpt_config):
    d, inner, r, sets, layers = 32, 48, 3, 2, 4
    model = LeanGPTForCausalLM(gpt_config(share_large_matrices=True, num_shared_matrices=sets, adapter_dim=r))
    shapes = [(d, 3 * d), (d, d), (d, inner), (inner, d)]  # (in, out) of qkv, attention out, ffn in, ffn out
    matrices = sets * sum(i * o for i, o in shapes)
    per_layer = sum(r * (i + o) + o for i, o in shapes) + 4 * d  # adapters, biases, two layer norms
    embeddings_and_final_norm = 61 * d + 2 * d
    assert count(model) == matrices + layers * per_layer + embeddings_and_final_norm
    shared = [m.shared for m in model.modules() if isinstance(m, SharedLinear)]
    assert len({id(s) for s in shared}) == 4 * sets


def test_equal_configs_share_no_storage(gpt_config):
    config = gpt_config(share_large_matrices=True, adapter_dim=2, num_hidden_groups=2)
    first, second = LeanGPTForCausalLM(config), LeanGPTForCausalLM(config)
    storages = lambda model: {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert not storages(first) & storages(second)
    shared_of = lambda model: {id(m.shared) for m in model.modules() if isinstance(m, SharedLinear)}
    assert not shared_of(first) & shared_of(second)
    with torch.no_grad():
        first.transformer.encoder.shared_matrices[0].qkv.weight.add_(1.0)
    assert not torch.equal(first.transformer.encoder.shared_matrices[0].qkv.weight,
                           second.transformer.encoder.shared_matrices[0].qkv.weight)


@pytest.mark.parametrize("kind", ["gpt", "albert"])
def test_save_load_round_trip(tmp_path, gpt_config, albert_config, kind):
    if kind == "gpt":
        config = gpt_config(share_large_matrices=True, adapter_dim=2, embedding_size=16, tie_word_embeddings=False)
        model, auto = LeanGPTForCausalLM(config), AutoModelForCausalLM
    else:
        config = albert_config(num_hidden_groups=2, embedding_size=16)
        model, auto = LeanAlbertForPreTraining(config), AutoModelForPreTraining
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.01)  # make every tensor differ from any fresh init
    model.save_pretrained(tmp_path)
    assert os.path.exists(tmp_path / "model.safetensors")
    assert type(AutoConfig.from_pretrained(tmp_path)) is type(config)
    loaded = auto.from_pretrained(tmp_path)
    assert type(loaded) is type(model)
    expected = model.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    # shared matrices are still shared by reference after loading
    for module in loaded.modules():
        if isinstance(module, SharedLinear):
            assert any(module.shared.weight is p for p in loaded.parameters())
    input_ids = torch.randint(0, config.vocab_size, (2, 8))
    model.eval(), loaded.eval()
    logits = lambda out: out.logits if kind == "gpt" else out.prediction_logits
    with torch.no_grad():
        torch.testing.assert_close(logits(loaded(input_ids)), logits(model(input_ids)), rtol=0, atol=0)
