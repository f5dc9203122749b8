"""What evaluation and export cost the aux peer per checkpoint, side by side in one process: writing the checkpoint
(the model with ``save_pretrained`` + the tokenizer: the baseline, work it did before) against evaluating it on the
held-out batches (``--eval_batches`` forward passes, ``lean_transformer.swarm.monitoring.evaluation.evaluate``), and the bytes a
default Hub upload sends (model, config, tokenizer) against an upload with ``--upload_training_state`` (+ the 8-bit
LAMB state after one step, the LR schedule and the epoch, as ``save_training_state`` writes them). CPU, fp32.
Times are wall time, best of ``--repeats`` interleaved rounds.

Usage: python benchmarks/evaluation.py [--eval_batches 4 --batch 8 --length 128 --threads 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's package and tasks

from arguments import AuxTrainingArguments, TaskArguments  # noqa: E402
from lean_transformer import LeanGPTConfig, LeanGPTForCausalLM  # noqa: E402
from lean_transformer.optim import CPULAMB8Bit  # noqa: E402
from lean_transformer.swarm.monitoring.evaluation import evaluate  # noqa: E402
from lean_transformer.swarm.storage.training_state import TRAINING_STATE_FILE  # noqa: E402
from tasks.causal_lm import CausalLMTask  # noqa: E402

SHAPES = {"tiny (the demo's, tasks/configs/tiny_gpt.json)": None,
          "d=512, 8 layers": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, intermediate_size=2048)}


def best_times(runs: list[Callable[[], object]], repeats: int) -> list[float]:
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def directory_bytes(path: Path, skip: str = "") -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file() and file.name != skip)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval_batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)

    start = time.perf_counter()
    task = CausalLMTask(TaskArguments(), AuxTrainingArguments(per_device_batch_size=args.batch,
                                                              max_sequence_length=args.length))
    batches = task.validation_batches(args.eval_batches)
    prepare = time.perf_counter() - start
    tokens = sum(batch["input_ids"].numel() for batch in batches)
    print(f"held-out batches: {args.eval_batches} x {args.batch} x {args.length} = {tokens} tokens of the embedded "
          f"corpus (1% hash split), prepared once at start-up in {prepare:.2f} s; {args.threads} threads\n")
    print("| model | parameters | write checkpoint (baseline) | evaluate | vs write | default upload | "
          "+ training state | vs default |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, shape in SHAPES.items():
        config = task.config if shape is None else LeanGPTConfig(**{**task.config.to_dict(), **shape})
        torch.manual_seed(0)
        model = LeanGPTForCausalLM(config)
        optimizer = CPULAMB8Bit(model.parameters(), lr=1e-3)
        model(**batches[0]).loss.backward()
        optimizer.step()  # the LAMB statistics exist from the first step on
        with tempfile.TemporaryDirectory() as directory:
            def write() -> None:
                model.save_pretrained(directory, safe_serialization=True)
                task.save_tokenizer(directory)

            write_time, eval_time = best_times([write, lambda: evaluate(model, batches)], args.repeats)
            torch.save(dict(epoch=0, optimizer=optimizer.state_dict(), scheduler=None),
                       os.path.join(directory, TRAINING_STATE_FILE))
            full = directory_bytes(Path(directory))
            default = directory_bytes(Path(directory), skip=TRAINING_STATE_FILE)
        params = sum(param.numel() for param in model.parameters())
        print(f"| {name} | {params / 1e6:.2f}M | {write_time:.3f} s | {eval_time:.3f} s | {eval_time / write_time:.2f}x "
              f"| {default / 2**20:.2f} MiB | {full / 2**20:.2f} MiB | {full / default:.2f}x |")


if __name__ == "__main__":
    main()
