"""The Triton block-sparse kernels against the native path: on the CPU under ``TRITON_INTERPRET=1``, on CUDA compiled;
and compiled without a GPU for Hopper and consumer Ampere, where the compiler (not the interpreter) may refuse them.

The interpreter must be switched on before Triton is imported, so the kernels run in one child process for the whole
module (the rest of the suite keeps a normal Triton, or none): the parent draws the inputs, the child runs the
kernels on them, and the parent compares with the native path it runs itself.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lean_transformer.modules.blocksparse import BlockSparseLinear
from lean_transformer.modules.blocksparse import native

pytest.importorskip("triton")

RTOL, ATOL = 1e-4, 1e-5
KERNEL_CASES = [  # in_features, out_features, layout, tokens (not multiples of the token tiles: edges are masked)
    (128, 256, "pixelfly(block_size=16)", 70),
    (256, 128, "pixelfly(block_size=16)", 33),
    (128, 512, "pixelfly(block_size=32, n_factors=1)", 45),
    (512, 128, "pixelfly(block_size=32, stretch=True)", 20),
    (256, 512, "pixelfly(block_size=64)", 40),
    (512, 256, "pixelfly(block_size=64)", 17),
    (256, 512, "pixelfly(block_size=128)", 9),
    (192, 64, "hypercube(block_size=16, folded=True)", 25),  # columns hold different numbers of blocks
]
LAYER_CASE = (256, 128, "pixelfly(block_size=32)", 4, 21)  # in, out, layout, lowrank_dim, tokens

CHILD = textwrap.dedent("""
    import sys
    import torch
    from lean_transformer.modules.blocksparse import BlockSparseLinear
    from lean_transformer.modules.blocksparse import triton_kernel

    inputs = torch.load(sys.argv[1])
    results = {"kernels": [], "function": []}
    for case in inputs["kernels"]:
        index = triton_kernel.LayoutIndex.build(case["col_index"], case["in_blocks"], torch.device("cpu"))
        y = triton_kernel.blocksparse_matmul(case["x"], case["blocks"], index)
        grad_x, grad_blocks = triton_kernel.blocksparse_matmul_backward(
            case["x"], case["grad_y"], case["blocks"], index, True, True)
        results["kernels"].append((y, grad_x, grad_blocks))
        x, blocks = case["x"].clone().requires_grad_(), case["blocks"].clone().requires_grad_()
        triton_kernel.BlockSparseMatmul.apply(x, blocks, index).backward(case["grad_y"])
        results["function"].append((x.grad, blocks.grad))

    case = inputs["layer"]
    layer = BlockSparseLinear(*case["args"], backend="triton")
    layer.load_state_dict(case["state"])
    x = case["x"].clone().requires_grad_()
    y = layer(x)
    y.backward(case["grad_y"])
    grad_x, grads = layer.op_backward(case["x"], case["grad_y"], layer.op_params())
    results["layer"] = dict(y=y.detach(), x_grad=x.grad, param_grads=[p.grad for p in layer.op_params()],
                            op_grad_x=grad_x, op_grads=list(grads), backend_used=layer.backend_used)
    torch.save(results, sys.argv[2])
""")


def kernel_inputs(in_features: int, out_features: int, layout: str, tokens: int) -> dict:
    """Random inputs scaled so that outputs and gradients are O(1)."""
    layer = BlockSparseLinear(in_features, out_features, layout)
    col_index = layer.col_index(torch.device("cpu"))
    fan_in = col_index.shape[1] * layer.block_size
    return dict(col_index=col_index, in_blocks=in_features // layer.block_size,
                blocks=torch.randn_like(layer.blocks) / fan_in ** 0.5, x=torch.randn(tokens, in_features),
                grad_y=torch.randn(tokens, out_features) / tokens ** 0.5)


def layer_inputs(in_features: int, out_features: int, layout: str, lowrank_dim: int, tokens: int) -> dict:
    layer = BlockSparseLinear(in_features, out_features, layout, lowrank_dim=lowrank_dim, backend="native")
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(std=0.1)
    return dict(args=(in_features, out_features, layout, lowrank_dim), state=layer.state_dict(),
                x=torch.randn(3, tokens, in_features), grad_y=torch.randn(3, tokens, out_features) / tokens ** 0.5)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """(inputs, results): the kernels run once, under the interpreter in a child process, on fresh inputs."""
    torch.manual_seed(0)
    inputs = dict(kernels=[kernel_inputs(*case) for case in KERNEL_CASES], layer=layer_inputs(*LAYER_CASE))
    folder = tmp_path_factory.mktemp("triton")
    torch.save(inputs, folder / "inputs.pt")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH")])))
    child = subprocess.run([sys.executable, "-c", CHILD, str(folder / "inputs.pt"), str(folder / "results.pt")],
                           env=env, capture_output=True, text=True, timeout=240)
    assert child.returncode == 0, child.stderr[-4000:]
    return inputs, torch.load(folder / "results.pt")


@pytest.mark.parametrize("case", range(len(KERNEL_CASES)), ids=[f"{i}->{o} {lay}" for i, o, lay, _ in KERNEL_CASES])
def test_interpreted_kernels_match_the_native_path(interpreted, case):
    inputs, results = interpreted
    given = inputs["kernels"][case]
    y, grad_x, grad_blocks = results["kernels"][case]
    torch.testing.assert_close(y, native.blocksparse_matmul(given["x"], given["blocks"], given["col_index"]),
                               rtol=RTOL, atol=ATOL)
    want_x, want_blocks = native.blocksparse_matmul_backward(given["x"], given["grad_y"], given["blocks"],
                                                             given["col_index"], True, True)
    torch.testing.assert_close(grad_x, want_x, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad_blocks, want_blocks, rtol=RTOL, atol=ATOL)
    function_x, function_blocks = results["function"][case]  # the autograd.Function: the same kernels
    torch.testing.assert_close(function_x, want_x, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(function_blocks, want_blocks, rtol=RTOL, atol=ATOL)


def test_interpreted_layer_with_low_rank_and_bias_matches_the_native_layer(interpreted):
    inputs, results = interpreted
    case, got = inputs["layer"], results["layer"]
    assert got["backend_used"] == "triton"
    layer = BlockSparseLinear(*case["args"], backend="native")
    layer.load_state_dict(case["state"])
    x = case["x"].clone().requires_grad_()
    y = layer(x)
    y.backward(case["grad_y"])
    assert layer.backend_used == "native"
    torch.testing.assert_close(got["y"], y.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got["x_grad"], x.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got["op_grad_x"], x.grad, rtol=RTOL, atol=ATOL)
    params = layer.op_params()
    assert len(got["param_grads"]) == len(got["op_grads"]) == len(params) == 4  # blocks, U, V, bias
    for autograd_grad, op_grad, param in zip(got["param_grads"], got["op_grads"], params):
        torch.testing.assert_close(autograd_grad, param.grad, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(op_grad, param.grad, rtol=RTOL, atol=ATOL)


INDEX_ARGS = {"col_index_ptr", "col_ptr_ptr", "entry_row_ptr", "entry_slot_ptr"}
SHARED_MEMORY_LIMIT = {90: 227 * 1024, 86: 99 * 1024}  # bytes per block: H100, RTX 30xx (the 40xx: the same)


def compile_for(kernel, data_type: str, constexprs: dict, num_warps: int, capability: int):
    """``kernel`` compiled to a cubin for ``sm_<capability>`` with no GPU here, specialized as a launch on our
    tensors would be (16-byte aligned pointers, strides divisible by 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for position, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*i32" if name in INDEX_ARGS else "*fp32" if name == "dw_ptr" else f"*{data_type}"
            attrs[(position,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if name.startswith("stride"):
                attrs[(position,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", capability, 32),
                          options=dict(num_warps=num_warps, num_stages=3))


COMPILE_CASES = [(90, dtype, size) for dtype in ("bf16", "fp32") for size in (16, 32, 64, 128)] + [(86, "bf16", 128)]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles, so not under the interpreter")
@pytest.mark.parametrize("capability,data_type,block_size", COMPILE_CASES)
def test_kernels_compile_for_the_gpu_within_its_shared_memory(capability, data_type, block_size):
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no NVIDIA backend")
    from lean_transformer.modules.blocksparse import triton_kernel

    cfg = triton_kernel._config(block_size, {"bf16": torch.bfloat16, "fp32": torch.float32}[data_type])
    tiles = dict(BS=block_size, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, PRECISION=cfg.precision)
    kernels = [(triton_kernel._forward_kernel, tiles), (triton_kernel._grad_input_kernel, tiles),
               (triton_kernel._grad_weight_kernel, dict(BS=block_size, BLOCK_T=cfg.block_t, PRECISION=cfg.precision))]
    for kernel, constexprs in kernels:
        compiled = compile_for(kernel, data_type, constexprs, cfg.num_warps, capability)
        assert 0 < compiled.metadata.shared <= SHARED_MEMORY_LIMIT[capability], kernel.__name__
        if capability == 90 and data_type == "bf16" and block_size >= 64:  # the tensor-core path, not a fallback
            assert "wgmma" in compiled.asm["ptx"], kernel.__name__


def test_auto_backend_is_native_on_the_cpu_and_bad_backends_are_refused():
    layer = BlockSparseLinear(64, 128, "pixelfly(block_size=16)")
    layer(torch.randn(5, 64))
    assert layer.backend == "auto" and layer.backend_used == "native"
    with pytest.raises(ValueError, match="backend must be one of"):
        BlockSparseLinear(64, 128, "pixelfly(block_size=16)", backend="cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_cuda_auto_backend_runs_the_kernels_and_matches_the_native_path(autocast):
    torch.manual_seed(0)
    device = torch.device("cuda")
    layers = {backend: BlockSparseLinear(512, 2048, "pixelfly(block_size=64)", lowrank_dim=8, backend=backend)
              .to(device) for backend in ("auto", "native")}
    layers["native"].load_state_dict(layers["auto"].state_dict())
    x = torch.randn(300, 512, device=device)
    grad_y = torch.randn(300, 2048, device=device)
    outputs = {}
    for backend, layer in layers.items():
        x_in = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x_in)
        y.backward(grad_y.to(y.dtype))
        outputs[backend] = [y.float(), x_in.grad, *(p.grad for p in layer.op_params())]
    assert layers["auto"].backend_used == "triton"
    # bf16: both paths round the same operands; the native one also adds the input gradient up in bf16
    tolerance = dict(rtol=2e-2, atol=5e-2) if autocast else dict(rtol=RTOL, atol=ATOL)
    for got, want in zip(outputs["auto"], outputs["native"]):
        torch.testing.assert_close(got, want.float() if autocast else want, **tolerance)
