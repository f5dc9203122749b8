"""Architecture configs. Everything here changes what the model computes; options that only trade
memory for compute (checkpointing, the hand-written FFN backward, ...) are set at run time with
``model.set_optimizations(...)`` and are not part of the config."""
from __future__ import annotations

from typing import Optional

from transformers import PretrainedConfig

ACTIVATIONS = ("gelu", "gelu_new", "relu", "silu")
GATED_ACTIVATIONS = {"geglu": "gelu", "swiglu": "silu"}  # gated name -> the activation applied to the gate
POSITION_EMBEDDING_TYPES = ("rotary", "absolute")


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
        self.intermediate_size = intermediate_size if intermediate_size is not None else 4 * hidden_size
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
        super().__init__(
            tie_word_embeddings=tie_word_embeddings,
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            **kwargs,
        )
        self.validate()

    @property
    def is_gated(self) -> bool:
        return self.hidden_act in GATED_ACTIVATIONS

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        """Raise ValueError naming the first field that makes this config unusable."""

        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("vocab_size", "embedding_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "num_hidden_groups", "num_inner_groups",
                     "num_shared_matrices"):
            positive(name)
        for name in ("adapter_dim", "lowrank_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {getattr(self, name)!r}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by "
                             f"num_attention_heads ({self.num_attention_heads})")
        if self.position_embedding_type == "rotary" and self.head_dim % 2 != 0:
            raise ValueError(f"position_embedding_type='rotary' needs an even head dimension, got {self.head_dim}")
        if self.hidden_act not in ACTIVATIONS and self.hidden_act not in GATED_ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {ACTIVATIONS + tuple(GATED_ACTIVATIONS)}, "
                             f"got {self.hidden_act!r}")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"position_embedding_type must be one of {POSITION_EMBEDDING_TYPES}, "
                             f"got {self.position_embedding_type!r}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.num_hidden_layers % self.num_hidden_groups != 0:
            raise ValueError(f"num_hidden_groups ({self.num_hidden_groups}) must divide "
                             f"num_hidden_layers ({self.num_hidden_layers})")
        layers_per_group = self.num_hidden_layers // self.num_hidden_groups
        if layers_per_group % self.num_inner_groups != 0:
            raise ValueError(f"num_inner_groups ({self.num_inner_groups}) must divide the number of layers "
                             f"per hidden group ({layers_per_group})")
        if self.adapter_dim and not self.share_large_matrices:
            raise ValueError("adapter_dim > 0 needs share_large_matrices=True (adapters specialize shared matrices)")
        if self.lowrank_dim and self.weight_layout is None:
            raise ValueError("lowrank_dim > 0 needs a block-sparse weight_layout")
        if self.weight_layout is not None:
            from lean_transformer.modules.blocksparse import parse_layout  # raises ValueError on bad strings

            parse_layout(self.weight_layout)


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
        kwargs.setdefault("tie_word_embeddings", True)
        super().__init__(**kwargs)

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.type_vocab_size, int) or self.type_vocab_size < 0:
            raise ValueError(f"type_vocab_size must be a non-negative integer, got {self.type_vocab_size!r}")
        if not 0.0 <= self.classifier_dropout_prob < 1.0:
            raise ValueError(f"classifier_dropout_prob must be in [0, 1), got {self.classifier_dropout_prob!r}")
