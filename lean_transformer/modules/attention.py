"""Multi-head self-attention through ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels where
available, so attention memory grows linearly with the sequence length)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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


def make_attention_mask(padding_mask: Optional[Tensor], seq_len: int, causal: bool) -> Optional[Tensor]:
    """A boolean [batch, 1, seq, seq] mask (True = may attend) for SDPA, or None when ``is_causal`` suffices.

    Every query may attend to itself, so rows of padding queries are never fully masked (a fully masked row
    would make SDPA return NaN); those rows' outputs are meaningless and ignored by the losses anyway.
    """
    if padding_mask is None:
        return None
    allowed = padding_mask.bool()[:, None, None, :]
    eye = torch.eye(seq_len, dtype=torch.bool, device=padding_mask.device)
    if causal:
        allowed = allowed & torch.ones(seq_len, seq_len, dtype=torch.bool, device=padding_mask.device).tril()
    return allowed | eye


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

    def forward(self, x: Tensor, attention_mask: Optional[Tensor] = None, causal: bool = False,
                rotary: Optional[tuple[Tensor, Tensor]] = None) -> Tensor:
        """:param attention_mask: from ``make_attention_mask`` (None: every position is a token).
        :param rotary: the (cos, sin) tables of ``rotary_cos_sin`` when positions are rotary."""
        batch, seq_len, hidden_size = x.shape
        qkv = self.qkv(self.pre_norm(x)).view(batch, seq_len, 3, self.num_heads, self.head_dim)
        if rotary is not None:
            cos, sin = (table.to(qkv.dtype) for table in rotary)
            # one new tensor for q, k and v, so that SDPA keeps one storage of 3 d-words, not the old qkv as well
            qkv = torch.cat([apply_rotary(qkv[:, :, :2], cos[:, None, None], sin[:, None, None]), qkv[:, :, 2:]], 2)
        query, key, value = qkv.transpose(1, 3).unbind(2)  # each [batch, heads, seq, head_dim]

        dropout_p = self.attention_dropout if self.training else 0.0
        is_causal = causal and attention_mask is None

        def core(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
            return F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal)

        if self.checkpoint_core and torch.is_grad_enabled():
            attended = checkpoint(core, (query, key, value), preserve_rng_state=self.preserve_rng_state)
        else:
            attended = core(query, key, value)
        out = self.out_proj(attended.transpose(1, 2).reshape(batch, seq_len, hidden_size))
        if self.post_norm is not None:
            out = self.post_norm(out)
        return F.dropout(out, self.output_dropout, self.training)
