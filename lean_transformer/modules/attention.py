"""Multi-head self-attention through ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels where
available, so attention memory grows linearly with the sequence length), or through ``chunked_attention`` where
SDPA has no fused kernel (CPU with attention dropout); with an optional transformers KV cache for generation."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.cache_utils import Cache

from lean_transformer.config import LeanTransformerConfig
from lean_transformer.modules.attention_mask import AttentionMask
from lean_transformer.modules.checkpoint import checkpoint
from lean_transformer.modules.chunked_attention import DEFAULT_CHUNK_SIZE, chunked_attention
from lean_transformer.modules.linear import SharedMatrix, make_linear
from lean_transformer.modules.rotary import apply_rotary


class LeanSelfAttention(nn.Module):
    """``dropout(post_norm?(W_o attention(rotary(W_qkv LayerNorm(x)))))``; the caller adds the residual."""

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
        self.core_implementation = "auto"  # set_optimizations(attention_core=...): "auto", "sdpa" or "chunked"
        self.chunk_size = DEFAULT_CHUNK_SIZE
        self.preserve_rng_state = True

    def uses_chunked_core(self, device: torch.device, dropout_p: float) -> bool:
        """Whether attention runs in chunks of queries (``chunked_attention``) rather than through SDPA: "auto"
        chooses it where SDPA would materialize the attention matrix, i.e. on CPU with attention dropout (see
        ``modules/chunked_attention.py`` for what torch 2.13 runs fused)."""
        if self.core_implementation == "auto":
            return device.type == "cpu" and dropout_p > 0
        return self.core_implementation == "chunked"

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
        is_causal = causal and attention_mask is None and seq_len > 1

        if self.uses_chunked_core(x.device, dropout_p):
            def core(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
                return chunked_attention(query, key, value, attention_mask, causal, dropout_p, self.chunk_size)
        else:
            mask = attention_mask.dense(x.device) if attention_mask is not None else None

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
