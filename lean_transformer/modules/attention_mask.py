"""Attention masks: which keys each query may attend to, built once per forward pass from the model's padding
mask, and only where attention needs one (unpadded batches run SDPA without a mask)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


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
