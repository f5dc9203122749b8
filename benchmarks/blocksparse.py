"""Block-sparse (PixelFly) vs dense weights: parameter bytes and forward+backward time of one FFN matrix, and
the training memory of a small LeanGPT.

Part 1 times forward + backward (grad of input, weights and bias) of the two 4096x16384 FFN matrices at 1/8
density (``pixelfly(block_size=128, n_factors=3)``: 4 of every 32 blocks per row) against dense layers of the same
shape on the same tokens, run alternately, best of ``--reps`` (the least disturbed run on a shared machine). CPU in float32; a CUDA GPU, if present, in
bfloat16 (autocast) with more tokens.
Part 2 is the README's memory row: a LeanGPT with pixelfly weights vs the dense one; training memory = parameters
+ gradients + Adam's two moments (fp32) + activations saved for backward (counted with saved_tensors_hooks).

Usage: python benchmarks/blocksparse.py [--tokens 256] [--gpu-tokens 8192] [--reps 3] [--seq 256] [--threads N]
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import torch
from torch import nn

from lean_transformer import LeanGPTConfig, LeanGPTForCausalLM
from lean_transformer.modules.blocksparse import BlockSparseLinear
from lean_transformer.modules.linear import DenseLinear
from lean_transformer.modules.memory import SavedTensorCounter

LAYOUT = "pixelfly(block_size=128, n_factors=3)"
HIDDEN, INNER = 4096, 16384


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def step_time(layer: nn.Module, x: torch.Tensor, grad_y: torch.Tensor, autocast: bool) -> Callable[[], float]:
    """A closure timing one forward + backward of ``layer`` (seconds)."""

    def run() -> float:
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
        y.backward(grad_y)
        if x.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return run


def compare_matrices(device: torch.device, tokens: int, reps: int) -> list[tuple[str, ...]]:
    autocast = device.type == "cuda"
    rows = []
    for in_features, out_features in ((HIDDEN, INNER), (INNER, HIDDEN)):
        dense = DenseLinear(in_features, out_features).to(device)
        sparse = BlockSparseLinear(in_features, out_features, LAYOUT).to(device)
        x = torch.randn(tokens, in_features, device=device, requires_grad=True)
        grad_y = torch.randn(tokens, out_features, device=device, dtype=torch.bfloat16 if autocast else None)
        runs = {"dense": step_time(dense, x, grad_y, autocast), "sparse": step_time(sparse, x, grad_y, autocast)}
        for run in runs.values():
            run()  # warm-up
        times: dict[str, list[float]] = {name: [] for name in runs}
        for rep in range(reps):
            for name, run in runs.items():  # alternate, so that both see the same machine load
                times[name].append(run())
            log(f"  {device.type} {in_features}->{out_features}: rep {rep + 1}/{reps} "
                f"dense {times['dense'][-1]:.3f}s sparse {times['sparse'][-1]:.3f}s")
        dense_t, sparse_t = (min(times[name]) for name in ("dense", "sparse"))
        kind = "cuda, bf16 autocast" if autocast else f"cpu, fp32, {torch.get_num_threads()} threads"
        rows.append((f"{kind}, {tokens} tokens",
                     f"{in_features}->{out_features}", f"{sparse.density:.4g}",
                     f"{param_bytes(dense) / 2**20:.1f} / {param_bytes(sparse) / 2**20:.1f} MiB",
                     f"{param_bytes(sparse) / param_bytes(dense):.3f}",
                     f"{dense_t * 1e3:.1f} / {sparse_t * 1e3:.1f} ms", f"{sparse_t / dense_t:.3f}"))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens per forward+backward on CPU")
    parser.add_argument("--gpu-tokens", type=int, default=8192, help="tokens per forward+backward on a GPU")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256, help="sequence length of the LeanGPT memory row")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (torch's default if omitted); 1 is steadier on a busy machine")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    rows = compare_matrices(torch.device("cpu"), args.tokens, args.reps)
    if torch.cuda.is_available():
        rows += compare_matrices(torch.device("cuda"), args.gpu_tokens, args.reps)
    model_rows = compare_models(args.seq)

    print(f"\nOne FFN matrix, {LAYOUT} vs dense (forward + backward, best of {args.reps}; target on GPU: "
          f"time <= 0.35x dense)\n")
    print(table(("device, tokens", "matrix", "density", "params dense / sparse", "ratio",
                 "fwd+bwd dense / sparse", "time ratio"), rows))
    print("\nTraining memory, fp32: weights + grads + Adam moments (2x) + activations saved for backward "
          "(one sequence)\n")
    print(table(("model", "params", "ratio", "weights MiB", "grads MiB", "activations MiB", "total MiB",
                 "total ratio"), model_rows))


if __name__ == "__main__":
    main()
