"""How often the reducers' answer check (lean_transformer/swarm/averaging/answer_check.py) rejects an honest average,
and how often it catches each lie, on the real gradients of the tiny LeanGPT (the swarm tests' model and data).

In one process: ``--peers`` peers start from one model; each epoch every peer accumulates its gradient over its own
batches (``--samples`` samples, as a swarm of that many trainers with the tests' target batch would), every reducer's
share (contiguous tensors, 1/peers of the values; each tensor is one part, below hivemind's part size) of every
peer is checked as the receivers check it (``share_problem``),
and the model steps with the mean (Adam). DiLoCo: each round every peer takes ``--local_steps`` Adam steps from the
anchor on its own batches, and the pseudo-gradients (anchor - parameters) are checked against their mean; the anchor
steps with SGD-Nesterov (lr 0.7, momentum 0.9). The honest answer is CenteredClip's (the swarm's default, under which
the check runs), of equal weights. The lies are those of tests/lying_peer.py applied to the same means.

The second table is a pair of honest peers whose parameters are some epochs apart (a peer back from a download, or
one that stepped alone): the model trains with the demo's optimizer (the 8-bit LAMB, lr 0.014, 5 warm-up steps) on
the mean of 2 peers' gradients of 64 samples; each epoch the up-to-date peer's gradient is checked against its
average with the other's, taken at the parameters of ``lag`` epochs earlier (and, at lag 0, with 8 samples against
120, both ways). Hence strikes need a group in step (lean_transformer.swarm.averaging.robust.Aggregated).

Usage: python benchmarks/answer_check.py [--peers 4] [--epochs 30] [--apart_epochs 150]
[--out benchmarks/results/answer_check.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402

from arguments import TaskArguments, TrainingSettings  # noqa: E402
from lean_transformer.swarm.averaging.answer_check import MIN_CHECKED, share_problem  # noqa: E402
from lean_transformer.swarm.averaging.robust import centered_clip  # noqa: E402
from lying_peer import REDUCER_ATTACKS, lying_average  # noqa: E402
from tasks import get_task  # noqa: E402

BATCH, LENGTH = 8, 64


def gradient_of(model, batcher, samples: int) -> list:
    model.zero_grad()
    for _ in range(samples // BATCH):
        (model(**batcher.next_batch(BATCH, LENGTH)).loss * BATCH / samples).backward()
    return [param.grad.detach().clone() for param in model.parameters()]


def shares_of(sizes: list, peers: int) -> list:
    """The tensors of each reducer's share: contiguous, about equal in values (as hivemind splits them)."""
    total, bounds, start, filled = sum(sizes), [], 0, 0
    for peer in range(peers):
        end = start
        while end < len(sizes) and (filled + sizes[end] <= total * (peer + 1) / peers or end == start):
            filled += sizes[end]
            end += 1
        bounds.append(list(range(start, end if peer < peers - 1 else len(sizes))))
        start = end
    return [share for share in bounds if share]


def check_round(contributions: list, tally: Counter, last: dict) -> None:
    """Check every reducer's share of every peer against the honest average, and against each lie about it, with
    ``last`` (each tensor's RMS in the previous round's average) as the receivers' reference; then update it."""
    peers = len(contributions)
    averages = [centered_clip([contribution[index] for contribution in contributions], [1.0] * peers)
                for index in range(len(contributions[0]))]
    references = [last.get(index, 0.0) * average.numel() ** 0.5 for index, average in enumerate(averages)]
    last.update({index: float(average.square().mean().sqrt()) for index, average in enumerate(averages)})
    for share in shares_of([average.numel() for average in averages], peers):
        for contribution in contributions:
            owns = [contribution[index] for index in share]
            if sum(own.numel() for own in owns) < MIN_CHECKED:
                tally["unchecked"] += 1
                continue
            tally["checked"] += 1
            x = torch.cat([own.reshape(-1) for own in owns])
            v = torch.cat([averages[index].reshape(-1) for index in share])
            ratio = float((v - x).norm() / x.norm())
            tally["max_ratio"] = max(tally.get("max_ratio", 0.0), ratio)
            tally["min_cosine"] = min(tally.get("min_cosine", 1.0), float(x @ v / (x.norm() * v.norm())))
            share_references = [references[index] for index in share]
            tally["rejected"] += share_problem(owns, [averages[index] - own for index, own in zip(share, owns)],
                                               share_references) is not None
            for attack in REDUCER_ATTACKS:
                lies = [lying_average(attack, 1000.0, averages[index], averages[share[position - 1]]
                                      if position else averages[index]) for position, index in enumerate(share)]
                tally[attack] += share_problem(owns, [lie - own for lie, own in zip(lies, owns)],
                                               share_references) is not None


def run(mode: str, peers: int, epochs: int, samples: int, local_steps: int) -> Counter:
    torch.manual_seed(0)
    task = get_task("causal_lm")(TaskArguments(task="causal_lm"), TrainingSettings())
    model = task.build_model()
    batchers = [task.batches(seed=peer + 1) for peer in range(peers)]
    tally: Counter = Counter()
    last: dict = {}
    start = time.perf_counter()
    if mode == "gradients":
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        for _ in range(epochs):
            contributions = [gradient_of(model, batcher, samples) for batcher in batchers]
            check_round(contributions, tally, last)
            for param, *grads in zip(model.parameters(), *contributions):
                param.grad = centered_clip(grads, [1.0] * peers)
            optimizer.step()
    else:
        anchor = [param.detach().clone() for param in model.parameters()]
        outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
        inner = [None] * peers
        for _ in range(epochs):
            contributions = []
            for peer, batcher in enumerate(batchers):
                with torch.no_grad():
                    for param, value in zip(model.parameters(), anchor):
                        param.copy_(value)
                inner[peer] = inner[peer] or torch.optim.Adam(model.parameters(), lr=0.01)
                for _ in range(local_steps):
                    gradient_of(model, batcher, samples)
                    inner[peer].step()
                contributions.append([a - p.detach() for a, p in zip(anchor, model.parameters())])
            check_round(contributions, tally, last)
            for value, *deltas in zip(anchor, *contributions):
                value.grad = centered_clip(deltas, [1.0] * peers)
            outer.step()
        with torch.no_grad():
            for param, value in zip(model.parameters(), anchor):
                param.copy_(value)
    tally["seconds"] = time.perf_counter() - start
    return tally


def check_pair(own: list, other: list, own_weight: float, other_weight: float) -> tuple[int, int, float]:
    """Shares checked and rejected, and the least cosine(own, average), for ``own``'s gradient in its weighted mean
    with ``other``'s (2 reducers' shares)."""
    average = [(own_weight * x + other_weight * y) / (own_weight + other_weight) for x, y in zip(own, other)]
    checked = rejected = 0
    least = 1.0
    for share in shares_of([tensor.numel() for tensor in average], 2):
        owns = [own[index] for index in share]
        x, v = (torch.cat([tensors[index].reshape(-1) for index in share]) for tensors in (own, average))
        least = min(least, float(x @ v / (x.norm() * v.norm())))
        checked += 1
        rejected += share_problem(owns, [average[index] - x for index, x in zip(share, owns)]) is not None
    return checked, rejected, least


def run_apart(epochs: int, lags: tuple = (1, 2, 4)) -> dict:
    """The pair of the second table (see the module docstring): per case, [checked, rejected, least cosine]."""
    torch.manual_seed(0)
    task = get_task("causal_lm")(TaskArguments(task="causal_lm"),
                                 TrainingSettings(learning_rate=0.014, warmup_steps=5))
    model = task.build_model()
    optimizer = task.optimizer_factory()(task.param_groups(model))
    scheduler = task.scheduler_factory()(optimizer)
    batchers = [task.batches(seed=1), task.batches(seed=2)]
    history: list = []  # the parameters of the last epochs, newest last
    cases: dict = {}

    def tally(case: str, result: tuple) -> None:
        checked, rejected, least = cases.get(case, (0, 0, 1.0))
        cases[case] = (checked + result[0], rejected + result[1], min(least, result[2]))

    def load(values: list) -> None:
        with torch.no_grad():
            for param, value in zip(model.parameters(), values):
                param.copy_(value)

    for _ in range(epochs):
        history = (history + [[param.detach().clone() for param in model.parameters()]])[-max(lags) - 1:]
        own, fresh = gradient_of(model, batchers[0], 64), gradient_of(model, batchers[1], 64)
        tally("0 epochs apart", check_pair(own, fresh, 64, 64))
        few = gradient_of(model, batchers[0], 8)
        tally("in step, 8 samples against 120", check_pair(few, fresh, 8, 120))
        tally("in step, 120 samples against 8", check_pair(fresh, few, 120, 8))
        for lag in lags:
            if lag < len(history):
                load(history[-1 - lag])
                tally(f"{lag} epochs apart", check_pair(own, gradient_of(model, batchers[1], 64), 64, 64))
                load(history[-1])
        for param, x, y in zip(model.parameters(), own, fresh):
            param.grad = (x + y) / 2
        optimizer.step()
        scheduler.step()
    return {case: list(values) for case, values in cases.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--local_steps", type=int, default=2)
    parser.add_argument("--apart_epochs", type=int, default=150)
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/answer_check.json"))
    options = parser.parse_args()
    torch.set_num_threads(1)
    rows, raw = [], {}
    for peers in options.peers:
        samples = max(BATCH, 96 // peers // BATCH * BATCH)  # the tests' target batch of 96, shared
        for mode in ("gradients", "diloco"):
            tally = run(mode, peers, options.epochs, samples, options.local_steps)
            raw[f"{mode}_{peers}"] = dict(tally)
            checked = tally["checked"]
            rows.append([mode, peers, checked, tally["unchecked"], f"{tally['rejected'] / checked:.4f}",
                         f"{tally['max_ratio']:.2f}", f"{tally['min_cosine']:.3f}",
                         *(f"{tally[attack] / checked:.3f}" for attack in REDUCER_ATTACKS)])
            print(rows[-1], flush=True)
    start = time.perf_counter()
    raw["apart"] = run_apart(options.apart_epochs)
    raw["apart_seconds"] = time.perf_counter() - start
    apart_rows = [[case, checked, rejected, f"{least:.3f}"]
                  for case, (checked, rejected, least) in raw["apart"].items()]
    print(apart_rows, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    result = {
        "benchmark": "answer_check",
        "command": "python benchmarks/answer_check.py " + " ".join(sys.argv[1:]),
        "machine": "2 CPU cores (x86_64), 24 GB RAM, no GPU",
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "baseline": "the honest answer: CenteredClip of the peers' parts, equal weights (an honest reducer's)",
        "tables": [{
            "title": "Reducer answer check on the tiny LeanGPT's real gradients and DiLoCo pseudo-gradients",
            "columns": ["mode", "peers", "shares checked", "shares unchecked (< 1024 values)",
                        "honest answers rejected", "max |average - own| / |own|", "min cosine(own, average)",
                        *(f"{attack} caught" for attack in REDUCER_ATTACKS)],
            "rows": rows,
            "notes": (f"{options.epochs} epochs (DiLoCo: outer rounds of {options.local_steps} local Adam steps); "
                      "each peer's share checked against the honest average (rejected: a false rejection) and against "
                      "each lie of tests/lying_peer.py about it (scale 1000; caught: the fraction of checked shares "
                      "the check rejects). reducer_swap answers the previous tensor's average, tiled or cut (the "
                      "first part of a share: its own)."),
        }, {
            "title": "Two honest peers whose parameters are some epochs apart (the demo's optimizer)",
            "columns": ["case", "shares checked", "honest answers rejected", "min cosine(own, average)"],
            "rows": apart_rows,
            "notes": (f"{options.apart_epochs} epochs of the tiny LeanGPT under the 8-bit LAMB (lr 0.014), 2 peers "
                      "of 64 samples; the up-to-date peer's gradient against its mean with the other's, taken at the "
                      "parameters of that many epochs earlier. Hence only a group in step strikes."),
        }],
        "raw": raw,
    }
    Path(options.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
