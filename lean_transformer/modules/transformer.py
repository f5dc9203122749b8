"""The transformer body shared by every model: layers (with ALBERT-style sharing), residual stream, and the
memory options (checkpointing in segments, reversible coupling)."""
from __future__ import annotations

import functools
from typing import Callable, Optional, Union

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache

from lean_transformer.config import LeanTransformerConfig
from lean_transformer.modules.attention import LeanSelfAttention
from lean_transformer.modules.attention_mask import AttentionMask
from lean_transformer.modules.checkpoint import checkpoint, reversible, reversible_couple
from lean_transformer.modules.ffn import LeanFFN
from lean_transformer.modules.head_groups import head_group_backward
from lean_transformer.modules.linear import SharedLinear, make_shared_matrix
from lean_transformer.modules.rotary import rotary_tables


class SharedMatrices(nn.Module):
    """One set of the large matrices of a layer, shared by every layer that uses this set."""

    def __init__(self, config: LeanTransformerConfig):
        super().__init__()
        d, inner = config.hidden_size, config.intermediate_size
        self.qkv = make_shared_matrix(config, d, 3 * d)
        self.attention_out = make_shared_matrix(config, d, d)
        self.ffn_in = make_shared_matrix(config, d, inner * (2 if config.is_gated else 1))
        self.ffn_out = make_shared_matrix(config, inner, d)


class LeanTransformerLayer(nn.Module):
    """A pre-norm layer: self-attention then feed-forward, each a residual sub-layer."""

    def __init__(self, config: LeanTransformerConfig, shared: Optional[SharedMatrices] = None):
        super().__init__()
        self.attention = LeanSelfAttention(config, shared and shared.qkv, shared and shared.attention_out)
        self.ffn = LeanFFN(config, shared and shared.ffn_in, shared and shared.ffn_out)


class AttentionBranch:
    """The attention sub-layer at one depth, with this forward pass's mask and rotary tables bound; in a reversible
    backward with ``backward_chunks`` > 1 it splits into head groups (``head_groups.py``)."""

    def __init__(self, attention: LeanSelfAttention, chunks: int, **kwargs):
        self.attention, self.chunks, self.kwargs = attention, chunks, kwargs

    def __call__(self, x: Tensor) -> Tensor:
        return self.attention(x, **self.kwargs)

    def backward_in_place(self, x: Tensor, grad_out: Tensor, residual: Tensor, grad_x: Tensor
                          ) -> Optional[list[tuple[Tensor, Tensor]]]:
        """See ``checkpoint.py``: None (plain recomputation) for one chunk, else the head groups' backward."""
        if self.chunks == 1:
            return None
        kwargs = {key: value for key, value in self.kwargs.items() if key not in ("cache", "layer_idx")}
        # a backward never runs with a KV cache
        return head_group_backward(self.attention, x, grad_out, residual, grad_x, self.chunks, **kwargs)


class LeanTransformer(nn.Module):
    """``num_hidden_layers`` layers drawn from ``num_hidden_groups * num_inner_groups`` distinct ones."""

    def __init__(self, config: LeanTransformerConfig):
        super().__init__()
        self.config = config
        self.shared_matrices = None
        if config.share_large_matrices:
            # built here, once per model, and handed to the layers by reference
            self.shared_matrices = nn.ModuleList(SharedMatrices(config) for _ in range(config.num_shared_matrices))
        num_distinct = config.num_hidden_groups * config.num_inner_groups
        self.layers = nn.ModuleList(
            LeanTransformerLayer(config, self.shared_matrices[i % config.num_shared_matrices]
                                 if self.shared_matrices is not None else None)
            for i in range(num_distinct))
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.gradient_checkpointing: Union[bool, int] = False
        self.preserve_rng_state = True
        self.backward_chunks = 1  # attention head groups in a reversible backward; the FFN keeps its own count

    def layer_order(self) -> list[int]:
        """Which distinct layer runs at each depth: groups of consecutive layers cycle through their inner layers."""
        per_group = self.config.num_hidden_layers // self.config.num_hidden_groups
        inner = self.config.num_inner_groups
        return [(i // per_group) * inner + (i % per_group) % inner for i in range(self.config.num_hidden_layers)]

    def sublayers(self, attention_mask: Optional[AttentionMask], causal: bool, seq_len: int, device: torch.device,
                  position_ids: Optional[Tensor] = None, cache: Optional[Cache] = None
                  ) -> list[Callable[[Tensor], Tensor]]:
        """The residual branches in order of depth: attention, feed-forward, attention, ...
        :param position_ids: [batch or 1, seq_len] (None: 0 .. seq_len - 1); used by rotary positions.
        :param cache: a KV cache, one entry per depth (shared layers keep one entry per use)."""
        rotary = None
        if self.config.position_embedding_type == "rotary":  # computed once per forward pass, shared by all layers
            if position_ids is None:
                position_ids = torch.arange(seq_len, device=device)[None]
            rotary = rotary_tables(position_ids, self.config.head_dim, self.config.rotary_base, torch.float32)
        result = []
        for depth, index in enumerate(self.layer_order()):
            layer = self.layers[index]
            result.append(AttentionBranch(layer.attention, self.backward_chunks, attention_mask=attention_mask,
                                          causal=causal, rotary=rotary, cache=cache, layer_idx=depth))
            result.append(layer.ffn)
        return result

    def trainable_tensors(self, modules: list[nn.Module]) -> list[Tensor]:
        """Parameters used by ``modules`` that need gradients, shared matrices included, each once."""
        found: dict[int, Tensor] = {}
        for module in modules:
            for sub in module.modules():
                tensors = list(sub.parameters(recurse=False))
                if isinstance(sub, SharedLinear):
                    tensors.extend(sub.shared.parameters())
                found.update((id(t), t) for t in tensors if t.requires_grad)
        return list(found.values())

    def _add(self, residual: Tensor, branch: Tensor) -> Tensor:
        # under autocast the branch is half precision: keep the sum in float32 only if asked to
        total = residual + branch
        return total if self.config.fp32_residual else total.to(branch.dtype)

    def _run(self, sublayers: list[Callable[[Tensor], Tensor]], x: Tensor) -> Tensor:
        for sublayer in sublayers:
            x = self._add(x, sublayer(x))
        return x

    def forward(self, hidden: Tensor, attention_mask: Optional[AttentionMask] = None, causal: bool = False,
                position_ids: Optional[Tensor] = None, cache: Optional[Cache] = None) -> Tensor:
        """:param hidden: embeddings [batch, seq, hidden_size].
        :param attention_mask: from ``attention_mask_for``.
        :param position_ids, cache: see ``sublayers``.
        A reversible stack runs two streams that start as copies of ``hidden``; each sub-layer adds its output to
        the other stream (RevNet coupling), the result is their mean, and the streams keep ``hidden``'s dtype."""
        grad_needed = torch.is_grad_enabled()
        if cache is not None and grad_needed and (self.config.reversible or self.gradient_checkpointing):
            raise ValueError("a KV cache (use_cache / past_key_values) cannot be combined with reversible=True or "
                             "gradient_checkpointing while gradients are enabled: their recomputation would append "
                             "to the cache twice; run under torch.no_grad()")
        if self.config.fp32_residual:
            hidden = hidden.float()
        sublayers = self.sublayers(attention_mask, causal, hidden.shape[1], hidden.device, position_ids, cache)
        if self.config.reversible:
            if grad_needed:
                x0, x1 = reversible(sublayers, hidden, hidden, self.trainable_tensors([self.layers]))
            else:
                x0, x1 = reversible_couple(sublayers, hidden, hidden)
            hidden = (x0 + x1) / 2
        elif self.gradient_checkpointing and grad_needed:
            hidden = self._checkpointed(sublayers, hidden)
        else:
            hidden = self._run(sublayers, hidden)
        return self.final_norm(hidden)

    def _checkpointed(self, sublayers: list[Callable[[Tensor], Tensor]], hidden: Tensor) -> Tensor:
        num_layers = self.config.num_hidden_layers
        segments = num_layers if self.gradient_checkpointing is True else int(self.gradient_checkpointing)
        order = self.layer_order()
        bounds = [round(i * num_layers / segments) for i in range(segments + 1)]
        for start, end in zip(bounds[:-1], bounds[1:]):
            segment = sublayers[2 * start:2 * end]
            params = self.trainable_tensors([self.layers[i] for i in set(order[start:end])])
            hidden = checkpoint(functools.partial(self._run, segment), (hidden,), params, self.preserve_rng_state)
        return hidden
