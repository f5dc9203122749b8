"""The feed-forward sub-layer's hand-written backward (``ffn_custom_grad=True``, the default) against plain autograd's
(the baseline), forward + backward of one LeanFFN, side by side in one run.

On an H100 the whole 1.3B model ran at 0.87x HF GPT-2's tokens/s with the hand-written backward and 1.07x with
autograd's (``benchmarks/throughput.py``): this script takes one layer apart to say where that time goes. For each
variant (and with dropout 0.1 and 0) it reports the device time of forward + backward (CUDA events, median), the
host time to issue it (a launch-bound layer shows host time >= device time), the peak memory above the layer's
inputs, and on CUDA the kernels that take the most time (``torch.profiler``), to ``benchmarks/results/ffn_backward.json``.

Usage: python benchmarks/ffn_backward.py [--hidden 2048 --tokens 2048 --reps 20]   (CPU: a smaller default shape)
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lean_transformer import LeanGPTConfig
from lean_transformer.modules.ffn import LeanFFN

RESULTS = Path(__file__).resolve().parent / "results"


def layer(hidden: int, dropout: float, custom: bool, device: torch.device, dtype: torch.dtype) -> LeanFFN:
    config = LeanGPTConfig(vocab_size=128, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=16,
                           intermediate_size=4 * hidden, hidden_dropout_prob=dropout)
    ffn = LeanFFN(config).to(device=device, dtype=dtype).train()
    ffn.custom_grad = custom
    return ffn


def measure(ffn: LeanFFN, x: torch.Tensor, grad: torch.Tensor, reps: int) -> dict:
    cuda = x.device.type == "cuda"

    def step() -> None:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            out = ffn(x)
        out.backward(grad)
        x.grad = None
        for p in ffn.parameters():
            p.grad = None

    for _ in range(3):
        step()
    device_ms, host_ms = [], []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        step()
        host_ms.append((time.perf_counter() - began) * 1e3)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            device_ms.append(start.elapsed_time(end))
    row = {"host_ms": statistics.median(host_ms),
           "device_ms": statistics.median(device_ms) if cuda else statistics.median(host_ms)}
    if cuda:
        row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        kernels = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:8]
        row["top_kernels"] = [[e.key[:80], e.count, round(e.device_time_total / 1e3, 3)] for e in kernels]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--hidden", type=int, default=2048 if cuda else 256)
    parser.add_argument("--tokens", type=int, default=2048 if cuda else 512)
    parser.add_argument("--reps", type=int, default=20 if cuda else 5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    x = torch.randn(1, args.tokens, args.hidden, device=device, requires_grad=True)
    grad = torch.randn_like(x)
    rows = []
    # float32 weights under bf16 autocast (benchmarks/throughput.py's setting), and bfloat16 weights (the trainer's
    # default on a GPU, where backward casts no weight)
    for weights in (torch.float32, torch.bfloat16):
        inputs = x.detach().to(weights).requires_grad_(), grad.to(weights)
        for dropout in (0.1, 0.0):
            for custom in (False, True):
                name = (f"{'hand-written' if custom else 'autograd (baseline)'}, {str(weights)[6:]} weights, "
                        f"dropout {dropout}")
                print(f"  measuring {name} ...", file=sys.stderr, flush=True)
                result = measure(layer(args.hidden, dropout, custom, device, weights), *inputs, args.reps)
                rows.append({"variant": name, "custom": custom, "dropout": dropout, "weights": str(weights),
                             **result})
    machine = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    columns = ["variant", "device ms", "host ms", "vs autograd"] + (["peak MiB"] if cuda else [])
    table = []
    for row in rows:
        baseline = next(r for r in rows if r["dropout"] == row["dropout"] and r["weights"] == row["weights"]
                        and not r["custom"])
        table.append([row["variant"], round(row["device_ms"], 3), round(row["host_ms"], 3),
                      round(row["device_ms"] / baseline["device_ms"], 3)]
                     + ([round(row["peak_mib"], 1)] if cuda else []))
    print(f"\nLeanFFN forward + backward, d={args.hidden}, {args.tokens} tokens, bf16 autocast, {machine}; "
          f"median of {args.reps}\n")
    print("| " + " | ".join(columns) + " |\n|" + " --- |" * len(columns))
    for line in table:
        print("| " + " | ".join(map(str, line)) + " |")
    for row in rows:
        for kernel in row.get("top_kernels", []):
            print(f"  {row['variant']}: {kernel}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ffn_backward.json").write_text(json.dumps({
        "benchmark": "ffn_backward", "command": "python " + " ".join(sys.argv), "machine": machine,
        "date": time.strftime("%Y-%m-%d"), "commit": commit, "baseline": "autograd's feed-forward backward",
        "tables": [{"title": f"LeanFFN forward + backward, d={args.hidden}, {args.tokens} tokens, bf16 autocast",
                    "columns": columns, "rows": table,
                    "notes": "device ms: CUDA events (on the CPU, wall time); host ms: time to issue the work"}],
        "raw": rows}, indent=1))


if __name__ == "__main__":
    main()
