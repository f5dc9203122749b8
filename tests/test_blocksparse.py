"""Block-sparse layouts and BlockSparseLinear, checked against dense matmuls with masked weights."""
import copy
from fractions import Fraction

import pytest
import torch
from torch import nn

from lean_transformer.modules.blocksparse import BlockSparseLinear, make_layout, parse_layout, register_layout
from lean_transformer.modules.linear import SharedLinear
from lean_transformer.modules.linear_op import LinearOp

RTOL, ATOL = 1e-4, 1e-5


@register_layout("test_shifted_band")
def shifted_band(out_blocks: int, in_blocks: int, *, width: int = 1) -> torch.Tensor:
    """A user layout: row o keeps ``width`` consecutive blocks (cyclically) from block ``o * in_blocks // out_blocks``."""
    starts = torch.arange(out_blocks) * in_blocks // out_blocks
    return (torch.arange(in_blocks)[None, :] - starts[:, None]) % in_blocks < width


@register_layout("test_lower_triangle")
def lower_triangle(out_blocks: int, in_blocks: int) -> torch.Tensor:
    return torch.ones(out_blocks, in_blocks, dtype=torch.bool).tril()


def reference_weight(layer: BlockSparseLinear, mask: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The dense masked matrix, built block by block (differentiably) from the documented storage order: row o's
    kept blocks, by increasing input block, are the consecutive column slices of blocks[o]."""
    size = layer.block_size
    weight = torch.zeros(layer.out_features, layer.in_features, dtype=blocks.dtype)
    for o in range(mask.shape[0]):
        for t, j in enumerate(mask[o].nonzero().flatten().tolist()):
            weight[o * size:(o + 1) * size, j * size:(j + 1) * size] = blocks[o, :, t * size:(t + 1) * size]
    return weight


def randomized(layer: nn.Module) -> nn.Module:
    """Every parameter random, so that low-rank terms, adapters and biases matter (some start at zero)."""
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_()
    return layer


def check_matches_masked_dense(layer: LinearOp, core: BlockSparseLinear, x: torch.Tensor) -> None:
    """``layer``'s op_params() are ``core.blocks``, then (in-factor, out-factor) pairs of low-rank terms (the
    core's own, then adapters), then possibly a bias. Its forward, its autograd gradients and its op_backward
    must equal those of ``x @ W_masked^T + sum (x @ P_in^T) @ P_out^T + b`` computed densely."""
    grad_y = torch.randn(*x.shape[:-1], layer.out_features)
    mask = make_layout(core.layout, core.out_features, core.in_features)
    params = [p.detach().clone().requires_grad_() for p in layer.op_params()]
    x_ref = x.detach().clone().requires_grad_()
    y_ref = x_ref @ reference_weight(core, mask, params[0]).t()
    factors = params[1:-1] if params[-1].dim() == 1 else params[1:]
    for factor_in, factor_out in zip(factors[0::2], factors[1::2]):
        y_ref = y_ref + (x_ref @ factor_in.t()) @ factor_out.t()
    if params[-1].dim() == 1:
        y_ref = y_ref + params[-1]
    y_ref.backward(grad_y)

    for param in layer.op_params():
        param.grad = None  # a shared core may carry another layer's gradient
    x = x.detach().requires_grad_()
    y = layer(x)  # autograd through op_forward
    torch.testing.assert_close(y, y_ref, rtol=RTOL, atol=ATOL)
    y.backward(grad_y)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=RTOL, atol=ATOL)
    for param, want in zip(layer.op_params(), params):
        torch.testing.assert_close(param.grad, want.grad, rtol=RTOL, atol=ATOL)

    grad_x, grads = layer.op_backward(x.detach(), grad_y, layer.op_params())  # the protocol's explicit backward
    torch.testing.assert_close(grad_x, x_ref.grad, rtol=RTOL, atol=ATOL)
    assert len(grads) == len(params)
    for got, want in zip(grads, params):
        torch.testing.assert_close(got, want.grad, rtol=RTOL, atol=ATOL)


CASES = [  # in, out, layout, lowrank_dim, bias
    (64, 256, "pixelfly(block_size=8)", 0, True),
    (256, 64, "pixelfly(block_size=16, stretch=True)", 4, True),
    (96, 96, "hypercube(block_size=8, folded=True)", 3, False),  # 12 blocks: a 4-node cube tiled 3x3
    (128, 32, "pixelfly(block_size=4, n_factors=2)", 0, False),
    (64, 16, "test_shifted_band(block_size=4, width=5)", 2, True),  # 5 blocks per row in chunks of 4 and 1
    (48, 192, "dense(block_size=16)", 2, True),
]


@pytest.mark.parametrize("in_features,out_features,layout,lowrank_dim,bias", CASES)
def test_forward_and_gradients_match_masked_dense(in_features, out_features, layout, lowrank_dim, bias):
    torch.manual_seed(0)
    layer = randomized(BlockSparseLinear(in_features, out_features, layout, lowrank_dim=lowrank_dim, bias=bias))
    check_matches_masked_dense(layer, layer, torch.randn(2, 7, in_features))


@pytest.mark.parametrize("lowrank_dim", [0, 2])
def test_shared_block_sparse_matrix_with_adapter_matches_masked_dense(lowrank_dim):
    """A block-sparse matrix shared by layers, each adding its own adapter and bias (SharedLinear)."""
    torch.manual_seed(0)
    core = BlockSparseLinear(64, 128, "pixelfly(block_size=8)", lowrank_dim=lowrank_dim, bias=False)
    layers = [randomized(SharedLinear(randomized(core), adapter_dim=3)) for _ in range(2)]
    for layer in layers:
        check_matches_masked_dense(layer, core, torch.randn(5, 64))


def test_dense_weight_is_the_masked_matrix_plus_the_low_rank_term():
    layer = randomized(BlockSparseLinear(64, 128, "hypercube(block_size=8, folded=True)", lowrank_dim=3))
    mask = make_layout(layer.layout, 128, 64)
    expected = reference_weight(layer, mask, layer.blocks) + layer.lowrank_out @ layer.lowrank_in
    torch.testing.assert_close(layer.dense_weight(), expected, rtol=RTOL, atol=ATOL)


def test_frozen_parameters_get_no_gradient():
    torch.manual_seed(0)
    layer = randomized(BlockSparseLinear(32, 64, "pixelfly(block_size=8)", lowrank_dim=2))
    layer.blocks.requires_grad_(False)
    layer.lowrank_in.requires_grad_(False)
    x = torch.randn(5, 32)
    _, grads = layer.op_backward(x, torch.randn(5, 64), layer.op_params())
    assert grads[0] is None and grads[1] is None
    assert grads[2] is not None and grads[3] is not None


@pytest.mark.parametrize("in_features,out_features", [(16, 32), (32, 8)])  # (32, 8): 4 blocks per bmm
def test_gradcheck_float64(in_features, out_features):
    torch.manual_seed(0)
    layer = BlockSparseLinear(in_features, out_features, "hypercube(block_size=4, folded=True)", lowrank_dim=2)
    layer = randomized(layer).double()
    x = torch.randn(3, in_features, dtype=torch.float64, requires_grad=True)

    def fn(x, *params):
        return layer.op_forward(x, params)

    assert torch.autograd.gradcheck(fn, (x, *layer.op_params()))


def test_empty_batch():
    layer = BlockSparseLinear(32, 64, "pixelfly(block_size=8)", lowrank_dim=2)
    x = torch.zeros(0, 32, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 64)
    y.sum().backward()
    assert x.grad.shape == (0, 32) and torch.equal(layer.bias.grad, torch.zeros(64))


def test_autocast_bfloat16_computes_in_half_and_returns_parameter_dtypes():
    torch.manual_seed(0)
    layer = randomized(BlockSparseLinear(64, 128, "pixelfly(block_size=16)", lowrank_dim=4))
    x = torch.randn(8, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y_float = layer(x)
    assert (y.float() - y_float).norm() / y_float.norm() < 1e-2  # bf16 has an 8-bit mantissa
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and all(p.grad.dtype == torch.float32 for p in layer.parameters())


def xor_pixelfly(size: int, n_factors: int) -> torch.Tensor:
    """The flat butterfly spelled out: blocks whose indices are equal or differ in one bit below 2**n_factors."""
    return torch.tensor([[i == j or (bin(i ^ j).count("1") == 1 and i ^ j < 2 ** n_factors) for j in range(size)]
                         for i in range(size)])


@pytest.mark.parametrize("size,n_factors", [(8, 3), (16, 2), (32, 3), (32, 5)])
def test_pixelfly_is_the_flat_butterfly(size, n_factors):
    mask = make_layout(f"pixelfly(block_size=2, n_factors={n_factors})", 2 * size, 2 * size)
    assert torch.equal(mask, xor_pixelfly(size, n_factors))


@pytest.mark.parametrize("stretch", [False, True])
def test_rectangular_pixelfly_extends_the_square(stretch):
    square = xor_pixelfly(8, 3)
    tall = make_layout(f"pixelfly(block_size=4, stretch={stretch})", 4 * 32, 32)
    wide = make_layout(f"pixelfly(block_size=4, stretch={stretch})", 32, 4 * 32)
    for i in range(32):
        source = i // 4 if stretch else i % 8
        assert torch.equal(tall[i], square[source])
        assert torch.equal(wide[:, i], square[:, source])


def test_hypercube_folded_adds_the_complement():
    plain = make_layout("hypercube(block_size=1)", 16, 16)
    folded = make_layout("hypercube(block_size=1, folded=True)", 16, 16)
    assert torch.equal(plain, xor_pixelfly(16, 4))
    assert torch.equal(folded & ~plain, torch.eye(16, dtype=torch.bool).flip(1))


# in, out, layout, lowrank_dim, the kept fraction of the dense matrix (from the layout's definition)
FRACTIONS = [
    (128, 128, "pixelfly(block_size=4, n_factors=3)", 0, Fraction(4, 32)),  # 4 blocks per row of 32: 1/8
    (128, 128, "pixelfly(block_size=4, n_factors=3)", 8, Fraction(4, 32)),
    (128, 128, "pixelfly(block_size=4)", 0, Fraction(1 + 5, 32)),
    (64, 256, "pixelfly(block_size=8)", 4, Fraction(1 + 3, 8)),
    (256, 64, "hypercube(block_size=4, folded=True)", 0, Fraction(1 + 4 + 1, 16)),
    (96, 384, "pixelfly(block_size=8, n_factors=1)", 2, Fraction(1 + 1, 4)),  # 12 blocks: a 4-block butterfly
    (64, 64, "dense(block_size=16)", 0, Fraction(1)),
]


@pytest.mark.parametrize("in_features,out_features,layout,lowrank_dim,fraction", FRACTIONS)
def test_parameter_count_follows_the_layout(in_features, out_features, layout, lowrank_dim, fraction):
    layer = BlockSparseLinear(in_features, out_features, layout, lowrank_dim=lowrank_dim)
    expected = fraction * in_features * out_features + lowrank_dim * (in_features + out_features) + out_features
    assert sum(p.numel() for p in layer.parameters()) == expected
    assert layer.density == fraction
    mask = layer.layout_mask()
    assert torch.equal(mask, make_layout(layout, out_features, in_features))
    assert len(mask.sum(0).unique()) == 1 and len(mask.sum(1).unique()) == 1  # every row and column alike


def test_user_layout_is_used():
    layer = BlockSparseLinear(64, 16, "test_shifted_band(block_size=4, width=5)")
    assert torch.equal(layer.layout_mask(), shifted_band(4, 16, width=5))
    assert layer.blocks.shape == (4, 4, 5 * 4)


def test_parse_layout():
    spec = parse_layout(" hypercube(block_size=32, folded=True) ")
    assert (spec.name, spec.block_size, dict(spec.kwargs)) == ("hypercube", 32, {"folded": True})
    assert parse_layout(str(spec)) == spec


@pytest.mark.parametrize("layout,message", [
    ("pixelfly", "form"),
    ("pixelfly(block_size=8", "form"),
    ("pixelfly(block_size=8); import os", "form"),
    ("layouts.pixelfly(block_size=8)", "form"),
    ("pixelfly(block_size=8)(stretch=True)", "form"),
    ("nosuch(block_size=8)", "unknown layout 'nosuch'"),
    ("pixelfly(8)", "keyword"),
    ("pixelfly(stretch=True)", "block_size must be a positive integer"),
    ("pixelfly(block_size=0)", "block_size must be a positive integer"),
    ("pixelfly(block_size=8.0)", "block_size must be a positive integer"),
    ("pixelfly(block_size=True)", "block_size must be a positive integer"),
    ("pixelfly(block_size=8, block_size=8)", "given twice"),
    ("pixelfly(block_size=8, colour=1)", "colour"),
    ("pixelfly(block_size=8, **{'stretch': True})", r"'\*\*'"),
    ("pixelfly(block_size=exec('raise SystemExit'))", "literal"),
    (64, "must be a string"),
])
def test_malformed_layout_strings_raise(layout, message):
    with pytest.raises(ValueError, match=message):
        parse_layout(layout)


@pytest.mark.parametrize("layout,in_features,out_features,message", [
    ("pixelfly(block_size=32)", 48, 256, "does not divide in_features=48"),
    ("pixelfly(block_size=8)", 24, 40, "multiple"),  # 3 x 5 blocks
    ("pixelfly(block_size=8, butterfly_size=3)", 64, 64, "butterfly_size must be a power of two"),
    ("pixelfly(block_size=8, n_factors=4)", 64, 64, r"n_factors must be an integer in \[0, 3\]"),
    ("pixelfly(block_size=8, stretch='yes')", 64, 64, "stretch must be True or False"),
    ("hypercube(block_size=8, cube_size=16)", 64, 64, "cube_size"),
    ("test_lower_triangle(block_size=8)", 64, 64, "unbalanced"),
    ("test_shifted_band(block_size=8, width=0)", 64, 64, "without blocks"),
])
def test_bad_layouts_for_a_matrix_raise(layout, in_features, out_features, message):
    with pytest.raises(ValueError, match=message):
        BlockSparseLinear(in_features, out_features, layout)


def test_unbalanced_layout_is_fine_where_balance_is_not_needed():
    assert make_layout("test_lower_triangle(block_size=8)", 64, 64).sum() == 8 * 9 // 2


def test_layout_function_must_return_a_bool_mask():
    @register_layout("test_wrong_shape")
    def wrong_shape(out_blocks: int, in_blocks: int) -> torch.Tensor:
        return torch.ones(out_blocks, in_blocks + 1, dtype=torch.bool)

    with pytest.raises(ValueError, match="must return a bool tensor of shape"):
        make_layout("test_wrong_shape(block_size=4)", 16, 16)


def test_bad_lowrank_dim_raises():
    with pytest.raises(ValueError, match="lowrank_dim"):
        BlockSparseLinear(32, 32, "pixelfly(block_size=8)", lowrank_dim=-1)


def test_register_layout_needs_an_identifier():
    with pytest.raises(ValueError, match="identifier"):
        register_layout("not a name")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_is_as_exact_as_cpu():
    """CUDA and CPU sum in different orders, so their float32 results differ by rounding (3.6e-5 seen on an H100);
    both are compared with a float64 reference: CUDA's error must stay within a few times the CPU's."""
    torch.manual_seed(0)
    layer = randomized(BlockSparseLinear(256, 1024, "pixelfly(block_size=32)", lowrank_dim=4))
    x, grad_y = torch.randn(4, 33, 256), torch.randn(4, 33, 1024)

    def outputs(layer: BlockSparseLinear, x: torch.Tensor, grad_y: torch.Tensor) -> list[torch.Tensor]:
        grad_x, grads = layer.op_backward(x, grad_y, layer.op_params())
        return [layer(x), grad_x, *grads]

    cpu = outputs(layer, x, grad_y)
    cuda = outputs(copy.deepcopy(layer).cuda(), x.cuda(), grad_y.cuda())
    reference = outputs(copy.deepcopy(layer).double(), x.double(), grad_y.double())
    for on_cpu, on_cuda, exact in zip(cpu, cuda, reference):
        cpu_error = (on_cpu.double() - exact).abs().max().item()
        cuda_error = (on_cuda.cpu().double() - exact).abs().max().item()
        assert cuda_error <= 4 * cpu_error + 1e-6, (cuda_error, cpu_error)
