"""LeanGPTForCausalLM.from_hf_gpt2 computes the same function as a randomly initialised GPT2LMHeadModel."""
from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lean_transformer import LeanGPTForCausalLM

GPT2_TINY = dict(vocab_size=97, n_positions=32, n_embd=32, n_layer=3, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
TOL = dict(rtol=1e-4, atol=1e-5)


def hf_gpt2(**overrides) -> GPT2LMHeadModel:
    model = GPT2LMHeadModel(GPT2Config(**{**GPT2_TINY, **overrides}))
    with torch.no_grad():  # GPT-2 initializes biases and norms trivially: randomize them so the mapping is tested
        for name, param in model.named_parameters():
            if "ln_" in name or "bias" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.mark.parametrize("overrides", [dict(), dict(tie_word_embeddings=False, activation_function="relu",
                                                    n_inner=40)])
def test_logits_and_gradients_match(overrides):
    hf = hf_gpt2(**overrides).train()
    lean = LeanGPTForCausalLM.from_hf_gpt2(hf).train()
    input_ids = torch.randint(0, 97, (2, 16))
    hf_out, lean_out = hf(input_ids, labels=input_ids), lean(input_ids, labels=input_ids)
    assert (hf_out.logits - lean_out.logits).abs().max() <= 1e-5
    torch.testing.assert_close(lean_out.loss, hf_out.loss, **TOL)
    hf_out.loss.backward()
    lean_out.loss.backward()
    for block, layer in zip(hf.transformer.h, lean.transformer.encoder.layers):
        pairs = [(block.attn.c_attn, layer.attention.qkv), (block.attn.c_proj, layer.attention.out_proj),
                 (block.mlp.c_fc, layer.ffn.dense_in), (block.mlp.c_proj, layer.ffn.dense_out)]
        for hf_module, lean_module in pairs:
            torch.testing.assert_close(lean_module.weight.grad, hf_module.weight.grad.t(), **TOL)
            torch.testing.assert_close(lean_module.bias.grad, hf_module.bias.grad, **TOL)
        torch.testing.assert_close(layer.attention.pre_norm.weight.grad, block.ln_1.weight.grad, **TOL)
        torch.testing.assert_close(layer.ffn.pre_norm.bias.grad, block.ln_2.bias.grad, **TOL)
    embeddings = lean.transformer.embeddings
    torch.testing.assert_close(embeddings.word_embeddings.weight.grad, hf.transformer.wte.weight.grad, **TOL)
    torch.testing.assert_close(embeddings.position_embeddings.weight.grad, hf.transformer.wpe.weight.grad, **TOL)


def test_padding_mask_matches():
    hf = hf_gpt2().eval()
    lean = LeanGPTForCausalLM.from_hf_gpt2(hf).eval()
    input_ids = torch.randint(0, 97, (2, 16))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, 11:] = 0
    with torch.no_grad():
        hf_logits = hf(input_ids, attention_mask=attention_mask).logits
        lean_logits = lean(input_ids, attention_mask=attention_mask).logits
    valid = attention_mask.bool()
    assert (hf_logits[valid] - lean_logits[valid]).abs().max() <= 1e-5


@pytest.mark.parametrize("field, value", [("scale_attn_by_inverse_layer_idx", True),
                                          ("reorder_and_upcast_attn", True),
                                          ("activation_function", "tanh"), ("embd_pdrop", 0.3)])
def test_unsupported_gpt2_configs_raise(field, value):
    with pytest.raises(ValueError, match=field):
        LeanGPTForCausalLM.from_hf_gpt2(hf_gpt2(**{field: value}))


@pytest.mark.parametrize("overrides", [dict(), dict(tie_word_embeddings=False, activation_function="relu",
                                                    n_inner=40)])
def test_export_round_trip(overrides):
    """GPT-2 -> LeanGPT -> GPT-2 gives back every weight, and a LeanGPT's export computes the same logits."""
    hf = hf_gpt2(**overrides).eval()
    lean = LeanGPTForCausalLM.from_hf_gpt2(hf).eval()
    exported = lean.to_hf_gpt2().eval()
    assert exported.state_dict().keys() == hf.state_dict().keys()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name
    input_ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        assert (exported(input_ids).logits - lean(input_ids).logits).abs().max() <= 1e-5


def test_export_of_a_trained_lean_model(gpt_config):
    """A LeanGPT built and trained as LeanGPT (not converted from GPT-2) exports with the same logits."""
    config = gpt_config(position_embedding_type="absolute", hidden_act="gelu", tie_word_embeddings=False)
    lean = LeanGPTForCausalLM(config)
    with torch.no_grad():
        for param in lean.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    exported = lean.to_hf_gpt2().eval()
    input_ids = torch.randint(0, config.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids).logits, lean.eval()(input_ids).logits, **TOL)
    assert LeanGPTForCausalLM.from_hf_gpt2(exported).config.hidden_act == "gelu"


@pytest.mark.parametrize("field, value", [("position_embedding_type", "rotary"), ("hidden_act", "swiglu"),
                                          ("sandwich_norm", True), ("fp32_residual", True), ("reversible", True),
                                          ("weight_layout", "pixelfly(block_size=8)"), ("num_hidden_groups", 2),
                                          ("share_large_matrices", True),
                                          ("embedding_size", 16)])
def test_export_rejects_what_gpt2_cannot_express(gpt_config, field, value):
    config = gpt_config(**{"position_embedding_type": "absolute", "intermediate_size": 64, field: value})
    with pytest.raises(ValueError, match=f"config field {field}="):
        LeanGPTForCausalLM(config).to_hf_gpt2()
