"""The trainer's step against plain training, side by side on one GPU: tokens/s and peak GPU memory.

- plain (baseline): the same LeanGPT in float32 weights under bfloat16 autocast, the full-logits loss, gradients in
  ``.grad`` on the GPU and ``torch.optim.AdamW(fused=True)`` stepping on the GPU: the usual way to train;
- trainer: the model as the trainer builds it with its lean defaults, which is ``benchmarks/gpu_memory.py``'s last
  row (bfloat16 weights, gradients off the device into float32 host buffers as backward makes them
  (``HostGradients``), gradient checkpointing, the chunked loss with ``return_logits=False``, backward chunks),
  under a 1-peer ``hivemind.Optimizer`` with 8-bit LAMB offloaded to the CPU (``gpu_memory.trainer``).

Both accumulate ``--accumulation`` micro-batches of 4 x 2048 tokens per optimizer step. After one whole warm-up
step (kernels, allocator, LAMB's numba compile), one whole step is timed: its first A-1 micro-batches (forward,
backward and, for the trainer, the host adds: the host's queue is drained before the clock stops) give the
micro-batch tokens/s; the whole step, including the last micro-batch and the optimizer step, gives the step's
tokens/s. Peak GPU memory is ``torch.cuda.max_memory_allocated`` over that timed step. The ratio is trainer / plain
on the same GPU in the same run.

The CPU runs it with ``--sizes tiny`` (a 2-layer model, 2 x 64 tokens), which checks the script end to end.

Usage: python benchmarks/gpu_throughput.py [--sizes 125M 350M 1.3B] [--accumulation 8] [--device_accumulation 1 8]
       [--output PATH]
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import transformers

from gpu_memory import BATCH, OPTIONS, SEQ, SIZES, Option, build, config, loss_function, trainer  # benchmarks/ is sys.path[0]
from lean_transformer import LeanGPTConfig

GiB = 2 ** 30
RESULTS = Path(__file__).resolve().parent / "results"
TRAINER = OPTIONS[-1]  # bf16 weights, grad offload, checkpointing, chunked loss, backward chunks
PLAIN = Option("plain", dtype=torch.float32)  # fp32 weights under bf16 autocast, full logits
TINY = LeanGPTConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=256, max_position_embeddings=64, position_embedding_type="rotary",
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, tie_word_embeddings=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_step(micro_batch: Callable[[], None], drain: Callable[[], None], accumulation: int, device: str
               ) -> dict[str, Optional[float]]:
    """Seconds of the first A-1 micro-batches and of the whole step (the A-th micro-batch does the optimizer step),
    and the peak GPU bytes over it; after one whole warm-up step."""
    for _ in range(accumulation):
        micro_batch()
    drain()
    sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(accumulation - 1):
        micro_batch()
    drain()
    sync(device)
    micro = time.perf_counter() - start
    micro_batch()
    drain()
    sync(device)
    whole = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return {"micro_s": micro, "step_s": whole, "peak_bytes": peak}


def plain(cfg: LeanGPTConfig, device: str, accumulation: int, batch: int, seq: int) -> dict[str, Optional[float]]:
    model = build(cfg, PLAIN, device)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    except RuntimeError:  # a torch without the fused kernels for this device
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    input_ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    compute = loss_function(model, PLAIN, input_ids)
    calls = [0]

    def micro_batch() -> None:
        compute().backward()
        calls[0] += 1
        if calls[0] % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return timed_step(micro_batch, lambda: None, accumulation, device)


def ours(cfg: LeanGPTConfig, device: str, accumulation: int, batch: int, seq: int, device_accumulation: int = 1
         ) -> dict[str, Optional[float]]:
    with trainer(cfg, TRAINER, device, accumulation, batch, seq, device_accumulation) as (_, optimizer, micro_batch,
                                                                                          _):
        return timed_step(micro_batch, optimizer.grad_averager.host_grads.wait, accumulation, device)


def run(name: str, function, *args) -> dict[str, Optional[float]]:
    started = time.perf_counter()
    try:
        result = function(*args)
    except torch.cuda.OutOfMemoryError:
        result = {"micro_s": None, "step_s": None, "peak_bytes": None, "error": "OOM"}
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(f"  ({name}: {time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["125M", "350M", "1.3B"], choices=["tiny", *SIZES])
    parser.add_argument("--accumulation", type=int, default=8, help="micro-batches per optimizer step (>= 2)")
    parser.add_argument("--device_accumulation", type=int, nargs="+", default=[1, 8],
                        help="a trainer row for each: micro-batches whose gradients are summed on the GPU (float32, "
                             "+4 bytes/param) before they go to the host (1: each leaves during its backward)")
    parser.add_argument("--output", type=Path, default=Path(os.environ["OUT"]) / "gpu_throughput.json"
                        if os.environ.get("OUT") else RESULTS / "gpu_throughput.json")
    args = parser.parse_args()
    if args.accumulation < 2:
        parser.error("--accumulation must be at least 2 (the micro-batch rate is timed apart from the step)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and set(args.sizes) != {"tiny"}:
        parser.error("without CUDA only --sizes tiny runs (the others are GPU sizes)")
    transformers.logging.set_verbosity_error()
    rows, raw = [], {}
    for size in args.sizes:
        cfg, batch, seq = (TINY, 2, 64) if size == "tiny" else (config(*SIZES[size]), BATCH, SEQ)
        count = sum(param.numel() for param in build(cfg, PLAIN, "meta").parameters())
        tokens = batch * seq
        results = {"plain": run(f"{size} plain", plain, cfg, device, args.accumulation, batch, seq)}
        for summed in args.device_accumulation:
            name = "trainer" if summed == 1 else f"trainer, device sums of {summed}"
            results[name] = run(f"{size} {name}", ours, cfg, device, args.accumulation, batch, seq, summed)
        raw[size] = {"parameters": count, "tokens_per_micro_batch": tokens, **results}
        base = results["plain"]
        for name, result in results.items():
            if result["step_s"] is None:
                rows.append([size, name, "OOM", "", "", "", ""])
                continue
            micro_rate = (args.accumulation - 1) * tokens / result["micro_s"]
            step_rate = args.accumulation * tokens / result["step_s"]
            optimizer_s = result["step_s"] - result["micro_s"] * args.accumulation / (args.accumulation - 1)
            ratio = f"{step_rate / (args.accumulation * tokens / base['step_s']):.2f}x" if base["step_s"] else "-"
            peak = f"{result['peak_bytes'] / GiB:.2f}" if result["peak_bytes"] is not None else "n/a (CPU)"
            rows.append([f"{size} ({count / 1e9:.2f}B)", name, peak, round(micro_rate), round(step_rate),
                         round(max(optimizer_s, 0.0), 2), ratio])
            print(" | ".join(map(str, rows[-1])), flush=True)
    where = (f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPU cores" if device == "cuda"
             else f"{os.cpu_count()} CPU cores, no GPU")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    result = {
        "benchmark": "gpu_throughput",
        "command": f"python benchmarks/gpu_throughput.py --sizes {' '.join(args.sizes)} "
                   f"--accumulation {args.accumulation} "
                   f"--device_accumulation {' '.join(map(str, args.device_accumulation))}",
        "machine": where, "date": datetime.date.today().isoformat(), "commit": commit,
        "baseline": "plain: float32 weights under bfloat16 autocast, full logits, torch.optim.AdamW(fused=True) on "
                    "the GPU, same model, same GPU, same run",
        "tables": [{
            "title": f"Trainer step vs plain training, {args.accumulation} micro-batches per optimizer step",
            "columns": ["model", "setup", "peak GPU memory (GiB)", "micro-batch tokens/s", "whole-step tokens/s",
                        "optimizer step (s)", "whole step vs plain"],
            "rows": rows,
            "notes": "micro-batch: forward + backward (+ host adds for the trainer), timed over A-1 micro-batches; "
                     "whole step: A micro-batches and the optimizer step (the trainer's 8-bit LAMB runs on the "
                     "CPU inside a 1-peer hivemind.Optimizer). trainer = benchmarks/gpu_memory.py's last row; "
                     "device sums of N: its gradients summed on the GPU in float32 (--device_accumulation N, "
                     "+4 bytes/param) and sent to the host every N-th micro-batch."}],
        "raw": raw,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
