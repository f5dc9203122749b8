"""LeanAlbert: a bidirectional encoder with masked-LM and sentence-order-prediction heads on the shared body."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.albert.modeling_albert import AlbertForPreTrainingOutput

from lean_transformer.config import LeanAlbertConfig
from lean_transformer.models.base import LeanPreTrainedModel, LeanTransformerModel
from lean_transformer.modules.embeddings import LeanLMHead


class LeanAlbertForPreTraining(LeanPreTrainedModel):
    config_class = LeanAlbertConfig

    def __init__(self, config: LeanAlbertConfig):
        super().__init__(config)
        self.transformer = LeanTransformerModel(config)
        self.mlm_head = LeanLMHead(config, transform=True, bias=True)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
        self.sop_classifier = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.get_input_embeddings()

    def set_input_embeddings(self, value) -> None:
        self.transformer.set_input_embeddings(value)

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, labels: Optional[Tensor] = None,
                sentence_order_label: Optional[Tensor] = None, return_logits: bool = True
                ) -> AlbertForPreTrainingOutput:
        """Any other argument raises TypeError.
        :param labels: [batch, seq] token ids at masked positions, -100 elsewhere.
        :param sentence_order_label: [batch], 0 if the two segments are in order, 1 if swapped.
        :param return_logits: False (needs labels) computes the masked-LM loss from the masked positions' hidden
            states a chunk at a time (``modules/fused_loss.py``) and returns ``prediction_logits=None``."""
        if not return_logits and labels is None:
            raise ValueError("return_logits=False needs labels: without them there is no masked-LM loss to compute")
        hidden = self.transformer(input_ids, attention_mask, token_type_ids, causal=False)
        embeddings = self.transformer.embeddings.word_embeddings.weight
        prediction_logits = self.mlm_head(hidden, embeddings) if return_logits else None
        pooled = torch.tanh(self.pooler(hidden[:, 0]))
        sop_logits = self.sop_classifier(F.dropout(pooled, self.config.classifier_dropout_prob, self.training))
        loss = None
        if labels is not None and not return_logits:
            loss = self.mlm_head.loss(hidden, embeddings, labels)
        elif labels is not None:
            loss = F.cross_entropy(prediction_logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        if sentence_order_label is not None:
            sop_loss = F.cross_entropy(sop_logits.float(), sentence_order_label.flatten())
            loss = sop_loss if loss is None else loss + sop_loss
        return AlbertForPreTrainingOutput(loss=loss, prediction_logits=prediction_logits, sop_logits=sop_logits)
