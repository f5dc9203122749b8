"""Architecture configs. Everything here changes what the model computes; options that only trade
memory for compute (checkpointing, the hand-written FFN backward, ...) are set at run time with
``model.set_optimizations(...)`` and are not part of the config."""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional

from transformers import PretrainedConfig

ACTIVATIONS = ("gelu", "gelu_new", "relu", "silu")
GATED_ACTIVATIONS = {"geglu": "gelu", "swiglu": "silu"}  # gated name -> the activation applied to the gate
POSITION_EMBEDDING_TYPES = ("rotary", "absolute")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, not to a config


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive_int(value: Any) -> bool:
    return _is_int(value) and value > 0


def _non_negative_int(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _positive_real(value: Any) -> bool:
    return _is_real(value) and value > 0


def _probability(value: Any) -> bool:
    return _is_real(value) and 0 <= value < 1


class LeanTransformerConfig(PretrainedConfig):
    """The architecture of a lean transformer stack; shared by LeanGPT and LeanAlbert.

    Parameter sharing (ALBERT-style): the ``num_hidden_layers`` layers are split into ``num_hidden_groups``
    consecutive groups that reuse the same ``num_inner_groups`` distinct layers in turn.
    ``share_large_matrices`` additionally shares the big projection matrices across all layers
    (``num_shared_matrices`` sets of them), each layer keeping its own low-rank ``adapter_dim`` adapters.
    ``weight_layout`` makes the large matrices block-sparse (e.g. ``"pixelfly(block_size=64)"``),
    with an optional dense low-rank term of rank ``lowrank_dim``.
    """

    model_type = "lean_transformer"

    def __init__(
        self,
        vocab_size: int = 50257,
        embedding_size: Optional[int] = None,
        hidden_size: int = 768,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        intermediate_size: Optional[int] = None,
        hidden_act: str = "gelu_new",
        hidden_dropout_prob: float = 0.1,
        attention_probs_dropout_prob: float = 0.1,
        max_position_embeddings: int = 2048,
        position_embedding_type: str = "rotary",
        rotary_base: float = 10_000.0,
        layer_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        sandwich_norm: bool = False,
        fp32_residual: bool = False,
        reversible: bool = False,
        num_hidden_groups: Optional[int] = None,
        num_inner_groups: int = 1,
        share_large_matrices: bool = False,
        num_shared_matrices: int = 1,
        adapter_dim: int = 0,
        weight_layout: Optional[str] = None,
        lowrank_dim: int = 0,
        tie_word_embeddings: bool = True,
        pad_token_id: Optional[int] = None,
        bos_token_id: Optional[int] = None,
        eos_token_id: Optional[int] = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.embedding_size = embedding_size if embedding_size is not None else hidden_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        # a bad hidden_size is reported by validate(), not by this arithmetic
        self.intermediate_size = (4 * hidden_size if intermediate_size is None and _is_int(hidden_size)
                                  else intermediate_size)
        self.hidden_act = hidden_act
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.position_embedding_type = position_embedding_type
        self.rotary_base = rotary_base
        self.layer_norm_eps = layer_norm_eps
        self.initializer_range = initializer_range
        self.sandwich_norm = sandwich_norm
        self.fp32_residual = fp32_residual
        self.reversible = reversible
        self.num_hidden_groups = num_hidden_groups if num_hidden_groups is not None else num_hidden_layers
        self.num_inner_groups = num_inner_groups
        self.share_large_matrices = share_large_matrices
        self.num_shared_matrices = num_shared_matrices
        self.adapter_dim = adapter_dim
        self.weight_layout = weight_layout
        self.lowrank_dim = lowrank_dim
        self.tie_word_embeddings = tie_word_embeddings
        self.pad_token_id, self.bos_token_id, self.eos_token_id = pad_token_id, bos_token_id, eos_token_id
        self.validate()  # before PretrainedConfig's own checks, which already read derived fields such as head_dim
        super().__init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any
                  ) -> LeanTransformerConfig | tuple[LeanTransformerConfig, dict[str, Any]]:
        """PretrainedConfig's, validated again: it applies ``from_pretrained``'s keyword overrides (e.g.
        ``from_pretrained(path, reversible=True)``) to the config after constructing it."""
        result = super().from_dict(config_dict, **kwargs)
        (result[0] if isinstance(result, tuple) else result).validate()  # a tuple with return_unused_kwargs=True
        return result

    @property
    def is_gated(self) -> bool:
        return self.hidden_act in GATED_ACTIVATIONS

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def _check(self, names: Iterable[str], is_valid: Callable[[Any], bool], expected: str) -> None:
        """Raise ValueError naming the first of ``names`` whose value fails ``is_valid``."""
        for name in names:
            value = getattr(self, name)
            if not is_valid(value):
                raise ValueError(f"{name} must be {expected}, got {value!r}")

    def validate(self) -> None:
        """Raise ValueError naming the first field that makes this config unusable. Each field's type and range
        are checked before the rules that combine fields; a field whose default is derived from another
        (embedding_size, intermediate_size, num_hidden_groups) after that one, so the error names the cause."""
        self._check(("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "embedding_size",
                     "intermediate_size", "max_position_embeddings", "num_hidden_groups", "num_inner_groups",
                     "num_shared_matrices"), _positive_int, "a positive integer")
        self._check(("adapter_dim", "lowrank_dim"), _non_negative_int, "a non-negative integer")
        self._check(("rotary_base", "layer_norm_eps", "initializer_range"), _positive_real, "a positive number")
        self._check(("hidden_dropout_prob", "attention_probs_dropout_prob"), _probability, "a number in [0, 1)")
        self._check(("sandwich_norm", "fp32_residual", "reversible", "share_large_matrices", "tie_word_embeddings"),
                    lambda value: isinstance(value, bool), "True or False")
        self._check(("pad_token_id", "bos_token_id", "eos_token_id"),
                    lambda value: value is None or (_is_int(value) and 0 <= value < self.vocab_size),
                    f"None or a token id in [0, vocab_size={self.vocab_size})")
        activations = ACTIVATIONS + tuple(GATED_ACTIVATIONS)
        self._check(("hidden_act",), lambda value: value in activations, f"one of {activations}")
        self._check(("position_embedding_type",), lambda value: value in POSITION_EMBEDDING_TYPES,
                    f"one of {POSITION_EMBEDDING_TYPES}")

        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by "
                             f"num_attention_heads ({self.num_attention_heads})")
        if self.position_embedding_type == "rotary" and self.head_dim % 2 != 0:
            raise ValueError(f"position_embedding_type='rotary' needs an even head dimension, got {self.head_dim}")
        if self.num_hidden_layers % self.num_hidden_groups != 0:
            raise ValueError(f"num_hidden_groups ({self.num_hidden_groups}) must divide "
                             f"num_hidden_layers ({self.num_hidden_layers})")
        layers_per_group = self.num_hidden_layers // self.num_hidden_groups
        if layers_per_group % self.num_inner_groups != 0:
            raise ValueError(f"num_inner_groups ({self.num_inner_groups}) must divide the number of layers "
                             f"per hidden group ({layers_per_group})")
        if self.adapter_dim and not self.share_large_matrices:
            raise ValueError("adapter_dim > 0 needs share_large_matrices=True (adapters specialize shared matrices)")
        if self.num_shared_matrices > 1 and not self.share_large_matrices:
            raise ValueError("num_shared_matrices > 1 needs share_large_matrices=True")
        num_distinct = self.num_hidden_groups * self.num_inner_groups
        if self.num_shared_matrices > num_distinct:
            raise ValueError(f"num_shared_matrices ({self.num_shared_matrices}) exceeds the number of distinct "
                             f"layers (num_hidden_groups * num_inner_groups = {num_distinct}): some sets would "
                             f"never be used")
        if self.lowrank_dim and self.weight_layout is None:
            raise ValueError("lowrank_dim > 0 needs a block-sparse weight_layout")
        if self.weight_layout is not None:
            self._validate_weight_layout()

    def _validate_weight_layout(self) -> None:
        """Build the block masks of every large matrix now, so that a layout that cannot tile them fails here
        rather than when the model is built."""
        from lean_transformer.layouts import make_layout, parse_layout  # ValueError on bad layouts

        spec = parse_layout(self.weight_layout)
        for name in ("hidden_size", "intermediate_size"):
            if getattr(self, name) % spec.block_size:
                raise ValueError(f"weight_layout {self.weight_layout!r}: block_size={spec.block_size} does not "
                                 f"divide {name} ({getattr(self, name)})")
        d, inner = self.hidden_size, self.intermediate_size
        # (out, in) of the qkv, attention output, feed-forward input and output projections
        for shape in {(3 * d, d), (d, d), (inner * (2 if self.is_gated else 1), d), (d, inner)}:
            make_layout(spec, *shape, balanced=True)


class LeanGPTConfig(LeanTransformerConfig):
    """A decoder-only causal language model."""

    model_type = "lean_gpt"

    def __init__(self, **kwargs):
        # an explicit __init__: transformers 5 would otherwise replace it by a dataclass one that skips ours
        super().__init__(**kwargs)


class LeanAlbertConfig(LeanTransformerConfig):
    """A bidirectional encoder pretrained with masked LM and sentence-order prediction."""

    model_type = "lean_albert"

    def __init__(self, type_vocab_size: int = 2, classifier_dropout_prob: float = 0.1, **kwargs):
        self.type_vocab_size = type_vocab_size
        self.classifier_dropout_prob = classifier_dropout_prob
        super().__init__(**kwargs)

    def validate(self) -> None:
        super().validate()
        self._check(("type_vocab_size",), _non_negative_int, "a non-negative integer")
        self._check(("classifier_dropout_prob",), _probability, "a number in [0, 1)")
