"""What every lean model shares: weight init, runtime memory options, and the base model (embeddings + body)."""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from lean_transformer.config import LeanTransformerConfig
from lean_transformer.modules.attention import LeanSelfAttention
from lean_transformer.modules.attention_mask import attention_mask_for, padding_or_none
from lean_transformer.modules.embeddings import LeanEmbeddings, LeanLMHead
from lean_transformer.modules.ffn import LeanFFN
from lean_transformer.modules.head_groups import supports_head_groups
from lean_transformer.modules.linear import SharedMatrix
from lean_transformer.modules.linear_op import LinearOp
from lean_transformer.modules.transformer import LeanTransformer


def _require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


class LeanPreTrainedModel(PreTrainedModel):
    config_class = LeanTransformerConfig
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = False  # we have our own, see set_optimizations

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (LinearOp, SharedMatrix)):
            module.reset_parameters(std)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, LeanLMHead):
            if module.weight is not None:
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    @property
    def body(self) -> LeanTransformer:
        return self.base_model.encoder

    def set_optimizations(self, *, gradient_checkpointing: Union[bool, int] = False,
                          checkpoint_attention_core: bool = False, ffn_custom_grad: bool = True,
                          preserve_rng_state: bool = True, attention_core: str = "auto", backward_chunks: int = 1
                          ) -> None:
        """Trade compute for memory; none of these options changes predictions or gradients.

        :param gradient_checkpointing: False; True to keep only each layer's input (one checkpoint per layer:
            checkpointing attention and feed-forward separately would keep twice the inputs for the same
            recomputation); or an int N to keep only the inputs of N equal segments of layers.
        :param checkpoint_attention_core: recompute the attention core in backward; it pays off where the core
            keeps more than q, k, v and its output (SDPA's math kernel keeps the attention matrix).
        :param ffn_custom_grad: use the feed-forward's hand-written backward (keeps 5 d-words per token, and with
            dropout d bytes for its mask, instead of about 10 d-words for a 4x-wide plain-autograd feed-forward).
        :param preserve_rng_state: replay the RNG in recomputations so that dropout masks match the forward pass.
            Turning it off is only faster, and wrong with dropout.
        :param attention_core: "sdpa" (``F.scaled_dot_product_attention``), "chunked" (``chunked_attention``:
            exact, memory linear in the sequence length without a fused kernel, slower) or "auto" (chunked where SDPA
            would materialize the attention matrix: on CPU with attention dropout). Without dropout both give the
            same results within float rounding; with dropout they draw different masks.
        :param backward_chunks: N > 1 runs backward in N pieces whose gradients add up to the whole: the
            feed-forward's hand-written backward over N chunks of tokens (any mode), and in a reversible stack also
            the recomputation, with the attention in N groups of heads. Lowers the peak memory of backward; needs
            ``ffn_custom_grad`` outside reversible mode, and dense attention projections, no sandwich norm and no
            attention dropout in reversible mode (ValueError otherwise).
        Each call sets every option; omitted ones return to their defaults.
        """
        num_layers = self.config.num_hidden_layers
        if isinstance(gradient_checkpointing, bool):
            pass
        elif not isinstance(gradient_checkpointing, int) or not 1 <= gradient_checkpointing <= num_layers:
            raise ValueError(f"gradient_checkpointing must be a bool or a number of segments in [1, {num_layers}], "
                             f"got {gradient_checkpointing!r}")
        if gradient_checkpointing is not False and self.config.reversible:
            raise ValueError("gradient_checkpointing cannot be combined with reversible=True: a reversible stack "
                             "already keeps no per-layer activations")
        for name, value in (("checkpoint_attention_core", checkpoint_attention_core),
                            ("ffn_custom_grad", ffn_custom_grad), ("preserve_rng_state", preserve_rng_state)):
            _require_bool(name, value)
        if attention_core not in ("auto", "sdpa", "chunked"):
            raise ValueError(f"attention_core must be 'auto', 'sdpa' or 'chunked', got {attention_core!r}")
        self._check_backward_chunks(backward_chunks, ffn_custom_grad)
        self.body.gradient_checkpointing = gradient_checkpointing
        self.body.backward_chunks = backward_chunks if self.config.reversible else 1
        self.body.preserve_rng_state = preserve_rng_state
        for module in self.body.modules():
            if isinstance(module, LeanSelfAttention):
                module.checkpoint_core = checkpoint_attention_core
                module.core_implementation = attention_core
                module.preserve_rng_state = preserve_rng_state
            elif isinstance(module, LeanFFN):
                module.custom_grad = ffn_custom_grad
                module.backward_chunks = backward_chunks

    def _check_backward_chunks(self, backward_chunks: int, ffn_custom_grad: bool) -> None:
        if not isinstance(backward_chunks, int) or isinstance(backward_chunks, bool) or backward_chunks < 1:
            raise ValueError(f"backward_chunks must be a positive int, got {backward_chunks!r}")
        if backward_chunks == 1:
            return
        if not self.config.reversible:
            if not ffn_custom_grad:
                raise ValueError("backward_chunks > 1 outside reversible mode chunks the feed-forward's hand-written "
                                 "backward: it needs ffn_custom_grad=True")
            return
        for module in self.body.modules():
            if isinstance(module, LeanSelfAttention) and supports_head_groups(module) is not None:
                raise ValueError(f"backward_chunks > 1 with reversible=True cannot split the attention into head "
                                 f"groups: {supports_head_groups(module)}")


class LeanTransformerModel(LeanPreTrainedModel):
    """Embeddings and the transformer body; returns the final (layer-normed) hidden states."""

    def __init__(self, config: LeanTransformerConfig):
        super().__init__(config)
        self.embeddings = LeanEmbeddings(config, type_vocab_size=getattr(config, "type_vocab_size", 0))
        self.encoder = LeanTransformer(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, causal: bool = False, position_ids: Optional[Tensor] = None,
                cache: Optional[Cache] = None) -> Tensor:
        """:param attention_mask: [batch, cached + seq] with 1 for tokens and 0 for padding (None or all ones: no
            padding, and attention runs without a mask).
        :param position_ids: [batch or 1, seq] (None: the positions after the cached ones).
        :param cache: a transformers ``Cache`` of earlier keys and values, extended in place."""
        past_length = cache.get_seq_length() if cache is not None else 0
        seq_len = input_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(past_length, past_length + seq_len, device=input_ids.device)[None]
        elif position_ids.shape[-1] != seq_len:
            raise ValueError(f"position_ids has {position_ids.shape[-1]} positions, input_ids has {seq_len}")
        if attention_mask is not None and attention_mask.shape != (input_ids.shape[0], past_length + seq_len):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected "
                             f"{(input_ids.shape[0], past_length + seq_len)} (batch, cached + new positions)")
        hidden = self.embeddings(input_ids, token_type_ids, position_ids, past_length)
        mask = attention_mask_for(padding_or_none(attention_mask), seq_len, past_length + seq_len, causal)
        return self.encoder(hidden, mask, causal, position_ids, cache)
