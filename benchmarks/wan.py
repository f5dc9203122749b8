"""Training over slow links: sync mode (gradients averaged every step) against DiLoCo (an outer round every H inner
steps), each trainer a real peer in its own network namespace behind a rate-limited link.

Network: a Linux bridge; each trainer peer lives in a network namespace joined to it by a veth pair, and both
directions of its link are shaped with ``tc ... tbf`` (its egress inside the namespace, its ingress on the bridge's
side of the pair) to 100 or 20 Mbit/s. Only the rate is limited: ``netem`` is not available on the machine this
was written on, so no latency is added (the links have the bridge's sub-millisecond latency). The bootstrap DHT peer
runs in this process, on the bridge. The links are shaped, and their byte counters read, once every trainer's
progress event shows all of them at one epoch (a trainer that starts apart from the others catches up by downloading
the swarm's state, which is not what is measured here).

Trainers: run_trainer.py, one process per namespace, one torch thread each (OMP_NUM_THREADS=1), a 25M-parameter
LeanGPT (benchmarks/wan_model.json) on the CPU, 2 sequences of 64 tokens per micro-batch. In sync mode the target
batch is one micro-batch of every trainer, so the peers average gradients after every local step (as DDP would).

Measured per mode over the shaped window only (from shaping the links to stopping the trainers), from the trainers'
progress events (cumulative compute seconds, wall seconds, samples and loss sum since each trainer's loop started: a
window's figures are the difference of its first and last line) and the namespaces' interface counters (read twice a
second, interpolated at those lines' times):
- compute utilization: each trainer's time in forward, backward and (DiLoCo) inner optimizer steps over its wall time
  in the window, mean of the trainers (outer all-reduces, matchmaking, state downloads are not compute);
- bytes on the wire per sample: bytes the trainers' interfaces sent in the window / samples they computed in it;
- samples/s of the swarm (sum of the trainers'); loss at equal samples: the mean training loss of the micro-batches
  each trainer trained on between 3/4 of the sample budget and the budget (samples counted from each trainer's start,
  so every mode is compared at the same count); the DiLoCo and bare-bridge runs train until both trainers reach it.
Sync mode's loss per sample does not depend on the link (the same all-reduce, only slower), so one sync run on the
unshaped bridge trains for the full sample budget and gives the loss baseline; the shaped sync runs last a fixed time.

Modes that need DiLoCo's flags (--local_steps ...) are skipped, with a note, when run_trainer.py does not have them.

Everything this benchmark creates (namespaces, veth pairs, bridge, peer processes, their hivemind sockets) is removed
on exit, on an error and on Ctrl+C / SIGTERM. Needs root, ``ip`` and ``tc``.

Usage: sudo python benchmarks/wan.py [--quick] [--output_dir outputs/wan] [--modes NAME ...]
       sudo python benchmarks/wan.py --network_check   (build the network, wait for Ctrl+C, remove it)
The default run (11 modes, 200 samples per trainer) takes about 20 minutes on 2 cores; --quick (3 modes) about 5.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lean_transformer.swarm.peers.processes import (PeerProcess, hivemind_sockets, torch_shared_memory,  # noqa: E402
                                                    wait_until)

MODEL_CONFIG = REPO / "benchmarks" / "wan_model.json"
BATCH, SEQUENCE = 2, 64


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the network


def run_ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=30)


class WanNetwork:
    """A bridge and ``num_peers`` network namespaces joined to it by veth pairs, named after ``tag`` (so that two
    runs do not collide). ``with WanNetwork(...) as wan:`` builds it and removes it, and everything running in its
    namespaces, on the way out (exception and KeyboardInterrupt included); ``close`` is idempotent."""

    def __init__(self, num_peers: int, tag: Optional[str] = None):
        tag = tag or f"w{os.getpid() % 100000}"
        self.tag, self.num_peers = tag, num_peers
        self.bridge = f"{tag}br"
        self.namespaces = [f"{tag}n{i}" for i in range(num_peers)]
        self.host_ends = [f"{tag}v{i}" for i in range(num_peers)]
        number = os.getpid() % 50000  # a /24 of 10.0.0.0/8 of its own, also per run
        self.subnet = f"10.{100 + number // 250}.{number % 250}"
        self.bridge_ip = f"{self.subnet}.1"
        self.peer_ips = [f"{self.subnet}.{10 + i}" for i in range(num_peers)]
        self.sockets: set[str] = set()
        self.seen_pids: set[int] = set()  # their torch shared-memory files (/dev/shm/torch_PID_*) go at close
        self.built = False

    def __enter__(self) -> "WanNetwork":
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def build(self) -> None:
        if len(self.bridge) > 15 or len(self.host_ends[-1]) > 15:
            raise ValueError(f"tag {self.tag!r}: interface names must stay within 15 characters")
        self.built = True  # from here on, close() removes whatever part exists
        run_ip("ip", "link", "add", self.bridge, "type", "bridge")
        run_ip("ip", "addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
        run_ip("ip", "link", "set", self.bridge, "up")
        for namespace, host_end, address in zip(self.namespaces, self.host_ends, self.peer_ips):
            run_ip("ip", "netns", "add", namespace)
            run_ip("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            run_ip("ip", "link", "set", host_end, "master", self.bridge, "up")
            run_ip("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            run_ip("ip", "-n", namespace, "link", "set", "eth0", "up")
            run_ip("ip", "-n", namespace, "link", "set", "lo", "up")

    def shape(self, rate_mbit: Optional[float]) -> None:
        """Limit both directions of every peer's link to ``rate_mbit`` (None: remove the limit)."""
        for peer in range(self.num_peers):
            self.shape_peer(peer, rate_mbit)

    def shape_peer(self, peer: int, rate_mbit: Optional[float]) -> None:
        """Limit both directions of one peer's link to ``rate_mbit`` (None: remove the limit)."""
        for prefix in (["ip", "netns", "exec", self.namespaces[peer]], []):
            device = "eth0" if prefix else self.host_ends[peer]
            run_ip(*prefix, "tc", "qdisc", "del", "dev", device, "root", check=False)
            if rate_mbit is not None:
                run_ip(*prefix, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{rate_mbit}mbit",
                       "burst", "32kbit", "latency", "400ms")

    def block_inbound(self, peer: int) -> None:
        """Put a peer behind NAT: its namespace drops every new inbound connection on its link (nftables), while its
        own outbound connections and their replies pass. Needs the ``nft`` command."""
        rules = ('table inet nat_emulation {\n chain input {\n  type filter hook input priority 0; policy accept;\n'
                 '  iifname "eth0" ct state new drop\n }\n}\n')
        subprocess.run(["ip", "netns", "exec", self.namespaces[peer], "nft", "-f", "-"], input=rules, check=True,
                       capture_output=True, text=True, timeout=30)

    def sent_bytes(self) -> List[int]:
        """Bytes each peer's interface has sent so far."""
        counts = []
        for namespace in self.namespaces:
            links = json.loads(run_ip("ip", "-n", namespace, "-s", "-j", "link", "show", "eth0").stdout)
            counts.append(int(links[0]["stats64"]["tx"]["bytes"]))
        return counts

    def command(self, peer: int, argv: Sequence[str]) -> List[str]:
        return ["ip", "netns", "exec", self.namespaces[peer], *argv]

    def pids(self) -> List[int]:
        """Every process in the namespaces (whoever started it): what ``ip netns pids`` finds, in one pass over /proc
        for all namespaces (a benchmark notes them twice a second; an ``ip`` per namespace and call took a fifth of a
        core with 21 namespaces, which the peers lacked)."""
        inodes = set()  # each namespace's (device, inode) in the nsfs
        for namespace in self.namespaces:
            with contextlib.suppress(FileNotFoundError):
                status = os.stat(f"/run/netns/{namespace}")
                inodes.add((status.st_dev, status.st_ino))
        found = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError):  # exited meanwhile
                    status = os.stat(f"/proc/{entry.name}/ns/net")
                    if (status.st_dev, status.st_ino) in inodes:
                        found.append(int(entry.name))
        self.seen_pids.update(found)
        return found

    def remember_sockets(self) -> None:
        """Note the hivemind unix sockets the processes in the namespaces hold, to remove their files at close
        (hivemind leaves its clients' socket files behind even when it shuts down cleanly)."""
        self.sockets |= hivemind_sockets(self.pids())

    def close(self) -> None:
        if not self.built:
            return
        self.remember_sockets()
        for _ in range(2):  # a process can fork while the first round is killed
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.05)
        for namespace in self.namespaces:  # deleting a namespace deletes its end of the pair, and so the pair
            run_ip("ip", "netns", "del", namespace, check=False)
        for host_end in self.host_ends:
            run_ip("ip", "link", "del", host_end, check=False)
        run_ip("ip", "link", "del", self.bridge, check=False)
        for path in self.sockets:
            Path(path).unlink(missing_ok=True)
        for path in torch_shared_memory(list(self.seen_pids)):
            path.unlink(missing_ok=True)
        self.built = False

    def leftovers(self) -> List[str]:
        """What of this network still exists (for tests): namespaces, links and socket files."""
        namespaces = set(run_ip("ip", "netns", "list").stdout.split())
        links = {line.split(":")[1].strip().split("@")[0] for line in run_ip("ip", "-o", "link").stdout.splitlines()}
        return ([name for name in self.namespaces if name in namespaces]
                + [name for name in [self.bridge, *self.host_ends] if name in links]
                + [path for path in self.sockets if os.path.exists(path)])


def check_requirements() -> Optional[str]:
    """Why this benchmark cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command (iproute2)"
    return None


def raise_on_signals() -> None:
    """SIGINT and SIGTERM unwind as KeyboardInterrupt, so that the ``finally`` blocks remove the network. SIGINT too:
    a process started in the background by a non-interactive shell inherits SIGINT ignored, and Python keeps it so."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)


# ---------------------------------------------------------------- one mode


@dataclass(frozen=True)
class Mode:
    name: str
    rate_mbit: Optional[float]  # None: the bare bridge
    flags: Dict[str, str] = field(default_factory=dict)  # extra run_trainer.py flags
    seconds: Optional[float] = None  # stop after this long; None: after the sample budget
    diloco: bool = False  # needs DiLoCo's flags

    @property
    def link(self) -> str:
        return "bare bridge" if self.rate_mbit is None else f"{self.rate_mbit:g} Mbit/s"


def diloco_mode(rate: float, local_steps: int, overlap: bool, compression: str) -> Mode:
    name = f"DiLoCo H={local_steps}{', overlap' if overlap else ''}, {compression}"
    flags = {"local_steps": str(local_steps), "outer_overlap": str(overlap).lower(), "outer_compression": compression}
    return Mode(name, rate, flags, diloco=True)


OUTER_COMPRESSIONS = ["none", "float16", "scaled_float16", "uniform8bit", "quantile8bit", "blockwise8bit",
                      "size_adaptive", "topk"]


def default_modes(quick: bool) -> List[Mode]:
    if quick:
        return [Mode("sync, bare bridge", None), Mode("sync", 20, seconds=40), diloco_mode(20, 50, False, "uniform8bit")]
    return [Mode("sync, bare bridge", None), Mode("sync", 20, seconds=45),
            diloco_mode(20, 10, False, "uniform8bit"), diloco_mode(20, 50, False, "uniform8bit"),
            diloco_mode(20, 50, True, "uniform8bit"), diloco_mode(20, 50, False, "none"),
            diloco_mode(20, 50, False, "float16"), diloco_mode(20, 50, False, "topk"),
            diloco_mode(20, 50, True, "topk"), Mode("sync", 100, seconds=45),
            diloco_mode(100, 50, False, "uniform8bit")]


@dataclass(frozen=True)
class Point:
    """One progress event: cumulative figures since the trainer's training loop started."""
    time: float  # unix time of the line
    epoch: int
    peers: int
    samples: int  # computed
    compute: float  # seconds in forward, backward and inner steps
    wall: float  # seconds
    loss_sum: float  # over the micro-batches trained on
    losses: int  # micro-batches trained on


@dataclass
class TrainerProgress:
    """A trainer's ``progress`` events as points, and its state downloads."""
    peer: PeerProcess
    points: List[Point] = field(default_factory=list)
    downloads: List[tuple] = field(default_factory=list)  # (unix time, samples computed) of state downloads

    def read(self) -> None:
        self.points, self.downloads = [], []
        for event in self.peer.events():
            if event["event"] == "state_downloaded" and self.points:  # what it trained is replaced by the swarm's
                self.downloads.append((event["time"], self.points[-1].samples))
            elif event["event"] == "progress":
                self.points.append(Point(event["time"], event["epoch"], event["peers"], event["samples"],
                                         event["compute_seconds"], event["wall_seconds"], event["loss_sum"],
                                         event["losses"]))

    @property
    def view(self) -> Optional[tuple]:
        """(epoch, peers) of the last progress event."""
        return (self.points[-1].epoch, self.points[-1].peers) if self.points else None

    @property
    def samples(self) -> int:
        return self.points[-1].samples if self.points else 0

    def window(self, start: float, stop: float) -> tuple:
        """The first progress event at or after ``start`` and the last one at or before ``stop``."""
        inside = [point for point in self.points if start <= point.time <= stop]
        if len(inside) < 2:
            raise RuntimeError(f"{self.peer.events_path}: fewer than two progress events in the measured window")
        return inside[0], inside[-1]

    def samples_at(self, moment: float) -> int:
        """Samples computed by ``moment`` (its last progress event then)."""
        before = [point.samples for point in self.points if point.time <= moment]
        return before[-1] if before else 0

    def samples_in_model_at(self, moment: float) -> int:
        """Samples computed by ``moment`` since this trainer last replaced its state by the swarm's (those before are
        lost: a trainer that falls out of sync downloads the swarm's state, which its earlier samples are not in)."""
        lost = [samples for when, samples in self.downloads if when <= moment]
        return self.samples_at(moment) - (lost[-1] if lost else 0)


def swarm_samples(logs: Sequence[TrainerProgress], moment: float) -> int:
    """Samples in the swarm's model by ``moment``: each trainer's since its last state download."""
    return sum(log.samples_in_model_at(moment) for log in logs)


def loss_at(logs: Sequence[TrainerProgress], samples: int) -> float:
    """Mean training loss of the trainers' micro-batches trained while the swarm's model went from 3/4 ``samples`` to
    ``samples`` per trainer (``swarm_samples`` / number of trainers), from the cumulative loss sums of consecutive
    progress events (pairs with a state download between them are left out); nan if the run did not get that far."""
    low, high = 0.75 * samples * len(logs), samples * len(logs)
    end = max(point.time for log in logs for point in log.points)
    if swarm_samples(logs, end) < high:
        return math.nan
    total = count = 0.0
    for log in logs:
        for a, b in zip(log.points, log.points[1:]):
            if low < swarm_samples(logs, b.time) <= high and not any(a.time < t <= b.time for t, _ in log.downloads):
                total, count = total + b.loss_sum - a.loss_sum, count + b.losses - a.losses
    return total / count if count else math.nan


@dataclass
class ModeResult:
    """A mode's logs and byte counters. The measured window runs from shaping the links to stopping the trainers:
    each trainer's figures are the difference of its first and last progress events inside it, and its bytes are read
    off its interface's counter (sampled twice a second) at those two lines' times."""
    mode: Mode
    logs: List[TrainerProgress]
    counters: List[tuple]  # (unix time, [bytes sent by each trainer's interface]) from shaping to stopping
    shaped_at: float  # unix time
    stopped_at: float

    def windows(self) -> List[tuple]:
        return [log.window(self.shaped_at, self.stopped_at) for log in self.logs]

    @property
    def utilization(self) -> float:
        return statistics.mean((b.compute - a.compute) / (b.wall - a.wall) for a, b in self.windows())

    @property
    def samples(self) -> int:
        """Samples the trainers computed in the window."""
        return sum(b.samples - a.samples for a, b in self.windows())

    @property
    def seconds(self) -> float:
        return statistics.mean(b.wall - a.wall for a, b in self.windows())

    @property
    def samples_per_second(self) -> float:
        return sum((b.samples - a.samples) / (b.wall - a.wall) for a, b in self.windows())

    def sent_bytes(self, trainer: int, moment: float) -> float:
        """Bytes trainer ``trainer``'s interface had sent at ``moment``, interpolated between counter readings."""
        times = [t for t, _ in self.counters]
        values = [counts[trainer] for _, counts in self.counters]
        if not times[0] <= moment <= times[-1]:
            raise RuntimeError(f"no byte counter reading around {moment}")
        return float(np.interp(moment, times, values))

    @property
    def bytes_per_sample(self) -> float:
        sent = sum(self.sent_bytes(i, b.time) - self.sent_bytes(i, a.time) for i, (a, b) in enumerate(self.windows()))
        return sent / self.samples

    def together_samples(self) -> List[int]:
        """Samples each trainer had computed when the links were shaped (training apart before that)."""
        return [a.samples for a, _ in self.windows()]

    def loss_at(self, samples: int) -> float:
        return loss_at(self.logs, samples)


def trainer_argv(mode: Mode, wan: WanNetwork, peer: int, initial_peers: Sequence[str], budget: int,
                 workdir: Path) -> List[str]:
    num_trainers = wan.num_peers
    options = {"run_id": f"wan{wan.tag}", "host_maddrs": f"/ip4/{wan.peer_ips[peer]}/tcp/0",
               "model_config_path": str(MODEL_CONFIG), "per_device_batch_size": str(BATCH),
               "max_sequence_length": str(SEQUENCE), "target_batch_size": str(BATCH * num_trainers),
               "matchmaking_time": "1", "averaging_timeout": "60", "average_state_every": "100000",
               "backup_every_epochs": "0", "warmup_steps": "10", "total_steps": "100000", "learning_rate": "0.002",
               "max_epochs": str(2 * budget), "progress_every": "1", "shutdown_timeout": "60",
               "output_dir": str(workdir / f"out{peer}"), **mode.flags}
    argv = [str(REPO / "run_trainer.py"), "--initial_peers", *initial_peers]
    for key, value in options.items():
        argv += [f"--{key}", value]
    return argv


def run_mode(mode: Mode, num_trainers: int, budget: int, logdir: Path, workdir: Path) -> ModeResult:
    """Run ``mode`` until a trainer has computed ``budget`` samples (or for ``mode.seconds``); logs go to
    ``logdir``, the trainers' outputs to ``workdir``."""
    import hivemind

    from lean_transformer.swarm.protocol.dht import visible_maddrs

    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with WanNetwork(num_trainers) as wan:
        bootstrap = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{wan.bridge_ip}/tcp/0"])
        peers: List[PeerProcess] = []
        try:
            initial_peers = visible_maddrs(bootstrap)
            for i in range(num_trainers):
                peers.append(PeerProcess(f"trainer{i}", trainer_argv(mode, wan, i, initial_peers, budget, workdir),
                                         logdir, env, cwd=REPO, argv_prefix=wan.command(i, []), merge_output=True))
            logs = [TrainerProgress(peer) for peer in peers]
            # shape once the trainers train together: two peers that started apart catch up by downloading the
            # swarm's state, which on a shaped link would eat the measurement
            together = (lambda: len({log.view for log in logs}) == 1 and logs[0].view is not None
                        and logs[0].view[1] == num_trainers)
            wait_while_running(together, logs, 180, "the trainers to see each other at the same epoch")
            wan.shape(mode.rate_mbit)
            shaped_at = time.time()
            counters = [(shaped_at, wan.sent_bytes())]
            progress(f"  training together; links {'bare' if mode.rate_mbit is None else f'{mode.rate_mbit:g} Mbit/s'}")
            deadline = None if mode.seconds is None else time.monotonic() + mode.seconds
            last_print = time.monotonic()

            def done() -> bool:
                nonlocal last_print
                counters.append((time.time(), wan.sent_bytes()))
                wan.pids()  # noted, to remove their shared-memory files at close
                if time.monotonic() - last_print > 15:
                    last_print = time.monotonic()
                    progress(f"  samples per trainer: {[log.samples for log in logs]}")
                if deadline is not None:
                    return time.monotonic() > deadline
                return swarm_samples(logs, time.time()) >= budget * len(logs)

            wait_while_running(done, logs, 1800, "the sample budget")
            stopped_at = counters[-1][0]
            wan.remember_sockets()
            for peer in peers:
                peer.terminate()  # SIGTERM: SIGINT may be ignored (started in the background)
            for peer, log in zip(peers, logs):
                try:
                    peer.wait(75)
                except TimeoutError:
                    progress(f"  a trainer did not stop within 75 s of SIGTERM, killed (see {peer.stderr_path})")
                log.read()
        finally:
            for peer in peers:
                peer.kill()
            bootstrap.shutdown()
    return ModeResult(mode, logs, counters, shaped_at, stopped_at)


def wait_while_running(condition: Callable[[], bool], logs: Sequence[TrainerProgress], timeout: float,
                       what: str) -> None:
    """:func:`wait_until` ``condition`` (the trainers' events read afresh each time); RuntimeError if a trainer
    exits meanwhile."""
    def check() -> bool:
        for log in logs:
            log.read()
            if log.peer.returncode is not None:
                raise RuntimeError(f"{log.peer.name} exited with {log.peer.returncode} while waiting for {what}:\n"
                                   f"{log.peer.log_tail()}")
        return condition()

    wait_until(check, timeout, what, interval=0.5)


# ---------------------------------------------------------------- report


def has_diloco_flags() -> bool:
    return "local_steps" in (REPO / "arguments.py").read_text()


def table(results: Sequence[ModeResult], budget: int, machine: str) -> List[str]:
    baseline = next((r for r in results if r.mode.name.startswith("sync") and r.mode.seconds is None), None)
    sync = {r.mode.rate_mbit: r for r in results if r.mode.name.startswith("sync") and r.mode.rate_mbit is not None}
    base_loss = baseline.loss_at(budget) if baseline is not None else math.nan
    rows = [f"Two trainer peers, each in its own network namespace, link rate-limited in both directions (tc tbf, no "
            f"added latency); {machine}. Utilization, samples/s and bytes: over the window from shaping the links to "
            f"stopping. Loss: mean training loss of the micro-batches trained while the swarm's model went from "
            f"{int(0.75 * budget)} to {budget} samples per trainer (samples a trainer computed before it downloaded the "
            f"swarm's state are not counted); sync mode's from the bare-bridge run (its loss per sample does not "
            f"depend on the link).", "",
            "| mode | link | compute utilization | bytes sent / sample | vs sync, same link | samples/s (swarm) | "
            f"loss at {budget} samples/trainer | vs sync | window | samples apart |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        link = "bridge (no limit)" if r.mode.rate_mbit is None else f"{r.mode.rate_mbit:g} Mbit/s"
        reference = sync.get(r.mode.rate_mbit)
        ratio_text = ("" if reference is None or reference is r or r.bytes_per_sample <= 0
                      else f"{reference.bytes_per_sample / r.bytes_per_sample:,.0f}x fewer")
        loss = r.loss_at(budget) if r.mode.seconds is None else math.nan
        loss_text = f"{loss:.4f}" if math.isfinite(loss) else "(timed run)"
        versus = f"{loss / base_loss:.3f}x" if math.isfinite(loss / base_loss) and r is not baseline else ""
        rows.append(f"| {r.mode.name} | {link} | {r.utilization:.1%} | {r.bytes_per_sample / 1e3:,.1f} KB | "
                    f"{ratio_text} | {r.samples_per_second:.2f} | {loss_text} | {versus} | {r.seconds:.0f} s | "
                    f"{'/'.join(map(str, r.together_samples()))} |")
    rows += ["", "window: seconds measured per trainer; samples apart: samples each trainer had computed before the "
                 "two trained together (the links were shaped then)."]
    return rows


def plot(results: Sequence[ModeResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=80)
    for result in results:
        times, losses = [], []
        for log in result.logs:  # the mean loss between consecutive progress events, per trainer
            for a, b in zip(log.points, log.points[1:]):
                if b.losses > a.losses:
                    times.append(b.time - result.shaped_at)
                    losses.append((b.loss_sum - a.loss_sum) / (b.losses - a.losses))
        order = sorted(range(len(times)), key=times.__getitem__)
        window = 9  # a moving mean over both trainers' lines
        times = [times[i] for i in order][window - 1:]
        losses = [statistics.mean(losses[j] for j in order[i:i + window]) for i in range(len(times))]
        link = "bare" if result.mode.rate_mbit is None else f"{result.mode.rate_mbit:g} Mbit/s"
        axes.plot(times, losses, label=f"{result.mode.name} ({link})", linewidth=1.2)
    axes.set_xlabel("wall time since the links were shaped, s")
    axes.set_ylabel("training loss (moving mean)")
    axes.set_title("Two CPU trainers, 25M LeanGPT, rate-limited links")
    axes.legend(fontsize=7, ncol=2)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


# ---------------------------------------------------------------- main


def network_check(num_peers: int) -> int:
    """Build the network, start an idle process in each namespace, say so, and hold until Ctrl+C / SIGTERM."""
    with WanNetwork(num_peers) as wan:
        for i in range(num_peers):
            subprocess.Popen(wan.command(i, ["sleep", "3600"]), start_new_session=True)
        wan.shape(20)
        print(f"network ready: {' '.join(wan.namespaces)} {wan.bridge}", flush=True)
        while True:
            time.sleep(1)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run of about 3 minutes")
    parser.add_argument("--samples", type=int, default=None,
                        help="sample budget per trainer (default 200, --quick 40)")
    parser.add_argument("--modes", nargs="*", default=None,
                        help="run only the modes whose 'name, link' contains one of these (e.g. 'bare' '20 Mbit')")
    parser.add_argument("--output_dir", default="outputs/wan",
                        help="the trainers' logs (modeN/), results.json, table.md and the plot go here "
                             "(rewritten after each mode)")
    parser.add_argument("--plot", default=None, help="where to write the plot (default: OUTPUT_DIR/wan.png)")
    parser.add_argument("--network_check", action="store_true",
                        help="only build the network (2 namespaces), hold until Ctrl+C, then remove it")
    args = parser.parse_args(argv)
    if args.samples is not None and args.samples < 2 * BATCH:
        parser.error(f"--samples must be at least {2 * BATCH}, got {args.samples}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if (problem := check_requirements()) is not None:
        print(f"wan.py: error: {problem}", file=sys.stderr)
        return 1
    raise_on_signals()
    try:
        if args.network_check:
            return network_check(2)
        return benchmark(args)
    except KeyboardInterrupt:
        print("wan.py: interrupted; the network and the peers are removed", file=sys.stderr)
        return 130


def benchmark(args: argparse.Namespace) -> int:
    budget = args.samples or (40 if args.quick else 200)
    modes = default_modes(args.quick)
    if args.modes:
        modes = [m for m in modes if any(word in f"{m.name}, {m.link}" for word in args.modes)]
    skipped = [] if has_diloco_flags() else [m for m in modes if m.diloco]
    if skipped:
        progress(f"skipping {len(skipped)} DiLoCo mode(s): run_trainer.py has no --local_steps in this checkout")
    modes = [m for m in modes if m not in skipped]
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    machine = f"{os.cpu_count()}-core CPU, torch threads 1 per trainer"
    results: List[ModeResult] = []
    started = time.monotonic()

    def report() -> List[str]:
        """The table, plot and results.json of the modes run so far (rewritten after each mode)."""
        rows = table(results, budget, machine)
        if skipped:
            rows += ["", "Not run (run_trainer.py has no --local_steps yet): " + "; ".join(m.name for m in skipped)]
        plot_path = Path(args.plot) if args.plot else output / "wan.png"
        plot(results, plot_path)
        rows += ["", f"Plot: {plot_path}. {len(results)}/{len(modes)} modes, "
                     f"{(time.monotonic() - started) / 60:.1f} min."]
        (output / "results.json").write_text(json.dumps(
            [{"mode": r.mode.name, "rate_mbit": r.mode.rate_mbit, "flags": r.mode.flags, "utilization": r.utilization,
              "bytes_per_sample": r.bytes_per_sample, "samples_per_second": r.samples_per_second,
              "window_seconds": r.seconds, "samples_in_window": r.samples, "samples_apart": r.together_samples(),
              f"loss_at_{budget}": r.loss_at(budget) if r.mode.seconds is None else None,
              "shaped_at": r.shaped_at, "stopped_at": r.stopped_at,
              "points": [[dataclasses.astuple(point) for point in log.points] for log in r.logs]} for r in results],
            indent=1))
        (output / "table.md").write_text("\n".join(rows) + "\n")
        return rows

    rows = ["no mode matched --modes"]
    with tempfile.TemporaryDirectory(prefix="wan-") as scratch:
        for index, mode in enumerate(modes):
            link = "bare bridge" if mode.rate_mbit is None else f"{mode.rate_mbit:g} Mbit/s"
            until = f"{mode.seconds:g} s" if mode.seconds else f"{budget} samples per trainer"
            progress(f"[{index + 1}/{len(modes)}] {mode.name}, {link}, until {until} "
                     f"({(time.monotonic() - started) / 60:.1f} min so far)")
            result = run_mode(mode, 2, budget, output / f"mode{index}", Path(scratch) / f"mode{index}")
            results.append(result)
            progress(f"  utilization {result.utilization:.1%}, {result.bytes_per_sample / 1e3:,.1f} KB sent/sample, "
                     f"{result.samples_per_second:.2f} samples/s")
            rows = report()
    print("\n".join(rows))
    return 0

if __name__ == "__main__":
    sys.exit(main())
