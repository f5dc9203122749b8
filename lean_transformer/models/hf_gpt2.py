"""Conversion between LeanGPT and transformers' GPT-2, both ways: configs (each side rejects, by field name, what
the other cannot express) and weights.

GPT-2 stores its projections as ``Conv1D`` with [in, out] weights; ours are [out, in]. The fused c_attn output is
ordered (q, k, v), each head-major, exactly like our ``qkv`` projection.
"""
from __future__ import annotations

import torch
import transformers
from transformers.pytorch_utils import Conv1D

from lean_transformer.config import LeanGPTConfig

_GPT2_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu", "relu": "relu",
                     "silu": "silu", "swish": "silu"}


def config_from_gpt2(hf_config: transformers.GPT2Config) -> LeanGPTConfig:
    """The LeanGPT architecture computing the same function as a GPT-2 config, or ValueError naming the field
    that LeanGPT cannot express."""
    unsupported = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                   "reorder_and_upcast_attn": False, "add_cross_attention": False}
    for name, expected in unsupported.items():
        if getattr(hf_config, name, expected) != expected:
            raise ValueError(f"GPT-2 config field {name}={getattr(hf_config, name)!r} is not supported "
                             f"(LeanGPT computes {name}={expected})")
    if hf_config.activation_function not in _GPT2_ACTIVATIONS:
        raise ValueError(f"GPT-2 config field activation_function={hf_config.activation_function!r} is not "
                         f"supported; use one of {sorted(_GPT2_ACTIVATIONS)}")
    if hf_config.embd_pdrop != hf_config.resid_pdrop:
        raise ValueError(f"GPT-2 config fields embd_pdrop ({hf_config.embd_pdrop}) and resid_pdrop "
                         f"({hf_config.resid_pdrop}) must be equal: LeanGPT uses hidden_dropout_prob for both")
    return LeanGPTConfig(
        vocab_size=hf_config.vocab_size, hidden_size=hf_config.n_embd, num_hidden_layers=hf_config.n_layer,
        num_attention_heads=hf_config.n_head, intermediate_size=hf_config.n_inner or 4 * hf_config.n_embd,
        hidden_act=_GPT2_ACTIVATIONS[hf_config.activation_function], hidden_dropout_prob=hf_config.resid_pdrop,
        attention_probs_dropout_prob=hf_config.attn_pdrop, max_position_embeddings=hf_config.n_positions,
        position_embedding_type="absolute", layer_norm_eps=hf_config.layer_norm_epsilon,
        initializer_range=hf_config.initializer_range, tie_word_embeddings=hf_config.tie_word_embeddings,
        bos_token_id=hf_config.bos_token_id, eos_token_id=hf_config.eos_token_id,
        pad_token_id=hf_config.pad_token_id)


def gpt2_config_from_lean(config: LeanGPTConfig) -> transformers.GPT2Config:
    """The GPT-2 config computing the same function as a LeanGPT config, or ValueError naming the first LeanGPT
    field that GPT-2 cannot express."""
    # (field, the value GPT-2 computes, why): checked in this order, the first mismatch is reported
    required = [
        ("position_embedding_type", "absolute", "GPT-2 has learned absolute positions only"),
        ("sandwich_norm", False, "GPT-2 is pre-norm"),
        ("fp32_residual", False, "GPT-2 keeps its residual stream in the model's dtype"),
        ("reversible", False, "GPT-2 has no reversible coupling"),
        ("weight_layout", None, "GPT-2 has dense weights"),
        ("lowrank_dim", 0, "GPT-2 has no low-rank terms"),
        ("num_hidden_groups", config.num_hidden_layers, "GPT-2 shares no layers"),
        ("num_inner_groups", 1, "GPT-2 shares no layers"),
        ("share_large_matrices", False, "GPT-2 shares no matrices"),
        ("adapter_dim", 0, "GPT-2 has no adapters"),
        ("embedding_size", config.hidden_size, "GPT-2's embeddings are not factorized"),
    ]
    for name, expected, why in required:
        if getattr(config, name) != expected:
            raise ValueError(f"config field {name}={getattr(config, name)!r} cannot be exported to GPT-2 "
                             f"(needs {expected!r}: {why})")
    if config.hidden_act not in ("gelu_new", "gelu", "relu", "silu"):
        raise ValueError(f"config field hidden_act={config.hidden_act!r} cannot be exported to GPT-2 (gated "
                         f"activations are not supported)")
    return transformers.GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.max_position_embeddings, n_embd=config.hidden_size,
        n_layer=config.num_hidden_layers, n_head=config.num_attention_heads, n_inner=config.intermediate_size,
        activation_function=config.hidden_act, resid_pdrop=config.hidden_dropout_prob,
        embd_pdrop=config.hidden_dropout_prob, attn_pdrop=config.attention_probs_dropout_prob,
        layer_norm_epsilon=config.layer_norm_eps, initializer_range=config.initializer_range,
        tie_word_embeddings=config.tie_word_embeddings, bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)


@torch.no_grad()
def copy_gpt2_weights(hf_model: transformers.GPT2LMHeadModel, model: torch.nn.Module, to_lean: bool) -> None:
    """Copy every weight from GPT-2 to a ``LeanGPTForCausalLM`` (``to_lean``) or back; the architectures must already
    match."""
    source, target = hf_model.transformer, model.transformer
    pairs = [(source.wte, target.embeddings.word_embeddings), (source.wpe, target.embeddings.position_embeddings),
             (source.ln_f, target.encoder.final_norm)]
    for block, layer in zip(source.h, target.encoder.layers, strict=True):
        pairs += [(block.ln_1, layer.attention.pre_norm), (block.ln_2, layer.ffn.pre_norm),
                  (block.attn.c_attn, layer.attention.qkv), (block.attn.c_proj, layer.attention.out_proj),
                  (block.mlp.c_fc, layer.ffn.dense_in), (block.mlp.c_proj, layer.ffn.dense_out)]
    for hf_module, lean_module in pairs:
        transposed = isinstance(hf_module, Conv1D)
        for name in ("weight", "bias"):
            hf_tensor = getattr(hf_module, name, None)
            if hf_tensor is None:
                continue
            hf_value = hf_tensor.t() if transposed and name == "weight" else hf_tensor
            lean_tensor = getattr(lean_module, name)
            if to_lean:
                lean_tensor.copy_(hf_value)
            else:
                hf_value.copy_(lean_tensor)
    if model.lm_head.weight is not None:  # untied; tied heads are the word embeddings, copied above
        (model.lm_head.weight.copy_(hf_model.lm_head.weight) if to_lean
         else hf_model.lm_head.weight.copy_(model.lm_head.weight))
