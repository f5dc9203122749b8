"""Token (+ learned absolute position, + token type) embeddings, optionally factorized: tables of width
``embedding_size`` projected up to ``hidden_size``."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lean_transformer.config import LeanTransformerConfig
from lean_transformer.modules.early_grad import handoff
from lean_transformer.modules.fused_loss import linear_cross_entropy


class LeanEmbeddings(nn.Module):
    def __init__(self, config: LeanTransformerConfig, type_vocab_size: int = 0):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.embedding_size)
        self.position_embeddings = (nn.Embedding(config.max_position_embeddings, config.embedding_size)
                                    if config.position_embedding_type == "absolute" else None)
        self.token_type_embeddings = nn.Embedding(type_vocab_size, config.embedding_size) if type_vocab_size else None
        self.projection = (nn.Linear(config.embedding_size, config.hidden_size)
                           if config.embedding_size != config.hidden_size else None)
        self.dropout = config.hidden_dropout_prob
        self.max_positions = config.max_position_embeddings

    def forward(self, input_ids: Tensor, token_type_ids: Optional[Tensor] = None,
                position_ids: Optional[Tensor] = None, past_length: int = 0) -> Tensor:
        """:param position_ids: [batch or 1, seq] (None: past_length, past_length + 1, ...).
        :param past_length: how many positions a KV cache already holds before these."""
        if past_length + input_ids.shape[1] > self.max_positions:
            raise ValueError(f"input_ids has {input_ids.shape[1]} positions after {past_length} cached ones, more "
                             f"than max_position_embeddings={self.max_positions}")
        embeds = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(past_length, past_length + input_ids.shape[1], device=input_ids.device)
            embeds = embeds + self.position_embeddings(position_ids)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            embeds = embeds + self.token_type_embeddings(token_type_ids)
        if self.projection is not None:
            embeds = self.projection(embeds)
        return F.dropout(embeds, self.dropout, self.training)


class LeanLMHead(nn.Module):
    """Hidden states -> vocabulary logits. ``transform`` (ALBERT's MLM head) adds dense + GELU + LayerNorm; otherwise
    a factorized model projects back down to ``embedding_size``. Tied weights are the input embedding table,
    passed in at call time rather than registered twice; where the table has a gradient receiver
    (``modules/early_grad.py``, set by ``HostGradients``) the head's part of its gradient goes there in backward."""

    def __init__(self, config: LeanTransformerConfig, transform: bool = False, bias: bool = False):
        super().__init__()
        d, e = config.hidden_size, config.embedding_size
        if transform:
            self.transform = nn.Sequential(nn.Linear(d, e), nn.GELU(), nn.LayerNorm(e, eps=config.layer_norm_eps))
        else:
            self.transform = nn.Linear(d, e, bias=False) if d != e else None
        self.weight = None if config.tie_word_embeddings else nn.Parameter(torch.empty(config.vocab_size, e))
        self.bias = nn.Parameter(torch.zeros(config.vocab_size)) if bias else None

    def forward(self, hidden: Tensor, input_embeddings: Tensor) -> Tensor:
        if self.transform is not None:
            hidden = self.transform(hidden)
        return F.linear(hidden, self._weight(input_embeddings), self.bias)

    def _weight(self, input_embeddings: Tensor) -> Tensor:
        # tied: the head's gradient of the table can leave before the lookup's (``early_grad``)
        return handoff(input_embeddings) if self.weight is None else self.weight

    def loss(self, hidden: Tensor, input_embeddings: Tensor, labels: Tensor, ignore_index: int = -100,
             only_labelled: bool = True) -> Tensor:
        """``F.cross_entropy(self(hidden, input_embeddings).float(), labels)`` (mean over labelled tokens) without
        the full logits: the logits are computed a chunk at a time (``fused_loss.linear_cross_entropy``).

        :param only_labelled: first select the labelled tokens (worth it where few are, as in masked LM; it waits
            for the device to count them). False keeps every token's shape static (causal LM, fake tensors)."""
        if only_labelled:
            labelled = labels != ignore_index
            hidden, labels = hidden[labelled], labels[labelled]
        if self.transform is not None:
            hidden = self.transform(hidden)
        return linear_cross_entropy(hidden, self._weight(input_embeddings), labels, self.bias,
                                    ignore_index=ignore_index)
