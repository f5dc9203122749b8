"""LeanGPT: a causal language model on the shared body."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import transformers
from torch import Tensor
from transformers.modeling_outputs import CausalLMOutput

from lean_transformer.config import LeanGPTConfig
from lean_transformer.models.base import LeanPreTrainedModel, LeanTransformerModel
from lean_transformer.modules.embeddings import LeanLMHead


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Next-token cross-entropy: position t predicts labels[t + 1]; label -100 is ignored."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


_GPT2_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu", "relu": "relu",
                     "silu": "silu", "swish": "silu"}


def _config_from_gpt2(hf_config) -> LeanGPTConfig:
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


class LeanGPTForCausalLM(LeanPreTrainedModel):
    config_class = LeanGPTConfig

    def __init__(self, config: LeanGPTConfig):
        super().__init__(config)
        self.transformer = LeanTransformerModel(config)
        self.lm_head = LeanLMHead(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.get_input_embeddings()

    def set_input_embeddings(self, value) -> None:
        self.transformer.set_input_embeddings(value)

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, labels: Optional[Tensor] = None,
                return_logits: bool = True, **unused) -> CausalLMOutput:
        """:param labels: [batch, seq] token ids (-100: ignored); position t predicts labels[t + 1].
        :param return_logits: False (needs labels) computes the loss from the hidden states a chunk of tokens at a
            time (``modules/fused_loss.py``), so the full logits never exist, and returns ``logits=None``."""
        hidden = self.transformer(input_ids, attention_mask, causal=True)
        embeddings = self.transformer.embeddings.word_embeddings.weight
        if not return_logits:
            if labels is None:
                raise ValueError("return_logits=False needs labels: the loss is all such a call returns")
            return CausalLMOutput(loss=self.lm_head.loss(hidden[:, :-1], embeddings, labels[:, 1:]), logits=None)
        logits = self.lm_head(hidden, embeddings)
        loss = causal_lm_loss(logits, labels) if labels is not None else None
        return CausalLMOutput(loss=loss, logits=logits)

    @classmethod
    @torch.no_grad()
    def from_hf_gpt2(cls, hf_model: "transformers.GPT2LMHeadModel") -> "LeanGPTForCausalLM":
        """A LeanGPT computing the same function as ``hf_model`` (a ``transformers.GPT2LMHeadModel``), in float32.

        GPT-2 stores its projections as ``Conv1D`` with [in, out] weights; ours are [out, in]. The fused c_attn
        output is ordered (q, k, v), each head-major, exactly like our ``qkv`` projection.
        """
        model = cls(_config_from_gpt2(hf_model.config))
        source, target = hf_model.transformer, model.transformer
        target.embeddings.word_embeddings.weight.copy_(source.wte.weight)
        target.embeddings.position_embeddings.weight.copy_(source.wpe.weight)
        for block, layer in zip(source.h, target.encoder.layers):
            pairs = [(block.ln_1, layer.attention.pre_norm), (block.ln_2, layer.ffn.pre_norm),
                     (block.attn.c_attn, layer.attention.qkv), (block.attn.c_proj, layer.attention.out_proj),
                     (block.mlp.c_fc, layer.ffn.dense_in), (block.mlp.c_proj, layer.ffn.dense_out)]
            for hf_module, lean_module in pairs:
                weight = hf_module.weight if isinstance(hf_module, torch.nn.LayerNorm) else hf_module.weight.t()
                lean_module.weight.copy_(weight)
                lean_module.bias.copy_(hf_module.bias)
        target.encoder.final_norm.weight.copy_(source.ln_f.weight)
        target.encoder.final_norm.bias.copy_(source.ln_f.bias)
        if model.lm_head.weight is not None:
            model.lm_head.weight.copy_(hf_model.lm_head.weight)
        return model
