"""Block-sparse (PixelFly) vs dense weights: parameter bytes and forward+backward time of one FFN matrix, and
the training memory of a small LeanGPT.

Part 1 times forward + backward (grad of input, weights and bias) of the two 4096x16384 FFN matrices at 1/8
density (``pixelfly(block_size=128, n_factors=3)``: 4 of every 32 blocks per row) against dense layers of the same
shape on the same tokens, run alternately. On the CPU: float32, the native block-sparse path, best of ``--reps`` (the
least disturbed run on a shared machine). On a CUDA GPU, if present: dense vs the native path vs the Triton kernels
(``backend="auto"``, which says whether the kernels ran or fell back), in bfloat16 autocast and in float32 (TF32 as
torch's matmul setting says), with more tokens, median of ``--gpu-reps`` runs timed with CUDA events; plus the largest
difference between the Triton and the native results, relative to the largest native value.
Part 2 is the README's memory row: a LeanGPT with pixelfly weights vs the dense one; training memory = parameters
+ gradients + Adam's two moments (fp32) + activations saved for backward (counted with saved_tensors_hooks).

The tables are printed and written to ``<--out>/blocksparse.json`` (benchmarks/results/ by default).

Usage: python benchmarks/blocksparse.py [--tokens 256] [--gpu-tokens 8192] [--reps 3] [--gpu-reps 5] [--seq 256]
       [--threads N] [--out DIR]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from lean_transformer import LeanGPTConfig, LeanGPTForCausalLM
from lean_transformer.modules.blocksparse import BlockSparseLinear
from lean_transformer.modules.blocksparse import layer as blocksparse_layer
from lean_transformer.modules.linear import DenseLinear
from lean_transformer.modules.memory import SavedTensorCounter

REPO = Path(__file__).resolve().parent.parent
LAYOUT = "pixelfly(block_size=128, n_factors=3)"
HIDDEN, INNER = 4096, 16384


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def step_time(layer: nn.Module, x: torch.Tensor, grad_y: torch.Tensor) -> Callable[[], float]:
    """A closure timing one forward + backward of ``layer`` on the CPU (seconds)."""

    def run() -> float:
        start = time.perf_counter()
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(grad_y)
        return time.perf_counter() - start

    return run


def compare_matrices(tokens: int, reps: int) -> list[tuple[str, ...]]:
    """The CPU table: dense vs the native block-sparse path, float32, best of ``reps``."""
    rows = []
    for in_features, out_features in ((HIDDEN, INNER), (INNER, HIDDEN)):
        dense = DenseLinear(in_features, out_features)
        sparse = BlockSparseLinear(in_features, out_features, LAYOUT)
        x = torch.randn(tokens, in_features, requires_grad=True)
        grad_y = torch.randn(tokens, out_features)
        runs = {"dense": step_time(dense, x, grad_y), "sparse": step_time(sparse, x, grad_y)}
        for run in runs.values():
            run()  # warm-up
        times: dict[str, list[float]] = {name: [] for name in runs}
        for rep in range(reps):
            for name, run in runs.items():  # alternate, so that both see the same machine load
                times[name].append(run())
            log(f"  cpu {in_features}->{out_features}: rep {rep + 1}/{reps} "
                f"dense {times['dense'][-1]:.3f}s sparse {times['sparse'][-1]:.3f}s")
        dense_t, sparse_t = (min(times[name]) for name in ("dense", "sparse"))
        rows.append((f"cpu, fp32, {torch.get_num_threads()} threads, {tokens} tokens",
                     f"{in_features}->{out_features}", f"{sparse.density:.4g}",
                     f"{param_bytes(dense) / 2**20:.1f} / {param_bytes(sparse) / 2**20:.1f} MiB",
                     f"{param_bytes(sparse) / param_bytes(dense):.3f}",
                     f"{dense_t * 1e3:.1f} / {sparse_t * 1e3:.1f} ms", f"{sparse_t / dense_t:.3f}"))
    return rows


def cuda_step(layer: nn.Module, x: torch.Tensor, grad_y: torch.Tensor, autocast: bool) -> Callable[[], float]:
    """A closure timing one forward + backward of ``layer`` on the GPU with CUDA events (seconds)."""

    def run() -> float:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
        y.backward(grad_y)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return run


def relative_difference(layer: BlockSparseLinear, reference: BlockSparseLinear, x: torch.Tensor,
                        grad_y: torch.Tensor, autocast: bool) -> float:
    """max |a - b| / max |b| over the output, the input gradient and the block gradient of two layers with equal
    weights (the largest of the three)."""
    results = []
    for module in (layer, reference):
        module.zero_grad(set_to_none=True)
        x_in = x.detach().clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = module(x_in)
        y.backward(grad_y)
        results.append([y.detach().float(), x_in.grad.float(), module.blocks.grad.float()])
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*results))


def compare_gpu(tokens: int, reps: int, autocast: bool) -> list[tuple[str, ...]]:
    """The GPU table: dense vs native vs Triton block-sparse, median of ``reps`` forward + backward runs."""
    device = torch.device("cuda")
    precision = "bf16 autocast" if autocast else ("fp32, TF32" if torch.backends.cuda.matmul.allow_tf32 else "fp32")
    rows = []
    for in_features, out_features in ((HIDDEN, INNER), (INNER, HIDDEN)):
        dense = DenseLinear(in_features, out_features).to(device)
        native = BlockSparseLinear(in_features, out_features, LAYOUT, backend="native").to(device)
        triton = BlockSparseLinear(in_features, out_features, LAYOUT, backend="auto").to(device)
        triton.load_state_dict(native.state_dict())
        x = torch.randn(tokens, in_features, device=device, requires_grad=True)
        grad_y = torch.randn(tokens, out_features, device=device, dtype=torch.bfloat16 if autocast else None)
        layers = {"dense": dense, "native": native, "triton": triton}
        runs = {name: cuda_step(layer, x, grad_y, autocast) for name, layer in layers.items()}
        for run in runs.values():
            run(), run()  # warm-up (the first call compiles the Triton kernels)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(reps):
            for name, run in runs.items():  # alternate, so that all see the same GPU state
                times[name].append(run())
        median = {name: statistics.median(values) for name, values in times.items()}
        difference = relative_difference(triton, native, x, grad_y, autocast)
        log(f"  cuda {precision} {in_features}->{out_features}: " + ", ".join(
            f"{name} {median[name] * 1e3:.2f} ms" for name in runs) + f"; Triton path ran: {triton.backend_used}")
        rows.append((f"{torch.cuda.get_device_name()}, {precision}, {tokens} tokens", f"{in_features}->{out_features}",
                     f"{native.density:.4g}", *(f"{median[name] * 1e3:.2f}" for name in runs),
                     f"{median['native'] / median['dense']:.3f}", f"{median['triton'] / median['dense']:.3f}",
                     triton.backend_used, f"{difference:.1e}"))
    return rows


def training_memory(model: LeanGPTForCausalLM, input_ids: torch.Tensor) -> dict[str, int]:
    model.train()
    with SavedTensorCounter(exclude=model.parameters()).record() as counter:
        model(input_ids, labels=input_ids)
    weights = param_bytes(model)
    return dict(params=sum(p.numel() for p in model.parameters()), weights=weights, activations=counter.nbytes,
                total=weights * 4 + counter.nbytes)  # weights + grads + Adam's two moments + saved activations


def compare_models(seq: int) -> list[tuple[str, ...]]:
    base = dict(vocab_size=8192, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                max_position_embeddings=seq, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    variants = {"dense": dict(), "pixelfly(block_size=64, n_factors=2) + lowrank 32":
                dict(weight_layout="pixelfly(block_size=64, n_factors=2)", lowrank_dim=32)}
    input_ids = torch.randint(0, base["vocab_size"], (1, seq))
    results = {}
    for name, extra in variants.items():
        log(f"  LeanGPT {name}: measuring")
        torch.manual_seed(0)
        results[name] = training_memory(LeanGPTForCausalLM(LeanGPTConfig(**base, **extra)), input_ids)
    dense = results["dense"]
    rows = []
    for name, r in results.items():
        mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
        rows.append((f"LeanGPT d=1024, 4 layers, vocab 8192, T={seq}: {name}", f"{r['params'] / 1e6:.2f}M",
                     f"{r['params'] / dense['params']:.3f}", mib(r["weights"]), mib(r["weights"]),
                     mib(r["activations"]), mib(r["total"]), f"{r['total'] / dense['total']:.3f}"))
    return rows


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def machine() -> str:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    host = f"{os.cpu_count()} CPU cores ({platform.machine()}), {memory:.0f} GB RAM"
    if torch.cuda.is_available():
        return f"{host}, {torch.cuda.get_device_name()}"
    return f"{host}, no GPU"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens per forward+backward on CPU")
    parser.add_argument("--gpu-tokens", type=int, default=8192, help="tokens per forward+backward on a GPU")
    parser.add_argument("--reps", type=int, default=3, help="CPU runs per layer (the best counts)")
    parser.add_argument("--gpu-reps", type=int, default=5, help="GPU runs per layer (the median counts)")
    parser.add_argument("--seq", type=int, default=256, help="sequence length of the LeanGPT memory row")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (torch's default if omitted); 1 is steadier on a busy machine")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results",
                        help="folder for blocksparse.json")
    args = parser.parse_args()
    for name in ("tokens", "gpu_tokens", "reps", "gpu_reps", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    tables = []
    matrix_header = ("device, tokens", "matrix", "density", "params dense / sparse", "ratio", "fwd+bwd dense / sparse",
                     "time ratio")
    rows = compare_matrices(args.tokens, args.reps)
    tables.append(dict(title=f"One FFN matrix on the CPU, {LAYOUT} (native path) vs dense (forward + backward, "
                             f"best of {args.reps})", columns=list(matrix_header), rows=[list(r) for r in rows],
                       notes="float32; time ratio = sparse / dense"))
    if torch.cuda.is_available():
        gpu_header = ("device, precision, tokens", "matrix", "density", "dense ms", "native ms", "triton ms",
                      "native / dense", "triton / dense", "Triton path ran", "max rel. diff triton vs native")
        gpu_rows = compare_gpu(args.gpu_tokens, args.gpu_reps, autocast=True)
        gpu_rows += compare_gpu(args.gpu_tokens, args.gpu_reps, autocast=False)
        failure = blocksparse_layer._triton_failure
        notes = (f"median of {args.gpu_reps} forward + backward runs (CUDA events), run alternately; "
                 "target: triton / dense <= 0.35" + (f"; the Triton kernels failed: {failure}" if failure else ""))
        tables.append(dict(title=f"One FFN matrix on the GPU, {LAYOUT}: dense vs native vs Triton",
                           columns=list(gpu_header), rows=[list(r) for r in gpu_rows], notes=notes))
    model_header = ("model", "params", "ratio", "weights MiB", "grads MiB", "activations MiB", "total MiB",
                    "total ratio")
    model_rows = compare_models(args.seq)
    tables.append(dict(title="Training memory, fp32: weights + grads + Adam moments (2x) + activations saved for "
                             "backward (one sequence)", columns=list(model_header),
                       rows=[list(r) for r in model_rows], notes="total ratio = block-sparse / dense"))

    for entry in tables:
        print(f"\n{entry['title']}\n")
        print(table(tuple(entry["columns"]), [tuple(r) for r in entry["rows"]]))
        print(f"\n{entry['notes']}")
    result = dict(benchmark="blocksparse", command="python benchmarks/blocksparse.py " + " ".join(sys.argv[1:]),
                  machine=machine(), date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                  commit=commit(), baseline="dense layers of the same shape on the same tokens, run alternately",
                  tables=tables)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "blocksparse.json").write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {args.out / 'blocksparse.json'}")


if __name__ == "__main__":
    main()
