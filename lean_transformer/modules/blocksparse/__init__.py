"""Block-sparse weights (PixelFly and friends) for the large projections.

``weight_layout="pixelfly(block_size=64)"`` in the config makes every large matrix a ``BlockSparseLinear``: only the
blocks its layout keeps are stored and multiplied, by a pure-PyTorch backend (gathers + batched matmuls) that runs
on CPU and GPU. Layouts come from a registry that ``register_layout`` extends (:mod:`lean_transformer.layouts`, below
the config, which checks a layout against the model's shapes).
"""
from lean_transformer.modules.blocksparse.layer import BlockSparseLinear
from lean_transformer.layouts import LayoutSpec, make_layout, parse_layout, register_layout, registered_layouts

__all__ = ["BlockSparseLinear", "LayoutSpec", "make_layout", "parse_layout", "register_layout", "registered_layouts"]
