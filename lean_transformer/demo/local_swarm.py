"""A whole swarm on this machine in one command: an aux peer and N trainer peers on 127.0.0.1 train the tiny LeanGPT
on the embedded corpus (no GPU, no internet), with a live view, then a checkpoint, a plot and a summary.

    python -m lean_transformer.demo [--duration 180] [--num_trainers 2] [--output_dir outputs/demo]

Every peer is a separate process running the project's own ``run_aux_peer`` / ``run_trainer`` modules (exactly what a
volunteer runs: the scripts at the repository root, installed as
``lean_transformer_app`` by ``pip install .``), in its own
session, logging to ``OUTPUT_DIR/logs/NAME.log`` and writing its events to ``NAME.events.jsonl`` beside it. The live
view shows the peers' newest progress lines; every number (epochs, losses, samples, averaging rounds) comes from the
events, or from the aux peer's metrics file. Ctrl+C or SIGTERM stops every peer
gracefully (a second Ctrl+C at once); whatever is left of a peer's process group afterwards is killed, and the p2p
daemons' socket files left in /tmp are removed, so nothing outlives the command.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from lean_transformer.data.markov import MarkovCorpus
from lean_transformer.swarm.storage.checkpoint_dir import CheckpointDir
from lean_transformer.cli import OneLineErrorParser
from lean_transformer.swarm.monitoring.run_history import read_evaluations, read_rows
from lean_transformer.swarm.monitoring.events import EventReader
from lean_transformer.swarm.peers.processes import PeerProcess, ProcessTracker

PEER_MODULES = ("run_aux_peer", "run_trainer")  # the application's entry points; started, never imported
MARKER_FILE = "local_swarm.json"  # marks an output directory as ours, so that a new run may replace it
KEEP_CHECKPOINTS = 3
STARTUP_LIMIT = 300  # seconds for the peers to start and join (minutes on a busy machine)

# The tiny model trains at a few hundred samples/s per CPU core. It sits at the byte-bigram loss (~1.95 nats)
# until ~100 optimizer steps have taught its attention to read the previous word, whatever the batch size, so the
# demo needs many short epochs: each lasts at least matchmaking_time (gradient averaging is scheduled right after
# the previous epoch), and loopback matchmaking needs far less than 3 s. A smaller batch takes a lower LR (the
# largest stable LR with LAMB here is ~0.02 at 256 samples).
SWARM_ARGS = dict(target_batch_size=128, per_device_batch_size=8, max_sequence_length=64, matchmaking_time=0.5,
                  averaging_timeout=15, learning_rate=0.014, warmup_steps=5, total_steps=10_000, startup_timeout=120,
                  shutdown_timeout=20)

_LOG_PREFIX = re.compile(r"^\w{3} \d{1,2} [\d:.]+ \[\w+\] (?:\[[^\]]*\] )?")  # hivemind's "Nov 21 13:19:44.098 [INFO] "
_TRAINER_STATUS = re.compile(r"^epoch \d+ \|")
_AUX_STATUS = re.compile(r"^swarm epoch \d+ \|")


class PeerLog:
    """Follows one peer: the newest line of its log for the live view (text for people), and its events, where every
    number that the demo shows comes from."""

    def __init__(self, path: Path, events_path: Path):
        self.path = path
        self._offset, self._partial = 0, ""
        self._events = EventReader(events_path)
        self.initial_peers: Optional[list[str]] = None
        self.status = ""  # the newest progress line, or the newest line of any kind before the first one
        self.epoch_reports: dict[int, tuple[float, int, int]] = {}  # epoch -> (mean loss, mini-steps, samples)
        self.gradient_rounds = self.state_rounds = 0  # averaging rounds with at least one other peer
        self.joined = False

    def update(self) -> None:
        for event in self._events.new():
            self._read_event(event)
        try:
            with self.path.open("r", encoding="utf-8", errors="replace") as file:
                file.seek(self._offset)
                text = file.read()
                self._offset = file.tell()
        except FileNotFoundError:
            return
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            self._read_line(_LOG_PREFIX.sub("", line.strip()))

    def _read_event(self, event: dict) -> None:
        if event["event"] == "joined":
            self.joined, self.initial_peers = True, event["initial_peers"]
        elif event["event"] == "epoch":
            loss = math.nan if event["loss"] is None else event["loss"]
            self.epoch_reports[event["epoch"]] = (loss, event["mini_steps"], event["samples"])
        elif event["event"] == "averaged" and (event["group_size"] or 0) > 1:
            if event["kind"] == "gradients":
                self.gradient_rounds += 1
            elif event["kind"] == "parameters":
                self.state_rounds += 1

    def _read_line(self, line: str) -> None:
        if not line:
            return
        if _TRAINER_STATUS.match(line) or _AUX_STATUS.match(line):
            self.status = line
        elif not _TRAINER_STATUS.match(self.status) and not _AUX_STATUS.match(self.status):
            self.status = line[:160]  # starting up: show what it is doing

    def tail(self, lines: int = 8) -> str:
        try:
            return "\n".join(self.path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


@dataclass
class Peer:
    """One peer of the demo: its command, its process (:class:`PeerProcess`, in its own session, output and events in
    ``log_dir``) once started, and what the demo knows of it."""

    name: str
    argv: list[str]
    log_dir: Path
    env: dict
    process: Optional[PeerProcess] = None
    stop_requested: bool = False
    reported_exit: bool = False

    def __post_init__(self):
        self.log = PeerLog(self.log_dir / f"{self.name}.log", self.log_dir / f"{self.name}.events.jsonl")

    def start(self) -> None:
        self.process = PeerProcess(self.name, self.argv, self.log_dir, self.env, merge_output=True)

    @property
    def returncode(self) -> Optional[int]:
        return self.process.returncode if self.process is not None else None

    def request_stop(self) -> None:
        """SIGTERM to the peer itself (not its group): it leaves the swarm and stops its hivemind processes."""
        self.stop_requested = True
        if self.process is not None:
            self.process.terminate()

    def kill_group(self) -> None:
        if self.process is not None:
            self.process.kill_leftovers()
            self.process.process.wait()


def command_line(options: Mapping[str, object]) -> list[str]:
    """``{"run_id": "x", "matchmaking_time": 0.5}`` -> ``["--run_id", "x", "--matchmaking_time", "0.5"]``."""
    return [item for key, value in options.items() for item in (f"--{key}", str(value))]


class StopSignals:
    """Turns the first Ctrl+C / SIGTERM into a graceful stop and a second one into an immediate one. The handler only
    takes note (printing from it could interrupt a print of the main loop)."""

    def __init__(self):
        self.event = threading.Event()
        self.count, self.name = 0, ""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        self.count += 1
        self.name = signal.Signals(signum).name
        self.event.set()

    @property
    def exit_code(self) -> int:
        return 128 + signal.Signals[self.name].value if self.name else 0


@dataclass
class LocalSwarm:
    output_dir: Path
    num_trainers: int
    duration: float
    refresh: float
    wandb: bool
    peers: list[Peer] = field(default_factory=list)
    tracker: ProcessTracker = field(default_factory=ProcessTracker)
    problems: list[str] = field(default_factory=list)  # peers that crashed or did not stop cleanly
    on_tick: Optional[Callable[["LocalSwarm", float], None]] = None  # called with the seconds trained, every 0.5 s

    @property
    def aux(self) -> Peer:
        return self.peers[0]

    @property
    def trainers(self) -> list[Peer]:
        return self.peers[1:]

    @property
    def metrics_path(self) -> Path:
        return self.output_dir / "metrics.jsonl"

    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / "checkpoints"

    def _peer(self, name: str, module: str, *args: str) -> Peer:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [peer_modules_dir(), env.get("PYTHONPATH")]))
        # one compute thread pool per trainer, sized so that they do not fight over the cores
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.num_trainers)))
        if self.wandb:
            env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(self.output_dir))
        argv = ["-m", module, "--run_id", "local_swarm", "--host_maddrs", "/ip4/127.0.0.1/tcp/0",
                *command_line(SWARM_ARGS), *args]
        return Peer(name, argv, self.output_dir / "logs", env)

    def _poll(self) -> None:
        """Read the peers' new log lines, remember their processes and sockets, report peers that died."""
        self.tracker.scan()
        for peer in self.peers:
            peer.log.update()
            if peer.returncode is not None and not peer.reported_exit:
                self._report_exit(peer)

    def start(self, stop: threading.Event) -> bool:
        """Start the aux peer, then (once it is reachable) the trainers; False if stopped or failed meanwhile."""
        aux = self._peer("aux", "run_aux_peer", "--refresh_period", "0.5", "--metrics_path", str(self.metrics_path),
                         "--checkpoint_dir", str(self.checkpoint_dir), "--checkpoint_every_epochs", "10",
                         "--keep_checkpoints", str(KEEP_CHECKPOINTS), "--wandb_project",
                         "lean_transformer-local" if self.wandb else "")
        self.peers.append(aux)
        aux.start()
        print(f"Started the aux peer (pid {aux.process.pid}); waiting for its address ...", flush=True)
        if not self._wait_for(lambda: aux.log.initial_peers is not None, stop, "the aux peer to print its address"):
            return False
        for index in range(1, self.num_trainers + 1):
            trainer = self._peer(f"trainer{index}", "run_trainer", "--initial_peers", *aux.log.initial_peers,
                                 "--output_dir", str(self.output_dir / f"trainer{index}"),
                                 "--progress_every", str(self.refresh))
            self.peers.append(trainer)
            trainer.start()
        print(f"Started {self.num_trainers} trainer(s) joining through {aux.log.initial_peers[0]}; "
              f"logs in {self.output_dir / 'logs'}", flush=True)
        return self._wait_for(lambda: any(trainer.log.joined for trainer in self.trainers), stop,
                              "a trainer to join the swarm")

    def _wait_for(self, condition: Callable[[], bool], stop: threading.Event, what: str) -> bool:
        deadline = time.monotonic() + STARTUP_LIMIT
        while not stop.wait(0.5):
            self._poll()
            if condition():
                return True
            trainers_gone = self.trainers and all(t.returncode is not None for t in self.trainers)
            if self.aux.returncode is not None or trainers_gone:
                return False
            if time.monotonic() > deadline:
                self.problems.append(f"timed out after {STARTUP_LIMIT} s waiting for {what}")
                print(f"error: timed out after {STARTUP_LIMIT} s waiting for {what}; see the logs in "
                      f"{self.output_dir / 'logs'}", file=sys.stderr)
                return False
        return False

    def watch(self, stop: threading.Event) -> None:
        """Train for ``duration`` s with a view of the progress every ``refresh`` s, unless a stop is requested or
        the swarm loses its aux peer or all its trainers."""
        started_at = next_view = time.monotonic()
        print(f"Training for {_minutes(self.duration)} min", flush=True)
        while not stop.wait(0.5):
            self._poll()
            if self.aux.returncode is not None or all(trainer.returncode is not None for trainer in self.trainers):
                print("Stopping: the swarm has no aux peer or no trainer left", file=sys.stderr)
                return
            elapsed = time.monotonic() - started_at
            if elapsed >= self.duration:
                print(f"The {_minutes(self.duration)} min are over: stopping the peers", flush=True)
                return
            if self.on_tick is not None:
                self.on_tick(self, elapsed)
            if time.monotonic() >= next_view:
                self._print_view(elapsed)
                next_view += self.refresh

    def restart(self, peer: Peer) -> Peer:
        """SIGKILL ``peer``'s whole process group (as if its machine died) and start it again with the same command
        line, environment and log file (appended to), so that it rejoins the swarm as a restarted volunteer does.
        The kill is on purpose, so it is not reported as a problem; the new process is watched like any peer."""
        self.tracker.scan()  # remember its hivemind processes, so that clean_up finds any that left its group
        peer.kill_group()
        peer.reported_exit = True
        again = Peer(peer.name, peer.argv, peer.log_dir, peer.env)
        again.log = peer.log
        self.peers[self.peers.index(peer)] = again
        again.start()
        return again

    def _print_view(self, elapsed: float) -> None:
        clock = f"[{_minutes(elapsed)} / {_minutes(self.duration)}]"
        for index, peer in enumerate(self.peers):
            state = peer.log.status or "starting"
            if peer.returncode is not None:
                state = f"exited with code {peer.returncode}"
            print(f"{clock if index == 0 else ' ' * len(clock)} {peer.name:<9} {state}")
        sys.stdout.flush()

    def _report_exit(self, peer: Peer) -> None:
        peer.reported_exit = True
        if peer.stop_requested and peer.returncode in (0, -signal.SIGTERM):  # SIGTERM before its handler was set
            return
        how = "stopped with" if peer.stop_requested else "exited unexpectedly with"
        self.problems.append(f"{peer.name} {how} code {peer.returncode}")
        print(f"error: {peer.name} {how} code {peer.returncode}; the end of {peer.log.path}:\n{peer.log.tail()}",
              file=sys.stderr, flush=True)

    def shutdown(self, stop: StopSignals, grace: float) -> None:
        """Ask every peer to stop at once, wait up to ``grace`` s (cut short by another Ctrl+C), then kill whatever
        is left of their process groups and remove their socket files."""
        self.tracker.scan()
        for peer in self.peers:
            peer.request_stop()
        deadline, signals_before = time.monotonic() + grace, stop.count
        while any(peer.returncode is None for peer in self.peers):
            if time.monotonic() > deadline or stop.count > signals_before:
                break
            time.sleep(0.2)
        for peer in self.peers:
            if peer.returncode is None:
                print(f"warning: {peer.name} did not stop in time; killing it", file=sys.stderr)
            peer.kill_group()
            peer.log.update()
            if not peer.reported_exit:
                self._report_exit(peer)
        self.tracker.clean_up()

    def publish_final_checkpoint(self) -> Optional[tuple[int, Path, str]]:
        """The newest state the swarm reached as a checkpoint in ``checkpoints/``: the aux peer's newest checkpoint,
        or a trainer's exit backup when that is newer (copied over atomically). Returns (epoch, path, source)."""
        candidates = []
        for source in [self.aux, *self.trainers]:
            folder = self.checkpoint_dir if source is self.aux else self.output_dir / source.name / "backups"
            if folder.is_dir():
                latest = CheckpointDir(folder, keep_last=KEEP_CHECKPOINTS).latest()
                if latest is not None:
                    candidates.append((latest[0], source is self.aux, latest[1], source.name))
        if not candidates:
            return None
        epoch, from_aux, path, name = max(candidates)
        if not from_aux:
            path = CheckpointDir(self.checkpoint_dir, keep_last=KEEP_CHECKPOINTS).save(
                epoch, lambda directory: shutil.copytree(path, directory, dirs_exist_ok=True))
        return epoch, path, f"{name}'s state at epoch {epoch}"

    def summary(self, floor: float) -> list[str]:
        rows = list(read_rows(self.metrics_path)) if self.metrics_path.exists() else []
        evaluations = list(read_evaluations(self.metrics_path)) if self.metrics_path.exists() else []
        finished = [row for row in rows if math.isfinite(row.loss)]
        lines = []
        if finished:
            last = finished[-1]
            lines.append(f"final loss {last.loss:.4f} nats/token at swarm epoch {last.epoch}; the corpus's entropy "
                         f"floor is {floor:.4f} (gap {last.loss - floor:.4f})")
            if evaluations:
                lines.append(f"validation loss {evaluations[-1].validation_loss:.4f} nats/token on held-out documents "
                             f"(the checkpoint of epoch {evaluations[-1].epoch})")
            from lean_transformer.swarm.monitoring.plot import redraw_plot

            redraw_plot(rows, self.metrics_path.with_suffix(".png"), title="local swarm", evaluations=evaluations)
        else:
            lines.append(f"no swarm epoch was completed, so there is no loss to show (entropy floor {floor:.4f})")
        reports = [report for trainer in self.trainers for report in trainer.log.epoch_reports.values()]
        epochs = max((epoch for trainer in self.trainers for epoch in trainer.log.epoch_reports), default=0)
        lines.append(f"samples processed: {sum(samples for _, _, samples in reports):,} in {epochs} swarm "
                     f"epoch{'s' if epochs != 1 else ''} (target batch {SWARM_ARGS['target_batch_size']})")
        per_trainer = ", ".join(f"{trainer.name} {trainer.log.gradient_rounds}" for trainer in self.trainers)
        gradient_rounds = max((trainer.log.gradient_rounds for trainer in self.trainers), default=0)
        state_rounds = max((trainer.log.state_rounds for trainer in self.trainers), default=0)
        lines.append(f"averaging rounds completed: {gradient_rounds} of gradients and {state_rounds} of parameters "
                     f"({per_trainer or 'no trainer started'})")
        return lines


def _minutes(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def writing_sample(checkpoint: Path, lines: int = 3, width: int = 80, corpus_seed: int = 0) -> list[str]:
    """What the trained model writes (sampled, seeded, each line a new document) and, beside it, the corpus's own
    text: the eye sees at once how much of the chain's structure the swarm has learned. The model and its tokenizer
    both load from the checkpoint, as a user would load them."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    from lean_transformer.models.generation import sample_text
    from lean_transformer.models.gpt import LeanGPTForCausalLM

    transformers_logging.disable_progress_bar()  # the demo's summary, not a weight-loading bar
    model = LeanGPTForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    written = sample_text(model, tokenizer, [""] * lines, max_new_tokens=width, seed=0)
    corpus = MarkovCorpus.generate(corpus_seed).documents(seed=corpus_seed + 1)
    own = [next(corpus)[:width] for _ in range(lines)]
    return [f"model:  {' '.join(text.split())}" for text in written] + \
        [f"corpus: {' '.join(text.split())}" for text in own]


def entropy_floor(corpus_seed: int = 0) -> float:
    """The loss floor (nats per byte-level token) of the embedded corpus the trainers train on."""
    return MarkovCorpus.generate(corpus_seed).entropy_per_byte


def peer_modules_dir() -> Optional[str]:
    """The directory that holds the peers' entry modules (a checkout's root, or ``lean_transformer_app`` where the
    project is installed), or None if they are not importable here. Passed to the peers in PYTHONPATH, so they start
    from any working directory."""
    for prefix in ("", "lean_transformer_app."):
        try:
            specs = [importlib.util.find_spec(prefix + module) for module in PEER_MODULES]
        except ModuleNotFoundError:  # no lean_transformer_app
            continue
        if all(spec is not None and spec.origin for spec in specs):
            return str(Path(specs[0].origin).resolve().parent)
    return None


def prepare_output_dir(path: Path) -> None:
    """A fresh output directory; one left by an earlier run of this command is replaced, anything else is kept."""
    if path.exists() and any(path.iterdir()):
        if not (path / MARKER_FILE).is_file():
            raise ValueError(f"--output_dir: {path} is not empty and was not made by this command; choose another")
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = OneLineErrorParser(prog="python -m lean_transformer.demo", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--duration", type=float, default=180.0,
                        help="seconds of training, counted from when the first trainer has joined (start-up takes "
                             "20-60 s more)")
    parser.add_argument("--num_trainers", type=int, default=2, help="trainer peers to start")
    parser.add_argument("--output_dir", type=Path, default=Path("outputs/demo"),
                        help="logs, metrics, plot and checkpoints; an earlier run's folder here is replaced")
    parser.add_argument("--refresh", type=float, default=5.0, help="seconds between two views of the progress")
    parser.add_argument("--wandb", action="store_true", help="also log the metrics to an offline wandb run")
    args = parser.parse_args(argv)
    if args.duration <= 0:
        parser.error(f"--duration must be positive, got {args.duration:g}")
    if not 1 <= args.num_trainers <= 16:
        parser.error(f"--num_trainers must be between 1 and 16, got {args.num_trainers}")
    if args.refresh <= 0:
        parser.error(f"--refresh must be positive, got {args.refresh:g}")
    if peer_modules_dir() is None:
        parser.error(f"the peers' entry points ({', '.join(PEER_MODULES)}) are not importable; install the project "
                     f"(pip install .) or run this from a checkout of the repository")
    args.output_dir = args.output_dir.resolve()
    try:
        prepare_output_dir(args.output_dir)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    floor = entropy_floor()
    (args.output_dir / MARKER_FILE).write_text(json.dumps(
        dict(duration=args.duration, num_trainers=args.num_trainers, started=time.time(), **SWARM_ARGS), indent=2))
    print(f"Local swarm: 1 aux peer and {args.num_trainers} trainer(s) train the tiny LeanGPT on the embedded corpus "
          f"(entropy floor {floor:.4f} nats/token) for {args.duration:g} s; Ctrl+C stops it", flush=True)
    swarm = LocalSwarm(args.output_dir, args.num_trainers, args.duration, args.refresh, args.wandb)
    return run(swarm, StopSignals(), floor)


def run(swarm: LocalSwarm, stop: StopSignals, floor: float) -> int:
    """Start, watch and stop ``swarm``, then print its summary; the command's exit code (non-zero if a peer
    crashed or did not stop cleanly, if there is no checkpoint, or 128 + the signal that stopped it)."""
    started_at = time.monotonic()
    try:
        if swarm.start(stop.event):
            swarm.watch(stop.event)
    finally:
        if stop.count:
            print(f"\nCaught {stop.name}: stopping the peers (press Ctrl+C again to stop them at once)", flush=True)
        swarm.shutdown(stop, grace=SWARM_ARGS["shutdown_timeout"] + 10)

    print(f"\nSummary of the local swarm ({_minutes(time.monotonic() - started_at)} min):")
    for line in swarm.summary(floor):
        print(f"  {line}")
    checkpoint = swarm.publish_final_checkpoint()
    if checkpoint is not None:
        epoch, path, source = checkpoint
        print(f"  checkpoint: {path} ({source}; LeanGPTForCausalLM.from_pretrained or --resume_from)")
        print("  what the model writes, and the corpus's own text:")
        for line in writing_sample(path):
            print(f"    {line}")
    plot = swarm.metrics_path.with_suffix(".png")
    print(f"  plot: {plot if plot.exists() else 'none'}; metrics: {swarm.metrics_path}; "
          f"logs: {swarm.output_dir / 'logs'}")
    if swarm.wandb:
        print(f"  wandb: an offline run in {swarm.output_dir / 'wandb'} (upload it with `wandb sync`)")
    if swarm.problems:
        print(f"  problems: {'; '.join(swarm.problems)} (see the logs)")
    sys.stdout.flush()
    if stop.count:
        return stop.exit_code
    return 1 if swarm.problems or checkpoint is None else 0


if __name__ == "__main__":
    sys.exit(main())
