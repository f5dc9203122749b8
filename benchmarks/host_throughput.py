"""How fast this machine's CPU does a GPU trainer's host work, and the largest GPU speed it keeps busy. No GPU needed.

With gradients offloaded (``optim/grad_offload.py``), every micro-batch's gradients reach the host as bfloat16 copies
in pinned staging memory, and a host thread adds each into its float32 buffer (``accumulate_into``: 2 bytes read,
4 read, 4 written per parameter), on torch's intra-op threads. Every ``A`` micro-batches (the accumulation) the
offloaded 8-bit LAMB (``CPULAMB8Bit``) steps the float32 master weights; the GPU waits for that step.

Measured here: the add's rate (parameters/s, bytes/s of host memory traffic) and the LAMB step's rate
(parameters/s), each over a working set far beyond the CPU caches, in tensors the size of the 1.3B model's
feed-forward matrices, at 1 thread and at all cores. The add runs in a fresh thread, as HostGradients' host thread.

Derived (model FLOPs: 6 * parameters * tokens per micro-batch): per micro-batch the GPU computes for
``t_gpu = 6 N T / F`` seconds at F FLOP/s and the host adds for ``t_add = N / add_rate``; per step the host also
steps LAMB for ``t_lamb = N / lamb_rate``. The host keeps up while ``A t_add + t_lamb <= A t_gpu``, i.e. up to
``F_max = 6 T / (1 / add_rate + 1 / (A lamb_rate))`` (independent of N: both costs are per parameter). The adds alone
overlap the GPU's backward; LAMB does not (the trainer's step is synchronous), so the GPU's busy fraction is
``A t_gpu / (max(A t_gpu, A t_add) + t_lamb)``.

Usage: python benchmarks/host_throughput.py [--elements 67108864] [--tokens 8192] [--accumulation 1 8 32]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import threading
import time
from pathlib import Path

import torch

from gpu_memory import SIZES as SHAPES, config  # benchmarks/ is this script's sys.path[0]
from lean_transformer import LeanGPTForCausalLM
from lean_transformer.optim import CPULAMB8Bit
from lean_transformer.optim.grad_offload import accumulate_into

RESULTS = Path(__file__).resolve().parent / "results"
TILE = 2048 * 8192  # elements: the 1.3B model's feed-forward matrix (d=2048, 4d)
# dense bfloat16 tensor TFLOPS from the vendors' datasheets (without sparsity): what a volunteer may bring
GPUS = {"RTX 3060": 25, "RTX 3090": 71, "RTX 4090": 165, "A100": 312, "H100 SXM": 990}
MFU = 0.4  # assumed achieved fraction of the datasheet figure in training (model FLOPs utilisation)


def parameter_count(size: str) -> int:
    """Parameters of gpu_memory.py's LeanGPT shape (vocab 50304, tied embeddings, rotary), counted on the meta device."""
    with torch.device("meta"):
        return sum(param.numel() for param in LeanGPTForCausalLM(config(*SHAPES[size])).parameters())


def tensors(elements: int, dtype: torch.dtype, pin: bool) -> list[torch.Tensor]:
    sizes = [TILE] * (elements // TILE) + ([elements % TILE] if elements % TILE else [])
    return [torch.empty(size, dtype=dtype, pin_memory=pin).normal_() for size in sizes]


def in_thread(fn, threads: int):
    """Run ``fn`` in a fresh thread with ``threads`` intra-op threads, as HostGradients' host thread runs its adds."""
    result, previous = {}, torch.get_num_threads()

    def target():
        torch.set_num_threads(threads)
        result["value"] = fn()
    worker = threading.Thread(target=target)
    worker.start()
    worker.join()
    torch.set_num_threads(previous)
    return result["value"]


def add_rate(elements: int, threads: int, repeats: int, pin: bool) -> float:
    """Parameters/s of ``accumulate_into`` (bfloat16 staged copy into float32 buffer, not the first of a step)."""
    buffers = tensors(elements, torch.float32, pin=False)
    grads = tensors(elements, torch.bfloat16, pin=pin)

    def run() -> float:
        for buffer, grad in zip(buffers, grads):  # warm-up: pages touched
            accumulate_into(buffer, grad, 1.0, overwrite=True)
        start = time.perf_counter()
        for _ in range(repeats):
            for buffer, grad in zip(buffers, grads):
                accumulate_into(buffer, grad, 1.0)
        return repeats * elements / (time.perf_counter() - start)
    return in_thread(run, threads)


def lamb_rate(elements: int, threads: int, repeats: int) -> float:
    """Parameters/s of one CPULAMB8Bit step over float32 parameters with gradients."""
    params = [torch.nn.Parameter(t) for t in tensors(elements, torch.float32, pin=False)]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-3
    optimizer = CPULAMB8Bit(params, lr=1e-4)

    def run() -> float:
        optimizer.step()  # warm-up: state allocation, numba compile
        start = time.perf_counter()
        for _ in range(repeats):
            optimizer.step()
        return repeats * elements / (time.perf_counter() - start)
    return in_thread(run, threads)


def machine() -> str:
    cores = os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cores} CPU cores ({model}, {platform.machine()}), {memory:.0f} GB RAM, {gpu}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=2 ** 26, help="parameters in the working set")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch (gpu_memory.py: 4 x 2048)")
    parser.add_argument("--accumulation", type=int, nargs="+", default=[1, 8, 32],
                        help="micro-batches per optimizer step")
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS / "host_throughput.json")
    args = parser.parse_args()
    if args.elements < 1 or args.tokens < 1 or min(args.accumulation) < 1 or min(args.threads) < 1:
        parser.error("--elements, --tokens, --accumulation and --threads must be positive")
    pin = torch.cuda.is_available()  # pinned staging as on a GPU box; plain memory where pinning needs CUDA
    rates = {}
    for threads in args.threads:
        adds = add_rate(args.elements, threads, args.repeats, pin)
        lamb = lamb_rate(args.elements, threads, max(1, args.repeats - 1))
        rates[threads] = (adds, lamb)
        print(f"{threads} threads: add {adds / 1e9:.2f} G params/s ({10 * adds / 1e9:.1f} GB/s), "
              f"LAMB {lamb / 1e9:.3f} G params/s", flush=True)
    best = max(rates, key=lambda threads: rates[threads][0])
    add, lamb = rates[best]
    tables = [{
        "title": "Host rates (parameters/s; the add moves 10 bytes of host memory per parameter)",
        "columns": ["intra-op threads", "add bf16 -> fp32 (G params/s)", "add (GB/s)", "8-bit LAMB step (G params/s)",
                    "add bound, TFLOPS (6 x tokens x add rate)"],
        "rows": [[threads, round(a / 1e9, 3), round(10 * a / 1e9, 2), round(l / 1e9, 3),
                  round(6 * args.tokens * a / 1e12, 1)] for threads, (a, l) in rates.items()],
        "notes": f"working set {args.elements / 1e6:.0f}M parameters in tensors of up to {TILE / 1e6:.1f}M; "
                 f"gradients in {'pinned' if pin else 'plain (no CUDA to pin with)'} bfloat16 memory; the add runs "
                 "in a fresh thread, as HostGradients' host thread (which gets torch's default: all cores)."}]
    sizes = {size: parameter_count(size) for size in ("125M", "350M", "1.3B")}
    rows = []
    for size, count in sizes.items():
        t_add, t_lamb = count / add, count / lamb
        for accumulation in args.accumulation:
            f_max = 6 * args.tokens / (1 / add + 1 / (accumulation * lamb))
            rows.append([size, accumulation, round(t_add, 3), round(t_lamb, 2), round(f_max / 1e12, 1)])
    tables.append({
        "title": f"Largest model TFLOPS the host keeps up with ({best} threads, {args.tokens} tokens per micro-batch)",
        "columns": ["model", "micro-batches per step (A)", "host add per micro-batch (s)", "LAMB step (s)",
                    "largest GPU speed the host keeps busy (model TFLOPS)"],
        "rows": rows,
        "notes": "6 N T / (A t_add + t_lamb) FLOP/s: above it the host's work per step takes longer than the GPU's. "
                 "The same for every size: both host costs are per parameter."})
    count = sizes["1.3B"]
    t_add, t_lamb = count / add, count / lamb
    gpu_rows = []
    for name, datasheet in GPUS.items():
        achieved = datasheet * MFU * 1e12
        t_gpu = 6 * count * args.tokens / achieved
        busy = [accumulation * t_gpu / (max(accumulation * t_gpu, accumulation * t_add) + t_lamb)
                for accumulation in args.accumulation]
        gpu_rows.append([name, datasheet, round(datasheet * MFU), round(t_gpu, 3),
                         "yes" if t_add <= t_gpu else f"no ({t_add / t_gpu:.1f}x the GPU's time)",
                         *[f"{fraction:.0%}" for fraction in busy]])
    tables.append({
        "title": f"Volunteer GPUs, 1.3B model, {args.tokens} tokens per micro-batch, this host ({best} threads)",
        "columns": ["GPU", "datasheet dense bf16 TFLOPS", f"assumed achieved ({MFU:.0%})",
                    "GPU time per micro-batch (s)", "host adds keep up",
                    *[f"GPU busy, A={accumulation}" for accumulation in args.accumulation]],
        "rows": gpu_rows,
        "notes": f"Datasheet figures (NVIDIA, dense, no sparsity), of which {MFU:.0%} assumed achieved in training. "
                 f"Host add per micro-batch {t_add:.2f} s, LAMB step {t_lamb:.2f} s (1.3B). Busy: "
                 "A t_gpu / (max(A t_gpu, A t_add) + t_lamb): the adds overlap backward, the LAMB step does not."})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    result = {
        "benchmark": "host_throughput",
        "command": "python benchmarks/host_throughput.py " + " ".join(
            f"--{key} {' '.join(map(str, value)) if isinstance(value, list) else value}"
            for key, value in vars(args).items() if key != "output"),
        "machine": machine(), "date": datetime.date.today().isoformat(), "commit": commit,
        "baseline": "the GPU's own time per micro-batch (6 N T model FLOPs at the stated TFLOPS)",
        "tables": tables,
        "raw": {"rates": {str(threads): {"add_params_per_s": a, "lamb_params_per_s": l}
                          for threads, (a, l) in rates.items()},
                "tokens_per_micro_batch": args.tokens, "mfu_assumed": MFU, "parameters": sizes},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    for table in tables:
        print(f"\n{table['title']}\n| " + " | ".join(table["columns"]) + " |")
        for row in table["rows"]:
            print("| " + " | ".join(map(str, row)) + " |")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
