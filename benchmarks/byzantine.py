"""Peers that lie (issue 24): the honest trainers' loss at equal samples under each attack, with hivemind's mean (the
control) and with CenteredClip (``--aggregation centered_clip``, the default), against an honest-only swarm; real
peers on loopback, CPU only.

Each cell is one swarm of 3 honest trainers (tiny LeanGPT, one torch thread each; ``run_swarm`` of
tests/test_robust_swarm.py) and, under attack, one lying peer (tests/lying_peer.py, which describes the attacks:
sign_flip x1000, random_direction at 1000x the honest norm, alie, label_flip, stale, inflate, nan; and the reducer
attacks: reducer_scale, reducer_flip, reducer_noise, reducer_swap, reducer_zeros, which train and send honestly and
lie only in the averages they answer as a reducer), all started together (so a liar may be the first peer up, and
the honest trainers may download its state: see docs/security.md). In gradient mode (``--mode gradients``) the liar
lies with its gradients, in DiLoCo mode (``--mode diloco``: ``--local_steps 2``) with the pseudo-gradients it sends
to the outer all-reduce. Loss "at equal samples": the honest
trainers' mean loss over epochs E-2..E (an epoch is --target_batch_size samples of the swarm, the liar's included).
The honest-only rows also give each aggregation's time per round (an honest trainer's ``round_started`` to
``averaged``, median over its rounds; matchmaking included), and a side-by-side timing of one reducer's work on one
512 KiB part (hivemind's weighted sum against :func:`centered_clip`) for 4 and 16 senders.

Results merge into benchmarks/results/byzantine.json (a cell run again replaces its earlier figure), so the table
can be filled in several commands. ``--run N`` (N > 1) keeps a repeat of a cell beside its first run (key suffix
``#N``); the table then shows the mean of the runs and its notes each run's ratio (the run-to-run spread).
``--honest N --liars M`` (default 3 and 1) sets the swarm (e.g. 13 + 3: 3 attackers of 16, a table of its own, keys
``mode/13+3/attack/aggregation``; every liar runs the same attack).

Usage: python benchmarks/byzantine.py [--mode gradients diloco] [--epochs 8] [--attacks none sign_flip ...]
       [--aggregations mean centered_clip] [--honest 3] [--liars 1] [--target_batch_size 96] [--run 1] [--logs DIR]
About 1 minute a cell on 2 cores with 3 + 1 peers.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from lean_transformer.swarm.averaging.robust import centered_clip  # noqa: E402
from lean_transformer.swarm.monitoring.events import read_events  # noqa: E402
from lean_transformer.swarm.peers.processes import PeerExited  # noqa: E402
from lying_peer import ATTACKS  # noqa: E402
from test_robust_swarm import BATCH, HONEST, TARGET_BATCH, run_swarm  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "byzantine.json"
MODES = {"gradients": [], "diloco": ["--local_steps", "2"]}
KIND = {"gradients": "gradients", "diloco": "outer"}


def round_seconds(root: Path, kind: str, honest: int) -> list:
    """Each honest trainer's rounds of ``kind``: seconds from ``round_started`` to ``averaged``."""
    seconds = []
    for index in range(honest):
        started = None
        for event in read_events(root / f"honest{index}.events.jsonl"):
            if event.get("kind") != kind:
                continue
            if event["event"] == "round_started":
                started = event["time"]
            elif event["event"] == "averaged" and started is not None:
                seconds.append(event["time"] - started)
                started = None
    return seconds


def rejected_averages(root: Path, honest: int) -> int:
    """How many outer averages the honest trainers did not apply (DiLoCo under centered_clip: ``average_rejected``);
    in an honest-only swarm each one is a false rejection."""
    return sum(len(read_events(root / f"honest{index}.events.jsonl", "average_rejected")) for index in range(honest))


def group_sizes(root: Path, kind: str, honest: int) -> list:
    """The group size of each round of ``kind`` each honest trainer averaged in (several groups form when
    matchmaking splits the swarm: a liar then weighs more in its group)."""
    return [event["group_size"] for index in range(honest)
            for event in read_events(root / f"honest{index}.events.jsonl", "averaged") if event["kind"] == kind]


def reducer_timing(senders: int, repeats: int = 20) -> dict:
    """One reducer's work on one 512 KiB part (131072 float32 values) of ``senders`` honest senders: hivemind's
    weighted sum against centered_clip, best of ``repeats``, one thread."""
    generator = torch.Generator().manual_seed(0)
    common = torch.randn(131072, generator=generator)
    parts = [common + 0.5 * torch.randn(131072, generator=generator) for _ in range(senders)]
    weights = [8.0 + index % 3 for index in range(senders)]

    def weighted_sum():
        total = torch.zeros(131072)
        for part, weight in zip(parts, weights):
            total.add_(part, alpha=weight)
        return total / sum(weights)

    best = {}
    for name, function in (("mean", weighted_sum), ("centered_clip", lambda: centered_clip(parts, weights))):
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            function()
            times.append(time.perf_counter() - started)
        best[name] = min(times)
    return dict(senders=senders, mean_ms=1e3 * best["mean"], centered_clip_ms=1e3 * best["centered_clip"],
                ratio=best["centered_clip"] / best["mean"])


def cell_key(mode: str, honest: int, liars: int, attack: str, aggregation: str, run: int) -> str:
    """``mode/attack/aggregation`` for the first run of 3 honest + 1 liar (the keys of the first results), with
    ``/H+L`` after the mode for other swarms and ``#N`` for the N-th run of a cell."""
    swarm = "" if (honest, liars) == (HONEST, 1) else f"/{honest}+{liars}"
    return f"{mode}{swarm}/{attack}/{aggregation}" + (f"#{run}" if run > 1 else "")


def tables(cells: dict, timings: list) -> list:
    """One table of ratios per swarm size with both modes side by side (the README's), then the full table of each
    swarm size and mode, then the reducer's timing."""
    result = []
    by_swarm = {}  # (honest, liars) -> mode -> attack -> [mean's ratio, centered_clip's ratio]
    swarms = sorted({(c.get("honest", HONEST), c.get("liars", 1)) for c in cells.values()})
    for (honest, liars), mode in ((swarm, mode) for swarm in swarms for mode in MODES):
        runs = {}
        for c in cells.values():
            if c["mode"] == mode and (c.get("honest", HONEST), c.get("liars", 1)) == (honest, liars):
                runs.setdefault((c["attack"], c["aggregation"]), []).append(c)
        if ("none", "mean") not in runs:
            continue
        base = statistics.mean(c["loss"] for c in runs[("none", "mean")])
        first = runs[("none", "mean")][0]
        rows, spreads = [], []
        for attack in ("none", *ATTACKS):
            row = [attack]
            for aggregation in ("mean", "centered_clip"):
                found = runs.get((attack, aggregation), [])
                finite = [c["loss"] for c in found if c["loss"] is not None and math.isfinite(c["loss"])]
                if not found:
                    row += [None, None]
                elif not finite:  # the honest trainers stopped
                    row += [f"stopped at epoch {max(found[0]['last_epochs'])}", "-"]
                else:
                    row += [round(statistics.mean(finite), 3), round(statistics.mean(finite) / base, 3)]
                if len(found) > 1:
                    ratios = ", ".join(f"{loss / base:.3f}" if loss is not None else "stopped"
                                       for loss in (c["loss"] for c in found))
                    spreads.append(f"{attack}/{aggregation} {ratios}")
            if any(value is not None for value in row[1:]):
                rows.append(row)
                by_swarm.setdefault((honest, liars), {}).setdefault(mode, {})[attack] = [
                    "stopped" if row[2] == "-" else row[2], "stopped" if row[4] == "-" else row[4]]
        honest_only = [runs.get(("none", aggregation), [None])[0] for aggregation in ("mean", "centered_clip")]
        notes = (f"{honest} honest trainers + {liars} liar{'s' if liars > 1 else ''} ({liars} of {honest + liars}), "
                 f"tiny LeanGPT, --target_batch_size {first.get('target_batch', TARGET_BATCH)}, {first['epochs']} "
                 f"epochs{', --local_steps 2' if mode == 'diloco' else ''}; loss: the honest trainers' mean over the "
                 f"last 3 epochs; ratio: to the honest-only swarm with the mean (row none).")
        if honest + liars != HONEST + 1:
            batch = first.get("target_batch", TARGET_BATCH)
            notes += (f" An epoch of {batch} samples is about {batch / (BATCH * (honest + liars)):.1f} local steps of "
                      f"{BATCH} samples a peer (the 3 + 1 swarm's 96: 3).")
        groups = [c["group_size_median"] for found in runs.values() for c in found if c.get("group_size_median")]
        if groups:
            notes += f" Median group size of the honest trainers' rounds: {min(groups)} to {max(groups)} by cell."
        if spreads:
            notes += (" Cells run several times show the mean of their runs; each run's ratio (run-to-run spread): "
                      + "; ".join(spreads) + ".")
        if any(c["loss"] is None for found in runs.values() for c in found):
            notes += (" 'stopped': the honest trainers exited (20 local steps in a row with a non-finite loss or "
                      "gradients, no backup to roll back to) before the last epoch.")
        if all(honest_only) and all(c.get("round_s") for c in honest_only):
            notes += (f" Honest-only median seconds per round (matchmaking included): mean "
                      f"{honest_only[0]['round_s']:.2f}, centered_clip {honest_only[1]['round_s']:.2f}.")
        attackers = f"{liars} attacker{'s' if liars > 1 else ''} of {honest + liars}"
        result.append(dict(title=f"{mode}: honest trainers' loss at equal samples, {attackers}",
                           columns=["attack", "mean: loss", "mean: ratio", "centered_clip: loss",
                                    "centered_clip: ratio"], rows=rows, notes=notes))
    combined = []
    for (honest, liars), by_mode in by_swarm.items():
        attacks = [attack for attack in ("none", *ATTACKS) if any(attack in rows for rows in by_mode.values())]
        combined.append(dict(
            title=f"honest trainers' loss at equal samples, {liars} attacker{'s' if liars > 1 else ''} of "
                  f"{honest + liars}: ratio to the honest-only swarm with the mean",
            columns=["attack", *(f"{mode}: {aggregation}" for mode in MODES for aggregation in
                                  ("mean", "centered_clip"))],
            rows=[[attack, *(by_mode.get(mode, {}).get(attack, [None, None])[index] for mode in MODES
                             for index in (0, 1))] for attack in attacks],
            notes="each mode's own table below has the losses and the swarm's settings; 'stopped': the honest "
                  "trainers exited before the last epoch"))
    result = combined + result
    result.append(dict(title="one reducer's work on one 512 KiB part (float32), honest senders",
                       columns=["senders", "weighted mean (ms)", "centered_clip (ms)", "ratio"],
                       rows=[[t["senders"], round(t["mean_ms"], 2), round(t["centered_clip_ms"], 2),
                              round(t["ratio"], 1)] for t in timings],
                       notes="best of 20, one thread, side by side in one process"))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", nargs="+", choices=list(MODES), default=["gradients"])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--attacks", nargs="+", choices=("none", *ATTACKS), default=["none", *ATTACKS])
    parser.add_argument("--aggregations", nargs="+", choices=("mean", "centered_clip"),
                        default=["mean", "centered_clip"])
    parser.add_argument("--honest", type=int, default=HONEST, help="honest trainers")
    parser.add_argument("--liars", type=int, default=1, help="lying peers (none for the attack 'none')")
    parser.add_argument("--target_batch_size", type=int, default=TARGET_BATCH, help="samples of the swarm an epoch")
    parser.add_argument("--run", type=int, default=1, help="which run of each cell this is (N > 1: a repeat, kept "
                        "beside the first run under the key's suffix #N)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds each honest trainer may take to finish")
    parser.add_argument("--logs", type=Path, help="keep each cell's peer logs and events under this folder "
                        "(default: a temporary one, removed)")
    args = parser.parse_args()
    if args.honest < 1 or args.liars < 1 or args.run < 1 or args.target_batch_size < 1:
        parser.error("--honest, --liars, --run and --target_batch_size must be at least 1")
    previous = json.loads(OUT.read_text()) if OUT.exists() else {}
    cells = {cell["key"]: cell for cell in previous.get("raw", {}).get("cells", [])}
    torch.set_num_threads(1)
    timings = [reducer_timing(senders) for senders in (4, 16)]
    print(timings, flush=True)
    with contextlib.nullcontext(args.logs) if args.logs else tempfile.TemporaryDirectory() as root:
        total, done = len(args.mode) * len(args.attacks) * len(args.aggregations), 0
        for mode in args.mode:
            for attack in args.attacks:
                for aggregation in args.aggregations:
                    started = time.monotonic()
                    key = cell_key(mode, args.honest, args.liars, attack, aggregation, args.run)
                    where = Path(root) / key.replace("/", "-").replace("#", "-run")
                    done += 1
                    who = "no attacker" if attack == "none" else f"{args.liars} attacker(s)"
                    print(f"[{done}/{total}] {key}: {args.honest} honest trainers + {who}, {args.epochs} epochs ...",
                          file=sys.stderr, flush=True)
                    swarm = dict(key=key, mode=mode, attack=attack, aggregation=aggregation, epochs=args.epochs,
                                 honest=args.honest, liars=args.liars, target_batch=args.target_batch_size,
                                 run=args.run, commit=head_commit())
                    try:
                        losses = run_swarm(where, aggregation, None if attack == "none" else attack,
                                           epochs=args.epochs, timeout=args.timeout, extra=MODES[mode],
                                           honest_count=args.honest, liars=args.liars,
                                           target_batch=args.target_batch_size)
                    except (PeerExited, TimeoutError) as error:  # e.g. the honest trainers' models went non-finite
                        cells[key] = dict(**swarm, loss=None, failed=str(error).splitlines()[0],
                                          last_epochs=stopped_at(where, args.honest),
                                          seconds=round(time.monotonic() - started, 1))
                    else:
                        last = [last_epochs_loss(by_epoch, args.epochs) for by_epoch in losses.values()]
                        rounds = round_seconds(where, KIND[mode], args.honest)
                        sizes = group_sizes(where, KIND[mode], args.honest)
                        swarm.update(group_size_median=statistics.median(sizes) if sizes else None,
                                     group_size_min=min(sizes, default=None),
                                     rejected_averages=rejected_averages(where, args.honest))
                        cells[key] = dict(**swarm, loss=statistics.mean(last), per_trainer=last,
                                          round_s=statistics.median(rounds) if rounds else None, rounds=len(rounds),
                                          seconds=round(time.monotonic() - started, 1))
                    print(cells[key], flush=True)
                    write(cells, timings)
    result = write(cells, timings)
    for table in result["tables"]:
        print(f"\n{table['title']}\n| {' | '.join(table['columns'])} |")
        for row in table["rows"]:
            print(f"| {' | '.join(str(value) for value in row)} |")
    print(f"written to {OUT.relative_to(REPO)}")


def last_epochs_loss(by_epoch: dict, epochs: int) -> float:
    """A trainer's mean loss over epochs E-2..E, of those it reported with a loss: a trainer that took no local step
    in an epoch (the others filled it) reports it without one, and one that fell behind skips epochs (NaN if none)."""
    found = [by_epoch[epoch] for epoch in range(epochs - 2, epochs + 1) if math.isfinite(by_epoch.get(epoch, math.nan))]
    return statistics.mean(found) if found else math.nan


def stopped_at(root: Path, honest: int) -> list:
    """The last epoch each honest trainer reported (a cell whose trainers stopped)."""
    return [max((event["epoch"] for event in read_events(root / f"honest{index}.events.jsonl", "epoch")), default=0)
            for index in range(honest)]


def head_commit() -> str:
    """The checkout's short commit (each cell keeps the one it was measured at: cells are re-run one by one)."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()


def write(cells: dict, timings: list) -> dict:
    """Write the results so far (after every cell: a later cell that fails keeps the earlier ones)."""
    result = dict(benchmark="byzantine",
                  command="python benchmarks/byzantine.py --mode gradients diloco (3 of 16: --honest 13 --liars 3 "
                          "--target_batch_size 256; repeats: --run 2, --run 3)",
                  machine=f"2 CPU cores ({platform.machine()}), 24 GB RAM, no GPU", date=str(datetime.date.today()),
                  commit=head_commit(),
                  baseline="the honest-only swarm (the same honest trainers, no liar) with the mean, same epochs",
                  tables=tables(cells, timings), raw=dict(cells=sorted(cells.values(), key=lambda c: c["key"]),
                                                          reducer_timings=timings))
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
