"""LeanGPT: a causal language model on the shared body."""
from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
import transformers
from torch import Tensor
from transformers import GenerationMixin
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from lean_transformer.config import LeanGPTConfig
from lean_transformer.models.base import LeanPreTrainedModel, LeanTransformerModel
from lean_transformer.models.hf_gpt2 import config_from_gpt2, copy_gpt2_weights, gpt2_config_from_lean
from lean_transformer.modules.embeddings import LeanLMHead


# transformers 5.24 renamed the KV cache of its models from ``past_key_values`` to ``cache`` (the forward argument that
# ``generate`` passes, and the output field); older 5.x releases pass and read ``past_key_values``. LeanGPT's forward
# takes either name and fills the field this release declares. Can go when pyproject requires transformers >= 5.24.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Next-token cross-entropy: position t predicts labels[t + 1]; label -100 is ignored."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


class LeanGPTForCausalLM(LeanPreTrainedModel, GenerationMixin):
    """LeanGPT with a language-model head; works with transformers' ``generate`` (greedy, sampling, beam search)
    and its KV caches."""

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
                cache: Optional[Cache] = None, use_cache: Optional[bool] = None,
                position_ids: Optional[Tensor] = None, logits_to_keep: int = 0, return_logits: bool = True,
                return_dict: Optional[bool] = None, output_attentions: Optional[bool] = None,
                output_hidden_states: Optional[bool] = None,
                past_key_values: Optional[Cache] = None) -> CausalLMOutputWithPast:
        """The arguments of transformers' causal LMs that this model supports; any other raises TypeError.

        :param attention_mask: [batch, cached + new positions], 1 for tokens, 0 for padding.
        :param cache: a transformers ``Cache`` (e.g. ``DynamicCache``) with the keys and values of the positions
            before ``input_ids``; it is extended in place and returned. ``past_key_values`` is its name before
            transformers 5.24 (give one of the two).
        :param use_cache: return a cache (a new ``DynamicCache`` if none was given); default: whether one was given.
        :param position_ids: [batch or 1, seq]; default: the positions after the cached ones. ``generate`` passes
            them (counting only tokens, for left-padded prompts).
        :param logits_to_keep: compute logits for the last this many positions only (0: all).
        :param return_logits: False (needs labels) computes the loss from the hidden states a chunk of tokens at a
            time (``modules/fused_loss.py``), so the full logits never exist, and returns ``logits=None``.
        """
        for name, value, supported in (("return_dict", return_dict, (None, True)),
                                       ("output_attentions", output_attentions, (None, False)),
                                       ("output_hidden_states", output_hidden_states, (None, False))):
            if value not in supported:
                raise ValueError(f"{name}={value!r} is not supported by {type(self).__name__}")
        if logits_to_keep and labels is not None:
            raise ValueError("logits_to_keep cannot be combined with labels: the loss needs every position's logits")
        if not return_logits and labels is None:
            raise ValueError("return_logits=False needs labels: the loss is all such a call returns")
        if cache is not None and past_key_values is not None:
            raise ValueError("give the KV cache as cache or as past_key_values (its older name), not both")
        name, given = ("cache", cache) if cache is not None else ("past_key_values", past_key_values)
        if given is not None and not isinstance(given, Cache):
            raise TypeError(f"{name} must be a transformers Cache (e.g. DynamicCache), got {type(given).__name__}")
        if use_cache is None:
            use_cache = given is not None
        if use_cache and given is None:
            given = DynamicCache(config=self.config)
        cache = given if use_cache else None
        hidden = self.transformer(input_ids, attention_mask, causal=True, position_ids=position_ids, cache=cache)
        embeddings = self.transformer.embeddings.word_embeddings.weight
        if not return_logits:
            loss = self.lm_head.loss(hidden[:, :-1], embeddings, labels[:, 1:], only_labelled=False)
            return CausalLMOutputWithPast(loss=loss, logits=None, **{CACHE_FIELD: cache})
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden, embeddings)
        loss = causal_lm_loss(logits, labels) if labels is not None else None
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})

    @classmethod
    def from_hf_gpt2(cls, hf_model: "transformers.GPT2LMHeadModel") -> "LeanGPTForCausalLM":
        """A LeanGPT computing the same function as ``hf_model`` (a ``transformers.GPT2LMHeadModel``), in float32;
        ValueError naming the GPT-2 config field that LeanGPT cannot express."""
        model = cls(config_from_gpt2(hf_model.config))
        copy_gpt2_weights(hf_model, model, to_lean=True)
        return model

    def to_hf_gpt2(self) -> "transformers.GPT2LMHeadModel":
        """A ``transformers.GPT2LMHeadModel`` computing the same function as this model (float32 weights); ValueError
        naming the first config field that GPT-2 cannot express (rotary positions, gated activations, ...)."""
        hf_model = transformers.GPT2LMHeadModel(gpt2_config_from_lean(self.config))
        copy_gpt2_weights(hf_model, self, to_lean=False)
        return hf_model
