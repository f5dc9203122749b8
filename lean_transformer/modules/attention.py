"""Multi-head self-attention through ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels where
available, so attention memory grows linearly with the sequence length)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.cache_utils import Cache

from lean_transformer.config import LeanTransformerConfig
from lean_transformer.modules.checkpoint import checkpoint
from lean_transformer.modules.linear import SharedMatrix, make_linear
from lean_transformer.modules.rotary import apply_rotary


def padding_or_none(attention_mask: Optional[Tensor]) -> Optional[Tensor]:
    """The model's [batch, seq] attention mask (1 = token, 0 = padding) as a boolean padding mask, or None when
    every position is a token: then SDPA runs without a mask (``is_causal=True`` for causal models), which lets
    CUDA pick its flash kernel (it takes no mask) and saves building a [batch, 1, seq, seq] mask on any device."""
    if attention_mask is None:
        return None
    padding = attention_mask.bool()
    return None if bool(padding.all()) else padding


class AttentionMask:
    """Which keys each query may attend to, for ``query_len`` queries that are the last of ``key_len`` positions
    (the earlier ones come from a KV cache): key ``j`` is allowed for query ``i`` if it is a token (``padding``,
    [batch, key_len] bool, None: all are) and, when ``causal``, not in the future.

    Every query may attend to itself, so rows of padding queries are never fully masked (a fully masked row
    would make SDPA return NaN); those rows' outputs are meaningless and ignored by the losses anyway.
    Built once per forward pass and shared by every layer; ``rows`` builds any block of query rows without the
    whole [query_len, key_len] matrix, for attention computed in chunks of queries.
    """

    def __init__(self, padding: Optional[Tensor], query_len: int, key_len: int, causal: bool):
        if padding is not None and padding.shape[1] != key_len:
            raise ValueError(f"attention_mask has {padding.shape[1]} positions, expected {key_len} (the cached "
                             f"positions and input_ids together)")
        self.padding, self.query_len, self.key_len, self.causal = padding, query_len, key_len, causal
        self._dense: Optional[Tensor] = None

    def rows(self, start: int, end: int, device: torch.device) -> Tensor:
        """The boolean [batch or 1, 1, end - start, key_len] mask (True = may attend) of queries start .. end - 1."""
        query_positions = torch.arange(start, end, device=device)[:, None] + (self.key_len - self.query_len)
        key_positions = torch.arange(self.key_len, device=device)
        if self.causal:
            allowed = key_positions <= query_positions
        else:
            allowed = torch.ones(end - start, self.key_len, dtype=torch.bool, device=device)
        allowed = allowed & self.padding[:, None, None, :] if self.padding is not None else allowed[None, None]
        return allowed | (key_positions == query_positions)

    def dense(self, device: torch.device) -> Tensor:
        """``rows`` of every query, built once (SDPA takes the whole mask)."""
        if self._dense is None:
            self._dense = self.rows(0, self.query_len, device)
        return self._dense


def attention_mask_for(padding: Optional[Tensor], query_len: int, key_len: int, causal: bool
                       ) -> Optional[AttentionMask]:
    """The mask a forward pass needs, or None where SDPA needs none: no padding, and either not causal, or
    causal with as many queries as keys (``is_causal``) or a single query (it may see every cached key)."""
    if padding is None and (not causal or query_len in (1, key_len)):
        return None
    return AttentionMask(padding, query_len, key_len, causal)


class LeanSelfAttention(nn.Module):
    """``dropout(post_norm?(W_o SDPA(rotary(W_qkv LayerNorm(x)))))``; the caller adds the residual."""

    def __init__(self, config: LeanTransformerConfig, shared_qkv: Optional[SharedMatrix] = None,
                 shared_out: Optional[SharedMatrix] = None):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.pre_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.qkv = make_linear(config, config.hidden_size, 3 * config.hidden_size, shared=shared_qkv)
        self.out_proj = make_linear(config, config.hidden_size, config.hidden_size, shared=shared_out)
        self.post_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.sandwich_norm else None
        self.attention_dropout = config.attention_probs_dropout_prob
        self.output_dropout = config.hidden_dropout_prob
        self.checkpoint_core = False  # set by LeanPreTrainedModel.set_optimizations(checkpoint_attention_core=...)
        self.preserve_rng_state = True

    def forward(self, x: Tensor, attention_mask: Optional[AttentionMask] = None, causal: bool = False,
                rotary: Optional[tuple[Tensor, Tensor]] = None, cache: Optional[Cache] = None,
                layer_idx: int = 0) -> Tensor:
        """:param attention_mask: from ``attention_mask_for`` (None: no mask needed).
        :param rotary: (cos, sin) tables of ``rotary_tables``, [batch or 1, seq, head_dim], when positions are rotary.
        :param cache: a transformers ``Cache`` holding earlier keys and values; this call appends its own
            (rotated) keys and values under ``layer_idx``, the layer's depth."""
        batch, seq_len, hidden_size = x.shape
        qkv = self.qkv(self.pre_norm(x)).view(batch, seq_len, 3, self.num_heads, self.head_dim)
        if rotary is not None:
            cos, sin = (table.to(qkv.dtype)[:, :, None, None] for table in rotary)
            # one new tensor for q, k and v, so that SDPA keeps one storage of 3 d-words, not the old qkv as well
            qkv = torch.cat([apply_rotary(qkv[:, :, :2], cos, sin), qkv[:, :, 2:]], 2)
        query, key, value = qkv.transpose(1, 3).unbind(2)  # each [batch, heads, seq, head_dim]
        if cache is not None:
            key, value = cache.update(key, value, layer_idx)

        dropout_p = self.attention_dropout if self.training else 0.0
        mask = attention_mask.dense(x.device) if attention_mask is not None else None
        is_causal = causal and attention_mask is None and seq_len > 1

        def core(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
            return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p,
                                                  is_causal=is_causal)

        if self.checkpoint_core and torch.is_grad_enabled():
            attended = checkpoint(core, (query, key, value), preserve_rng_state=self.preserve_rng_state)
        else:
            attended = core(query, key, value)
        out = self.out_proj(attended.transpose(1, 2).reshape(batch, seq_len, hidden_size))
        if self.post_norm is not None:
            out = self.post_norm(out)
        return F.dropout(out, self.output_dropout, self.training)
