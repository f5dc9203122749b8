"""DiLoCo's fidelity at equal samples: 2 trainers with --local_steps H against the same 2 trainers averaging gradients
at every step (the baseline), on loopback, CPU only.

Both swarms train the tiny LeanGPT on the embedded corpus from the same initialization with the same flags; each
trainer processes the same number of samples (sync: E epochs of --target_batch_size; DiLoCo: E / H outer rounds of
H x --target_batch_size, i.e. about H local steps per trainer per round). Each trainer's final backup (after the last
averaging, so the two trainers hold the same parameters) is scored on held-out batches of the corpus; the ratio of
held-out losses is the fidelity (target: DiLoCo within 5% of sync). Also printed: wall time and the pseudo-gradient
bytes each peer moves per round (measured on the serialized payloads).

Usage: python benchmarks/diloco.py [--local_steps 50] [--epochs 100] [--variants sync diloco diloco-overlap ...]
Prints a markdown table. About 5 minutes on 2 cores with the defaults (sync and diloco).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lean_transformer import LeanGPTForCausalLM  # noqa: E402
from lean_transformer.data.markov import MarkovCorpus  # noqa: E402
from lean_transformer.swarm.averaging.diloco import wire_bytes_per_parameter  # noqa: E402
from lean_transformer.swarm.averaging.optimizer import make_compression  # noqa: E402
from lean_transformer.swarm.peers.processes import PeerProcess  # noqa: E402
from tasks.causal_lm import PackedBatcher  # noqa: E402
from tasks.tokenizer import ByteTokenizer  # noqa: E402

VARIANTS = {  # name -> extra trainer flags (DiLoCo's get --local_steps too)
    "sync": [],
    "diloco": [],
    "diloco-overlap": ["--outer_overlap"],
    "diloco-8bit": ["--outer_compression", "uniform8bit"],
    "diloco-topk": ["--outer_compression", "topk", "--outer_topk_fraction", "0.01"],
}
BATCH, TARGET = 32, 64  # per trainer; the swarm's samples per (inner) step: H local steps per trainer per round


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_swarm(name: str, local_steps: int, epochs: int, workdir: Path) -> tuple[list[Path], float, int]:
    """Two trainers (the second joins through the first); their final backups, wall time, and the first one's outer
    steps with 2 peers."""
    diloco = name != "sync"
    common = ["--run_id", f"bench-{name}", "--host_maddrs", "/ip4/127.0.0.1/tcp/0", "--target_batch_size", str(TARGET),
              "--per_device_batch_size", str(BATCH), "--max_sequence_length", "64", "--learning_rate", "0.01",
              "--warmup_steps", "10", "--total_steps", str(epochs), "--matchmaking_time", "1" if not diloco else "2",
              "--averaging_timeout", "20", "--backup_every_epochs", "0", "--progress_every", "30",
              "--max_epochs", str(epochs // local_steps if diloco else epochs),
              *(["--local_steps", str(local_steps)] if diloco else []), *VARIANTS[name]]
    env = dict(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPO))
    started = time.monotonic()
    first = PeerProcess(f"{name}-1", ["run_trainer.py", *common, "--output_dir", str(workdir / f"{name}-1")], workdir,
                        env, cwd=REPO)
    second = PeerProcess(f"{name}-2", ["run_trainer.py", *common, "--output_dir", str(workdir / f"{name}-2"),
                                       "--initial_peers", *first.initial_peers(timeout=300)], workdir, env, cwd=REPO)
    codes = [second.wait(900), first.wait(900)]
    seconds = time.monotonic() - started
    if codes != [0, 0]:
        raise RuntimeError(f"{name}: trainers exited with {codes}:\n{first.log_tail()}")
    backups = [max((workdir / f"{name}-{i}" / "backups").glob("epoch-*")) for i in (1, 2)]
    return backups, seconds, sum(step["group_size"] == 2 for step in first.events("outer_step"))


def held_out_loss(checkpoint: Path, batches: list) -> float:
    model = LeanGPTForCausalLM.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        return sum(model(**batch).loss.item() for batch in batches) / len(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_steps", type=int, default=50)
    parser.add_argument("--epochs", type=int, default=100, help="sync epochs; DiLoCo runs epochs / local_steps rounds")
    parser.add_argument("--variants", nargs="+", default=["sync", "diloco"], choices=list(VARIANTS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    batcher = PackedBatcher(MarkovCorpus.generate(0).documents(seed=123_456), ByteTokenizer())
    held_out = [batcher.next_batch(16, 64) for _ in range(8)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            progress(f"{name}: 2 trainers, {args.epochs * TARGET} samples")
            backups, seconds, outer = run_swarm(name, args.local_steps, args.epochs, Path(tmp))
            losses = [held_out_loss(backup, held_out) for backup in backups]
            results[name] = (losses, seconds, outer)
            progress(f"{name}: held-out {losses}, {seconds:.0f} s, {outer} outer steps with 2 peers")
        shapes = [param.shape for param in LeanGPTForCausalLM.from_pretrained(backups[0]).parameters()]
    base = results.get("sync", next(iter(results.values())))[0][0]
    print(f"\n2 trainers x {BATCH} samples, tiny LeanGPT, {args.epochs * TARGET} samples each run, "
          f"H = {args.local_steps}\n")
    print("| mode | held-out loss (trainer 1 / 2) | vs sync | wall s | outer steps with 2 peers | bytes/param/round |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (losses, seconds, outer) in results.items():
        flags = VARIANTS[name]
        if name == "sync":
            wire = "-"
        elif "topk" in flags:
            wire = f"{wire_bytes_per_parameter(shapes, None, float(flags[-1])):.3f}"
        else:
            codec = flags[flags.index("--outer_compression") + 1] if "--outer_compression" in flags else "none"
            wire = f"{wire_bytes_per_parameter(shapes, make_compression(codec)):.3f}"
        print(f"| {name} | {losses[0]:.4f} / {losses[1]:.4f} | {losses[0] / base:.3f}x | {seconds:.0f} | "
              f"{outer if name != 'sync' else '-'} | {wire} |")


if __name__ == "__main__":
    main()
