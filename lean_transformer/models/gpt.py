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
from lean_transformer.models.hf_gpt2 import config_from_gpt2, copy_gpt2_weights, gpt2_config_from_lean
from lean_transformer.modules.embeddings import LeanLMHead


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Next-token cross-entropy: position t predicts labels[t + 1]; label -100 is ignored."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


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
                **unused) -> CausalLMOutput:
        hidden = self.transformer(input_ids, attention_mask, causal=True)
        logits = self.lm_head(hidden, self.transformer.embeddings.word_embeddings.weight)
        loss = causal_lm_loss(logits, labels) if labels is not None else None
        return CausalLMOutput(loss=loss, logits=logits)

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
