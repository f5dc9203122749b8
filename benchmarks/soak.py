"""Soak test of the local swarm: does it keep averaging, run after run, through a trainer's crash and restart?

Runs the demo's swarm (``python -m lean_transformer.demo``: an aux peer and ``--num_trainers`` trainers on 127.0.0.1,
through the demo's own orchestrator and flags) ``--runs`` times for ``--duration`` s of training each. In half of the
runs (which ones, which trainer and when: drawn from ``--seed``) one trainer's whole process group is SIGKILLed at a
moment between 10% and 70% of the training time and started again at once with the same command line and output
directory (the demo gives trainers no ``--identity_path``, so it rejoins under a new peer ID), as a volunteer whose
machine died would restart it.

Per run, from the exit code of the demo's ``run`` and the peers' events (tracebacks and stalls: their logs):

- exit: the demo's exit code (0: every peer stopped cleanly and a checkpoint was written).
- for each trainer, the fraction of the epochs it was alive for in which it averaged gradients with every other
  live trainer. A trainer was alive for epoch E if it had joined the swarm at an epoch <= E and reached an epoch
  > E (its ``joined`` and ``epoch`` events; epochs skipped by reloading the swarm's state count as alive and not
  averaged). It averaged with every other live trainer if its gradient round of epoch E (``round_started`` ..
  ``averaged`` with ``group_size`` N, of kind ``gradients``, while at epoch E) had N >= the number of
  trainers alive for E; an epoch with only one trainer alive counts as averaged. The aux peer does not average
  gradients in the demo.
- samples lost: what the killed trainer had accumulated in its unfinished epoch and never contributed, ESTIMATED
  from its events: its speed over its epoch reports (samples/s) x the seconds from its last epoch change to the kill
  (or to the start of a gradient round the kill cut short), at most the target batch.
- crashes: peers the benchmark did not kill that exited unexpectedly or with a non-zero code, or did not stop in
  time (the demo's own problem list). Tracebacks in the logs of those peers are counted apart: hivemind logs the
  exceptions it handles (a failed averaging round, a retried state download) with their tracebacks too.
- stalls: lines of a trainer that is falling out of the averaging (``Proceeding with local gradients``,
  ``Another look_for_group is already in progress``, ``Peer is out of sync``), summed over the trainers.

Writes ``soak.md``, ``soak.json`` and ``soak.png`` (averaging fraction per run and trainer) to ``--output_dir``,
after every run, and keeps each run's demo output folder (logs, metrics, console output) as ``run-NN/``. Ctrl+C
stops the current run as the demo does (every peer, their hivemind processes and socket files) and writes what it
has. Targets (issue 10): every run exits 0; every trainer averages in >= 90% of its alive epochs; no crash of a peer
not killed on purpose.

Usage: python benchmarks/soak.py [--runs 10] [--duration 100] [--num_trainers 2] [--seed 0] [--output_dir outputs/soak]
About (duration + 40 s) per run on 2 cores.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's package and peer scripts

from lean_transformer.demo import local_swarm  # noqa: E402
from lean_transformer.demo.local_swarm import LocalSwarm, StopSignals  # noqa: E402
from lean_transformer.swarm.monitoring.events import read_events  # noqa: E402

TARGET_FRACTION = 0.9
KILL_WINDOW = (0.1, 0.7)  # a kill lands between these fractions of the training time, so the restart can rejoin
STALL_LINES = {"local gradients": "Proceeding with local gradients",
               "look_for_group busy": "Another look_for_group is already in progress",
               "out of sync": "Peer is out of sync"}



@dataclass
class Life:
    """One process of one trainer, as its events tell it (and, for tracebacks and stalls, its log)."""

    joined_epoch: Optional[int] = None
    reached: int = -1  # the highest epoch it reached
    rounds: Dict[int, int] = field(default_factory=dict)  # epoch -> group size of its gradient round (0: none)
    epoch_changed_at: Optional[datetime] = None
    open_round: Optional[int] = None  # the epoch of a gradient round that began and did not finish
    open_round_since: Optional[datetime] = None
    samples_per_second: float = 0.0  # over its epoch reports
    tracebacks: List[str] = field(default_factory=list)  # the exception line of each ("... (at shutdown)")
    stalls: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(STALL_LINES, 0))

    @property
    def alive_epochs(self) -> range:
        return range(self.joined_epoch, self.reached) if self.joined_epoch is not None else range(0)


def read_life(events: Sequence[dict], log: str) -> Life:
    """A trainer process's life from its events, with the tracebacks and stall warnings of its log."""
    life, epoch = Life(), None
    reports: List[tuple[float, int]] = []  # (time, samples) of its epoch reports
    for event in events:
        when = datetime.fromtimestamp(event["time"])
        if event["event"] == "joined":
            epoch = life.joined_epoch = event["epoch"]
            life.reached, life.epoch_changed_at = max(life.reached, epoch), when
        elif event["event"] == "epoch":
            epoch = event["epoch"]
            life.reached, life.epoch_changed_at = max(life.reached, epoch), when
            life.open_round = life.open_round_since = None
            reports.append((event["time"], event["samples"]))
        elif event.get("kind") != "gradients" or epoch is None:
            continue
        elif event["event"] == "round_started":
            life.open_round, life.open_round_since = epoch, when
            life.rounds.setdefault(epoch, 0)
        elif event["event"] == "averaged" and life.open_round is not None:
            life.rounds[life.open_round] = event["group_size"]
        elif event["event"] == "round_missed" and life.rounds.get(life.open_round) == 0:
            life.open_round = life.open_round_since = None  # it goes on accumulating
    if len(reports) >= 2:
        seconds = reports[-1][0] - reports[0][0]
        life.samples_per_second = sum(samples for _, samples in reports[1:]) / seconds if seconds > 0 else 0.0
    life.tracebacks, life.stalls = read_log_notes(log)
    return life


def read_log_notes(log: str) -> tuple[List[str], Dict[str, int]]:
    """What a peer's log tells people and no event carries: the exception line of each traceback (hivemind logs
    the exceptions it handles too), and the count of each stall warning."""
    tracebacks, stalls, pending, stopping = [], dict.fromkeys(STALL_LINES, 0), False, False
    for raw in log.splitlines():
        if pending and raw and not raw[0].isspace() and not raw.startswith("Traceback"):
            if not raw.startswith(("During handling", "The above exception")):
                tracebacks.append(raw.strip()[:160] + (" (at shutdown)" if stopping else ""))
                pending = False
        if raw.startswith("Traceback (most recent call last)"):
            pending = True
            continue
        stopping = stopping or "Stopping at epoch" in raw or "Leaving the swarm" in raw
        for name, text in STALL_LINES.items():
            stalls[name] += text in raw
    return tracebacks, stalls


def samples_lost(life: Life, killed_at: datetime, target_batch_size: int) -> int:
    """ESTIMATED samples the killed ``life`` had accumulated in its unfinished epoch and never contributed."""
    if life.joined_epoch is None or life.epoch_changed_at is None:
        return 0  # killed before it joined: it had accumulated nothing
    if life.open_round is not None and life.rounds.get(life.open_round, 0) > 1:
        return 0  # its last round finished averaging: the others got its samples
    until = life.open_round_since or killed_at
    seconds = max(0.0, (until - life.epoch_changed_at).total_seconds())
    return min(target_batch_size, round(life.samples_per_second * seconds))


@dataclass
class RunResult:
    run: int
    killed: Optional[str]  # the trainer killed and restarted, if any
    kill_at_s: Optional[float]  # seconds of training when it was killed
    exit_code: int
    seconds: float
    epochs: int  # the highest epoch a trainer reached
    alive_epochs: Dict[str, int]
    averaged_with_all: Dict[str, int]
    missed: Dict[str, List[int]]  # trainer -> its alive epochs without a round with every live trainer
    samples_lost: int
    crashes: List[str]
    tracebacks: Dict[str, List[str]]  # peer -> the exception lines of the tracebacks in its log (not killed lives)
    stalls: Dict[str, Dict[str, int]]  # trainer -> stall line -> count

    def fraction(self, trainer: str) -> Optional[float]:
        alive = self.alive_epochs.get(trainer, 0)
        return self.averaged_with_all[trainer] / alive if alive else None


def analyse(run: int, swarm: LocalSwarm, exit_code: int, seconds: float, killed: Optional[str],
            kill_at_s: Optional[float], killed_at: Optional[datetime], restart_offset: tuple[int, int]) -> RunResult:
    lives: Dict[str, List[Life]] = {}
    tracebacks: Dict[str, List[str]] = {}
    lost = 0
    for peer in swarm.trainers:
        log = peer.log.path.read_bytes() if peer.log.path.exists() else b""
        events = read_events(peer.process.events_path)
        if peer.name == killed:  # the killed process's part of its log and events, then the restarted one's
            lives[peer.name] = [read_life(events[:restart_offset[1]], log[:restart_offset[0]].decode(errors="replace")),
                                read_life(events[restart_offset[1]:], log[restart_offset[0]:].decode(errors="replace"))]
            lost = samples_lost(lives[peer.name][0], killed_at, local_swarm.SWARM_ARGS["target_batch_size"])
        else:
            lives[peer.name] = [read_life(events, log.decode(errors="replace"))]
        tracebacks[peer.name] = lives[peer.name][-1].tracebacks  # the killed life's are not the survivors' crashes
    aux_log = swarm.aux.log.path
    tracebacks["aux"] = read_log_notes(aux_log.read_text(errors="replace"))[0] if aux_log.exists() else []

    alive_count: Dict[int, int] = {}
    for trainer_lives in lives.values():
        for life in trainer_lives:
            for epoch in life.alive_epochs:
                alive_count[epoch] = alive_count.get(epoch, 0) + 1
    alive, averaged, missed, stalls = {}, {}, {}, {}
    for name, trainer_lives in lives.items():
        epochs = [(life, epoch) for life in trainer_lives for epoch in life.alive_epochs]
        alive[name] = len(epochs)
        missed[name] = [epoch for life, epoch in epochs
                        if alive_count[epoch] > 1 and life.rounds.get(epoch, 0) < alive_count[epoch]]
        averaged[name] = alive[name] - len(missed[name])
        stalls[name] = {key: sum(life.stalls[key] for life in trainer_lives) for key in STALL_LINES}
    reached = max((life.reached for trainer_lives in lives.values() for life in trainer_lives), default=0)
    return RunResult(run, killed, kill_at_s, exit_code, round(seconds, 1), max(reached, 0), alive, averaged, missed,
                     lost, list(swarm.problems), tracebacks, stalls)


# ---------------------------------------------------------------- running


@dataclass
class KillPlan:
    trainer: int  # index into swarm.trainers
    at_seconds: float
    killed_at: Optional[datetime] = None
    restart_offset: tuple[int, int] = (0, 0)  # where the restarted process begins: its log's bytes, its events

    def on_tick(self, swarm: LocalSwarm, elapsed: float) -> None:
        if self.killed_at is None and elapsed >= self.at_seconds:
            self.killed_at = datetime.now()
            peer = swarm.restart(swarm.trainers[self.trainer])
            # the new process has not had time to write anything yet (python takes seconds to import the trainer)
            log_size = peer.log.path.stat().st_size if peer.log.path.exists() else 0
            self.restart_offset = (log_size, len(read_events(peer.process.events_path)))
            print(f"soak: killed {peer.name} (its whole process group) at {elapsed:.1f} s and restarted it",
                  flush=True)


def plan_kills(runs: int, num_trainers: int, duration: float, seed: int) -> Dict[int, KillPlan]:
    """Which runs kill a trainer, which one and when: half of the runs, drawn from ``seed``."""
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(1, runs + 1), runs // 2))
    return {run: KillPlan(rng.randrange(num_trainers), round(rng.uniform(*KILL_WINDOW) * duration, 1))
            for run in chosen}


def run_once(run: int, args: argparse.Namespace, plan: Optional[KillPlan], stop: StopSignals,
             floor: float) -> RunResult:
    folder = args.output_dir / f"run-{run:02d}"
    folder.mkdir(parents=True)
    swarm = LocalSwarm(folder, args.num_trainers, args.duration, args.refresh, wandb=False,
                       on_tick=plan.on_tick if plan is not None else None)
    started = time.monotonic()
    with (folder / "console.log").open("w") as console, contextlib.redirect_stdout(console), \
            contextlib.redirect_stderr(console):
        exit_code = local_swarm.run(swarm, stop, floor)
    killed = swarm.trainers[plan.trainer].name if plan is not None and plan.killed_at is not None else None
    return analyse(run, swarm, exit_code, time.monotonic() - started, killed,
                   plan.at_seconds if killed else None, plan.killed_at if killed else None,
                   plan.restart_offset if killed else (0, 0))


# ---------------------------------------------------------------- reporting


def percent(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def table(results: Sequence[RunResult], trainers: Sequence[str]) -> List[str]:
    lines = [f"| run | kill | exit | epochs | {' | '.join(trainers)} | samples lost (est.) | crashes | tracebacks "
             f"| stalls |", "| ---: | --- | ---: | ---: |" + " ---: |" * len(trainers) + " ---: | --- | --- | --- |"]
    for result in results:
        kill = f"{result.killed} at {result.kill_at_s:.0f} s" if result.killed else "-"
        cells = [f"{percent(result.fraction(name))} ({result.averaged_with_all.get(name, 0)}/"
                 f"{result.alive_epochs.get(name, 0)})" for name in trainers]
        traces = "; ".join(f"{peer}: {len(found)} ({sum(each.endswith('(at shutdown)') for each in found)} at "
                           f"shutdown)" for peer, found in result.tracebacks.items() if found) or "0"
        stalls = "; ".join(f"{key} {sum(each[key] for each in result.stalls.values())}" for key in STALL_LINES)
        lines.append(f"| {result.run} | {kill} | {result.exit_code} | {result.epochs} | {' | '.join(cells)} | "
                     f"{result.samples_lost if result.killed else '-'} | {'; '.join(result.crashes) or '0'} | "
                     f"{traces} | {stalls} |")
    return lines


def verdict(results: Sequence[RunResult], runs: int) -> List[str]:
    exits = sum(result.exit_code == 0 for result in results)
    fractions = [(result.run, name, result.fraction(name)) for result in results for name in result.alive_epochs]
    below = [f"run {run} {name} {percent(value)}" for run, name, value in fractions
             if value is not None and value < TARGET_FRACTION]
    crashes = sum(len(result.crashes) for result in results)
    measured = [value for _, _, value in fractions if value is not None]
    return [f"- runs that exited 0: {exits} of {len(results)} (target: {runs} of {runs})",
            f"- trainers averaging with every live trainer in >= {TARGET_FRACTION:.0%} of their alive epochs: "
            f"{len(measured) - len(below)} of {len(measured)} (lowest {percent(min(measured, default=None))}; "
            f"below target: {', '.join(below) or 'none'})",
            f"- crashes of peers not killed on purpose: {crashes} (target: 0)",
            f"- samples lost to the kills (estimated): {sum(r.samples_lost for r in results if r.killed)} in "
            f"{sum(1 for r in results if r.killed)} kills"]


def plot(results: Sequence[RunResult], trainers: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(max(6.0, 0.8 * len(results) + 2), 4))
    width = 0.8 / len(trainers)
    for index, name in enumerate(trainers):
        xs = [result.run + (index - (len(trainers) - 1) / 2) * width for result in results]
        values = [100 * (result.fraction(name) or 0.0) for result in results]
        bars = axes.bar(xs, values, width, label=name)
        for bar, result in zip(bars, results):
            if result.killed == name:
                bar.set_hatch("//")
    axes.axhline(100 * TARGET_FRACTION, color="red", linestyle="--", linewidth=1, label="target")
    axes.set_xticks([result.run for result in results],
                    [f"{result.run}{'*' if result.killed else ''}" for result in results])
    axes.set_xlabel("run (* a trainer was killed and restarted; hatched: that trainer)")
    axes.set_ylabel("% of alive epochs averaged with all")
    axes.set_ylim(0, 105)
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    axes.set_title("soak: gradient averaging with every live trainer, per run")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_report(results: Sequence[RunResult], args: argparse.Namespace, note: str) -> List[str]:
    trainers = [f"trainer{index}" for index in range(1, args.num_trainers + 1)]
    lines = table(results, trainers) + [""] + verdict(results, args.runs)
    header = (f"Soak: {len(results)} of {args.runs} runs of the local swarm (1 aux peer, {args.num_trainers} "
              f"trainers, {args.duration:g} s of training each, seed {args.seed}){note}")
    (args.output_dir / "soak.md").write_text("\n".join([header, "", *lines]) + "\n")
    (args.output_dir / "soak.json").write_text(json.dumps(dict(
        settings=dict(runs=args.runs, duration=args.duration, num_trainers=args.num_trainers, seed=args.seed,
                      swarm_args=local_swarm.SWARM_ARGS),
        runs=[{**asdict(result), "fractions": {name: result.fraction(name) for name in result.alive_epochs}}
              for result in results]), indent=2))
    if results:
        plot(results, trainers, args.output_dir / "soak.png")
    return [header, "", *lines]


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--duration", type=float, default=100.0, help="seconds of training per run")
    parser.add_argument("--num_trainers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="draws the runs with a kill, the trainer and the moment")
    parser.add_argument("--output_dir", type=Path, default=Path("outputs/soak"))
    parser.add_argument("--refresh", type=float, default=2.0, help="seconds between the demo's progress views (in "
                                                                  "each run's console.log) and the trainers' progress "
                                                                  "lines")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.duration <= 0 or not 1 <= args.num_trainers <= 16:
        parser.error("--runs must be >= 1, --duration positive and --num_trainers between 1 and 16")
    args.output_dir = args.output_dir.resolve()
    try:
        local_swarm.prepare_output_dir(args.output_dir)  # replaces an earlier soak's folder only
    except (ValueError, OSError) as e:
        parser.error(f"--output_dir: {e}")
    (args.output_dir / local_swarm.MARKER_FILE).write_text(json.dumps(dict(soak=True, started=time.time())))
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    plans = plan_kills(args.runs, args.num_trainers, args.duration, args.seed)
    floor = local_swarm.entropy_floor()
    stop = StopSignals()
    results: List[RunResult] = []
    print(f"Soak: {args.runs} runs x {args.duration:g} s, {args.num_trainers} trainers; kills in runs "
          f"{sorted(plans)}; output in {args.output_dir} (Ctrl+C stops it)", flush=True)
    for run in range(1, args.runs + 1):
        result = run_once(run, args, plans.get(run), stop, floor)
        results.append(result)
        fractions = ", ".join(f"{name} {percent(result.fraction(name))}" for name in result.alive_epochs)
        print(f"run {run}: exit {result.exit_code}, {result.epochs} epochs, averaged with all: {fractions}"
              f"{f'; killed {result.killed} at {result.kill_at_s:.0f} s' if result.killed else ''}"
              f"{'; crashes: ' + '; '.join(result.crashes) if result.crashes else ''}", flush=True)
        write_report(results, args, " (interrupted)" if stop.count else "")
        if stop.count:
            break
    print("\n".join(write_report(results, args, " (interrupted by Ctrl+C)" if stop.count else "")))
    return stop.exit_code if stop.count else 0


if __name__ == "__main__":
    sys.exit(main())
