"""Peers that lie (issue 24): the honest trainers' loss under BTARD's attacks, with hivemind's mean and with
CenteredClip (``--aggregation centered_clip``), on loopback, CPU only.

Each cell is one swarm of 3 honest trainers (tiny LeanGPT, one torch thread each) and, under attack, one lying peer
(tests/lying_peer.py): ``sign_flip`` sends its gradients x -1000, ``random_direction`` a fixed random direction at
1000x their norm; the liar starts with the others, so a round while the swarm forms may pair it with one honest
trainer, where it is half of the senders (tests/test_robust_swarm.py lets it join later). The table gives the honest
trainers' mean loss over their last epoch and its ratio to the baseline (no attacker, mean); it is written to
benchmarks/results/attacks.json with the machine's description. One run per cell: no spread measured.

Usage: python benchmarks/attacks.py [--epochs 8] [--attacks none sign_flip random_direction]
About 1.5 minutes a cell on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from test_robust_swarm import EPOCHS, run_swarm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--attacks", nargs="+", default=["none", "sign_flip", "random_direction"])
    parser.add_argument("--aggregations", nargs="+", default=["mean", "centered_clip"])
    args = parser.parse_args()
    cells = []
    with tempfile.TemporaryDirectory() as root:
        for attack in args.attacks:
            for aggregation in args.aggregations:
                started = time.monotonic()
                losses = run_swarm(Path(root) / f"{aggregation}-{attack}", aggregation,
                                   None if attack == "none" else attack, epochs=args.epochs)
                last = [by_epoch.get(args.epochs, float("nan")) for by_epoch in losses.values()]
                cells.append(dict(attack=attack, aggregation=aggregation, final_loss=statistics.mean(last),
                                  per_trainer=last, seconds=round(time.monotonic() - started, 1)))
                print(cells[-1], flush=True)
    base = next((cell["final_loss"] for cell in cells if cell["attack"] == "none" and cell["aggregation"] == "mean"),
                float("nan"))
    print("\n| attack | aggregation | honest final loss | ratio to no attacker, mean |\n|---|---|---|---|")
    for cell in cells:
        cell["ratio"] = cell["final_loss"] / base
        print(f"| {cell['attack']} | {cell['aggregation']} | {cell['final_loss']:.3f} | {cell['ratio']:.2f} |")
    out = REPO / "benchmarks" / "results" / "attacks.json"
    out.write_text(json.dumps(dict(machine=f"{platform.machine()}, {os.cpu_count()} CPUs", epochs=args.epochs,
                                   cells=cells), indent=2) + "\n")
    print(f"written to {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
