"""The internet on one box: a swarm of N trainers and an aux peer, each in its own network namespace behind a home link
(rate and round trip drawn per peer), a quarter of them behind NAT in client mode, peers leaving and joining on a
seeded schedule, and CPU quotas that make some peers up to 10x slower than others; in gradient-averaging mode and in
DiLoCo mode with the slow-link flags.

Network (benchmarks/wan.py's :class:`WanNetwork`: a bridge, a namespace per peer, veth pairs, ``tc tbf``):
- rate: each link is limited in both directions to a rate drawn from [20, 100] Mbit/s (``--rate_mbit``);
- round trip: netem and fq are absent from these kernels, so a delay relay (benchmarks/latency.py) in each full
  peer's namespace listens on the address the peer announces and forwards to the peer on the namespace's loopback,
  holding each chunk for half the peer's drawn round trip ([20, 150] ms, ``--rtt_ms``) each way: every connection
  to a peer takes its round trip (the table shows it measured with a TCP echo through the relay; a relay delays TCP
  only, so there is no ``ping``);
- NAT: a share of the trainers (``--nat_share``) runs with ``--client_mode`` and their namespace drops every new
  inbound connection (nftables); they dial the full peers out;
- CPU: each trainer's training process is in a cgroup (v1 ``cpu``) with a quota drawn log-uniformly from a
  ``--speed_spread`` range (default 10x), scaled so that all trainers' quotas together use ``--trainer_cores`` of the
  machine: the quota, not the fight for 2 cores, sets each peer's speed. Its DHT, p2pd and averagers share the rest
  of the box, as on a volunteer's machine, where the GPU sets the training's speed and the host's cores serve the
  network; ``--quota peer`` puts them under the quota too (the slowest of 16 trainers then has 0.02 cores for
  everything), and ``--training_shares`` below 1024 lets them run before the training processes when both wait for
  a core (the training then gets what is left, up to its quota). A peer sent SIGTERM loses its quota: stopping is
  the host's work;
- churn: ``--leaves`` trainers leave during the window (alternately SIGTERM and SIGKILL, each preferring a peer that
  is inside an averaging round), ``--joins`` new ones join through two live full peers' ``--initial_peers`` lines
  (one of them may leave before the newcomer's DHT has reached it).

Reported (benchmarks/results/internet.json and a plot of peers alive / averaging / downloading over time), from the
peers' event files: the DHT's connectivity (each trainer's progress events name the peers whose records it sees; per
10 s bucket, the connected components of that graph over the trainers that reported and the live ones they see: a
split is any bucket with more than one); per trainer the fraction of its epochs (DiLoCo: outer rounds; not those in
flight when it left) in which it averaged with at least one other peer; group sizes; newcomers' time from start to
their first averaged round; state downloads (why, and their time), DiLoCo catch-ups and groups dissolved to match
again; bytes sent per sample (link counters); compute utilization, with the share of the wall time spent waiting for
the swarm and the share of the compute time the training thread ran (on this shared box the rest went to other
processes); RAM and CPU per peer; crashes (peers not stopped on purpose that exited non-zero, or whose log holds a
traceback).

Usage: sudo python benchmarks/internet.py [--trainers 16] [--seconds 240] [--modes gradients diloco] [--seed 0]
Each mode takes --seconds plus about a minute to start and stop. Needs root, ``ip``, ``tc``, ``nft`` and the cgroup
v1 ``cpu`` controller. Everything it creates (namespaces, links, qdiscs, nftables rules, cgroups, processes, their
sockets and /dev/shm files) is removed on exit, on an error and on Ctrl+C / SIGTERM.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.latency import tcp_round_trip  # noqa: E402
from benchmarks.wan import WanNetwork, progress, raise_on_signals  # noqa: E402
from benchmarks.wan import check_requirements as wan_requirements  # noqa: E402
from lean_transformer.swarm.monitoring.events import epoch_causes  # noqa: E402
from lean_transformer.swarm.peers.processes import PeerProcess, wait_until  # noqa: E402
from lean_transformer.swarm.protocol.settings import CollaborationSettings  # noqa: E402

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
PORT = 31337  # every full peer listens on 127.0.0.1:PORT in its namespace; its relay on PEER_IP:PORT
ECHO_PORT = 31338  # an echo server behind each relay, to measure the round trip
CFS_PERIOD_US = 100_000
DEFAULT_SHARES, STARTUP_SHARES = 1024, 16 * 1024  # cgroup v1 cpu.shares: the default, and a peer's until it joins
MODES = {
    "gradients": [],
    "diloco": ["--local_steps", "10", "--outer_compression", "topk", "--outer_overlap", "true"],
}
MAIN_KIND = {"gradients": "gradients", "diloco": "outer"}


def check_requirements() -> Optional[str]:
    """Why this benchmark cannot run here, or None."""
    if (problem := wan_requirements()) is not None:
        return problem
    if shutil.which("nft") is None:
        return "needs the 'nft' command (nftables)"
    if not (CGROUP_CPU / "cpu.cfs_quota_us").exists():
        return f"needs the cgroup v1 cpu controller at {CGROUP_CPU}"
    return None


class InternetNetwork(WanNetwork):
    """:class:`WanNetwork` plus a CPU cgroup per peer (created by :meth:`limit_cpu`, removed at close)."""

    def __init__(self, num_peers: int, tag: Optional[str] = None):
        super().__init__(num_peers, tag)
        self.cgroup_root = CGROUP_CPU / f"internet_{self.tag}"

    def cgroup(self, peer: int) -> Path:
        return self.cgroup_root / f"peer{peer}"

    def limit_cpu(self, peer: int, cores: Optional[float], spare_pids: Sequence[int] = (),
                  shares: int = DEFAULT_SHARES) -> None:
        """Limit every process started by :meth:`command` for ``peer`` (from now on) to ``cores`` CPU cores, with
        ``shares`` (cgroup v1 ``cpu.shares``) against other cgroups; None: put them in a cgroup of their own without
        a limit yet. ``spare_pids`` move to a second cgroup of the peer's, without a limit (see ``--quota``)."""
        path = self.cgroup(peer)
        path.mkdir(parents=True, exist_ok=True)
        (path / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text("-1" if cores is None else str(max(1000, int(cores * CFS_PERIOD_US))))
        # a peer starting up (importing torch and hivemind, joining) does so on its own machine: here it takes
        # precedence over the running swarm's processes, or a newcomer took minutes to print its first line
        (path / "cpu.shares").write_text(str(STARTUP_SHARES if cores is None else shares))
        if spare_pids:
            spare = self.cgroup_root / f"peer{peer}_spare"
            spare.mkdir(exist_ok=True)
            for pid in spare_pids:
                with contextlib.suppress(ProcessLookupError):  # one that exited meanwhile
                    (spare / "cgroup.procs").write_text(str(pid))

    def lift_cpu_limit(self, peer: int) -> None:
        """Take ``peer``'s quota away (a peer told to stop: see :func:`stop`)."""
        if self.cgroup(peer).exists():
            (self.cgroup(peer) / "cpu.cfs_quota_us").write_text("-1")
            (self.cgroup(peer) / "cpu.shares").write_text(str(DEFAULT_SHARES))

    def command(self, peer: int, argv: Sequence[str]) -> List[str]:
        command = ["ip", "netns", "exec", self.namespaces[peer], *argv]
        if self.cgroup(peer).exists():  # the shell joins the cgroup, then becomes the command: its children stay in
            command = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.cgroup(peer) / "cgroup.procs"), *command]
        return command

    def close(self) -> None:
        super().close()
        if self.cgroup_root.exists():
            for path in self.cgroup_root.iterdir():
                if path.is_dir():
                    wait_until(lambda: not (path / "cgroup.procs").read_text().strip(), 10, f"{path} to empty")
                    path.rmdir()
            self.cgroup_root.rmdir()

    def leftovers(self) -> List[str]:
        return super().leftovers() + ([str(self.cgroup_root)] if self.cgroup_root.exists() else [])


# ---------------------------------------------------------------- the peers


@dataclass
class Slot:
    """One peer's place: its namespace index, drawn link and speed, and what happened to it."""
    index: int
    name: str
    rate_mbit: float
    rtt_ms: float
    cores: float
    nat: bool
    joins_at: float  # seconds after the window's start (0: at the start)
    process: Optional[PeerProcess] = None
    started: Optional[float] = None  # unix time
    stopped: Optional[float] = None
    stop_signal: Optional[str] = None  # "SIGTERM" or "SIGKILL" when stopped on purpose during the window
    exit_in_window: Optional[int] = None  # its exit code, if it exited before the window's end
    limited: Optional[float] = None  # unix time its CPU quota was applied (once it had joined)
    measured_rtt_ms: Optional[float] = None
    usage: Dict[str, float] = field(default_factory=dict)  # peak RSS, CPU seconds
    relay: Optional[subprocess.Popen] = None  # a full peer's delay relay
    # pid -> (kind, (time, CPU seconds, seconds its threads waited for a core) at its first and at its last sample)
    times: Dict[int, Tuple[str, Tuple[float, float, float], Tuple[float, float, float]]] = field(default_factory=dict)


def draw_slots(args: argparse.Namespace, rng: random.Random) -> List[Slot]:
    """The aux peer (slot 0: a server on a 100 Mbit/s, 20 ms link, one fifth of a core) and the trainers: the initial
    ones, then the joiners (at seeded times within the window's middle)."""
    total = args.trainers + args.joins
    factors = [math.exp(rng.uniform(-math.log(args.speed_spread), 0)) for _ in range(total)]
    scale = args.trainer_cores / sum(factors[:args.trainers])
    nat = set(rng.sample(range(total), round(args.nat_share * total)))
    slots = [Slot(0, "aux", 100.0, 20.0, 0.2, False, 0.0)]
    join_times = sorted(rng.uniform(0.2, 0.7) * args.seconds for _ in range(args.joins))
    for i in range(total):
        joiner = i >= args.trainers
        slots.append(Slot(i + 1, f"{'joiner' if joiner else 'trainer'}{i}", round(rng.uniform(*args.rate_mbit), 1),
                          round(rng.uniform(*args.rtt_ms), 1), min(1.0, factors[i] * scale), i in nat,
                          join_times[i - args.trainers] if joiner else 0.0))
    return slots


def peer_argv(slot: Slot, network: InternetNetwork, mode: str, initial_peers: Sequence[str],
              args: argparse.Namespace, workdir: Path) -> List[str]:
    address = ["--client_mode"] if slot.nat else [
        "--host_maddrs", f"/ip4/127.0.0.1/tcp/{PORT}", "--announce_maddrs", f"/ip4/{network.peer_ips[slot.index]}/tcp/{PORT}"]
    common = ["--run_id", f"internet_{network.tag}", *address, "--startup_timeout", "90",
              "--target_batch_size", str(args.target_batch_size), "--per_device_batch_size", "4",
              "--max_sequence_length", "32", "--matchmaking_time", str(args.matchmaking_time),
              "--averaging_timeout", str(args.averaging_timeout), "--warmup_steps", "5", "--learning_rate", "0.005"]
    if initial_peers:
        common += ["--initial_peers", *initial_peers]
    if slot.name == "aux":
        return ["run_aux_peer.py", *common, "--checkpoint_every_epochs", "0", "--wandb_project", "",
                "--metrics_path", str(workdir / "aux_metrics.jsonl"), "--refresh_period", "2", *MODES[mode]]
    return ["run_trainer.py", *common, "--output_dir", str(workdir / slot.name), "--backup_every_epochs", "0",
            "--max_epochs", "100000", "--progress_every", "2", *MODES[mode]]


def start_peer(slot: Slot, network: InternetNetwork, mode: str, initial_peers: Sequence[str],
               args: argparse.Namespace, logdir: Path) -> None:
    network.limit_cpu(slot.index, None)  # its quota comes once it has joined: see apply_quotas
    logdir.mkdir(parents=True, exist_ok=True)
    if not slot.nat:  # its relay (and an echo server behind it, to measure the round trip), outside its cgroup
        ip = network.peer_ips[slot.index]
        relay = subprocess.Popen(["ip", "netns", "exec", network.namespaces[slot.index], sys.executable,
                                  str(REPO / "benchmarks" / "latency.py"), "--rtt_ms", str(slot.rtt_ms),
                                  "--forward", f"{ip}:{PORT}", f"127.0.0.1:{PORT}",
                                  "--forward", f"{ip}:{ECHO_PORT}", f"127.0.0.1:{ECHO_PORT + 1}",
                                  "--echo", f"127.0.0.1:{ECHO_PORT + 1}"],
                                 stdout=subprocess.PIPE, stderr=(logdir / f"{slot.name}.relay.log").open("w"),
                                 text=True, start_new_session=True)
        slot.relay = relay
        if relay.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the delay relay of {slot.name} did not start")
        slot.measured_rtt_ms = 1000 * tcp_round_trip(ip, ECHO_PORT)
    else:
        network.block_inbound(slot.index)
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    argv = peer_argv(slot, network, mode, initial_peers, args, logdir)
    slot.process = PeerProcess(slot.name, argv, logdir, env, cwd=REPO, argv_prefix=network.command(slot.index, []),
                               merge_output=True)
    slot.started = time.time()


def apply_quotas(slots: Sequence[Slot], network: InternetNetwork, quota: str,
                 training_shares: int = DEFAULT_SHARES) -> None:
    """Give each peer that has joined the swarm its CPU quota. Before that it runs unlimited: with a tenth of a core
    from the start, importing torch and hivemind alone takes minutes, which measures this box, not the protocol.
    ``quota`` "training": a trainer's helper processes (its DHT, p2pd and averagers, all started by then) leave the
    quota for a cgroup without one (why: the module docstring), and its training process gets ``training_shares``;
    "peer": the whole peer shares the quota."""
    for slot in slots:
        if slot.process is not None and slot.limited is None and slot.process.events("joined"):
            spare, shares = [], DEFAULT_SHARES
            if quota == "training" and slot.name != "aux":
                with contextlib.suppress(psutil.NoSuchProcess):
                    spare = [child.pid for child in psutil.Process(slot.process.pid).children(recursive=True)]
                shares = training_shares
            network.limit_cpu(slot.index, slot.cores, spare, shares)
            slot.limited = time.time()


def stop(slot: Slot, network: InternetNetwork, signal_name: str) -> None:
    """Send ``slot``'s peer SIGTERM or SIGKILL. A peer told to stop by SIGTERM loses its CPU quota first: the quota
    stands for its accelerator's speed, and what a leaving peer does (its last backup, its goodbye, its
    interpreter's exit) is its host's work. Under a quota of 0.01-0.02 cores, trainers stopped at the window's end
    spent 50 s and more on a 6 MB backup: the shutdown watchdog (25 s) fired up to 30 s late, lost the backup
    and still did not end them within 60 s."""
    if signal_name == "SIGTERM":
        network.lift_cpu_limit(slot.index)
        slot.process.terminate()
    else:
        network.remember_sockets()  # a killed peer's socket files stay behind: removed at close
        slot.process.kill()


def in_round(slot: Slot, kind: str) -> bool:
    """Whether the peer's last round of ``kind`` has started and not yet ended."""
    last = None
    for event in slot.process.events():
        if event.get("kind") == kind and event["event"] in ("round_started", "averaged", "round_missed"):
            last = event["event"]
    return last == "round_started"


PROCESS_KINDS = ("main", "dht", "p2pd", "averagers", "relay")


def process_times(process: psutil.Process) -> Tuple[float, float, float]:
    """Now, the CPU seconds of ``process`` and the seconds its live threads spent runnable but waiting for a core (the
    kernel's per-thread schedstat: ``run_delay``). On a box with more runnable threads than cores the last grows:
    it is the box's share of a peer's latency, not the protocol's."""
    now, cpu = time.time(), sum(process.cpu_times()[:2])
    waited = 0
    for task in Path(f"/proc/{process.pid}/task").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            waited += int((task / "schedstat").read_text().split()[1])
    return now, cpu, waited / 1e9


def process_kind(process: psutil.Process, root: psutil.Process) -> str:
    """What a process of a peer's tree is: its main process, its DHT (the process that started the p2p daemon), the
    daemon, or the rest (its averagers; torch's shared-memory manager)."""
    if process.pid == root.pid:
        return "main"
    if process.name() == "p2pd":
        return "p2pd"
    return "dht" if any(child.name() == "p2pd" for child in process.children()) else "averagers"


def sample_usage(slots: Sequence[Slot]) -> None:
    """Peak RSS (MB) and CPU seconds of each live peer's process tree, and each process's CPU and run-queue seconds
    (:func:`process_times`), its relay's included."""
    for slot in slots:
        if slot.process is None or slot.process.returncode is not None:
            continue
        try:
            root = psutil.Process(slot.process.pid)
            tree = [root, *root.children(recursive=True)]
            rss = sum(p.memory_full_info().pss for p in tree) / 2 ** 20  # PSS: forked children share pages
            cpu = sum(sum(p.cpu_times()[:4]) for p in tree)
            kinds = [(p, process_kind(p, root)) for p in tree]
            if slot.relay is not None and slot.relay.poll() is None:
                kinds.append((psutil.Process(slot.relay.pid), "relay"))
            for process, kind in kinds:
                times = process_times(process)
                first = slot.times.get(process.pid, (kind, times, times))[1]
                slot.times[process.pid] = (kind, first, times)
        except psutil.Error:
            continue
        slot.usage["peak_pss_mb"] = max(slot.usage.get("peak_pss_mb", 0.0), rss)
        slot.usage["cpu_seconds"] = max(slot.usage.get("cpu_seconds", 0.0), cpu)


def usage_by_kind(slot: Slot) -> Dict[str, Dict[str, float]]:
    """Per kind of process (:data:`PROCESS_KINDS`), the cores the peer's processes of that kind used and the seconds
    their threads waited for a core, per second from the peer's first sample in the window to its last."""
    if not slot.times:
        return {}
    seconds = (max(last[0] for _, _, last in slot.times.values())
               - min(first[0] for _, first, _ in slot.times.values()))
    if seconds <= 0:
        return {}
    totals: Dict[str, List[float]] = {}
    for kind, first, last in slot.times.values():
        total = totals.setdefault(kind, [0.0, 0.0])
        total[0] += last[1] - first[1]
        total[1] += last[2] - first[2]
    return {kind: {"cores": cpu / seconds, "waited": waited / seconds} for kind, (cpu, waited) in totals.items()}


def run_mode(mode: str, args: argparse.Namespace, logdir: Path) -> dict:
    """One swarm in ``mode``: start it, run the window with churn, stop it; the figures from the events."""
    shutil.rmtree(logdir, ignore_errors=True)  # the peers append to their event files: none from an earlier run
    rng = random.Random(f"{args.seed}-{mode}")
    slots = draw_slots(args, rng)
    trainers = [slot for slot in slots if slot.name != "aux"]
    with InternetNetwork(len(slots), tag=f"in{os.getpid() % 1000}") as network:
        for slot in slots:
            network.shape_peer(slot.index, slot.rate_mbit)
        aux = slots[0]
        start_peer(aux, network, mode, [], args, logdir)
        aux_peers = aux.process.initial_peers(timeout=120)
        progress(f"  aux up; starting {args.trainers} trainers")
        for slot in trainers[:args.trainers]:
            start_peer(slot, network, mode, aux_peers, args, logdir)

        def joined() -> bool:
            apply_quotas(slots, network, args.quota, args.training_shares)
            return all(slot.limited is not None for slot in trainers[:args.trainers] if slot.process.returncode is None)

        wait_until(joined, 300, "the initial trainers to join", interval=0.5)
        progress("  all initial trainers joined: the window starts")
        sent_before = network.sent_bytes()
        window_start = time.time()
        leaves = sorted(rng.uniform(0.25, 0.8) * args.seconds for _ in range(args.leaves))
        joins = [slot for slot in trainers if slot.joins_at > 0]
        last_usage = 0.0
        while (now := time.time()) < window_start + args.seconds:
            elapsed = now - window_start
            network.pids()  # noted, to remove their shared-memory files at close
            apply_quotas(slots, network, args.quota, args.training_shares)
            if leaves and elapsed >= leaves[0]:
                leaves.pop(0)
                live = [s for s in trainers if s.process is not None and s.stopped is None]
                busy = [s for s in live if in_round(s, MAIN_KIND[mode])]
                victim = rng.choice(busy or live)
                victim.stop_signal = ["SIGTERM", "SIGKILL"][(args.leaves - len(leaves) - 1) % 2]
                stop(victim, network, victim.stop_signal)
                victim.stopped = time.time()
                progress(f"  {elapsed:.0f} s: {victim.stop_signal} to {victim.name} "
                         f"({'inside' if busy else 'outside'} a round)")
            if joins and elapsed >= joins[0].joins_at:
                joiner = joins.pop(0)
                donors = [s for s in slots if s.process is not None and s.stopped is None and not s.nat
                          and s.process.returncode is None and s.process.events("joined")]
                entries = rng.sample(donors, min(2, len(donors)))  # as a user pastes two lines: one may be gone
                start_peer(joiner, network, mode, [address for entry in entries
                                                   for address in entry.process.initial_peers(timeout=5)], args, logdir)
                progress(f"  {elapsed:.0f} s: {joiner.name} joins through {' and '.join(e.name for e in entries)}")
            if now - last_usage > 5:
                last_usage = now
                sample_usage(slots)
            time.sleep(0.5)
        window_stop = time.time()
        for slot in slots:
            if slot.process is not None:
                slot.exit_in_window = slot.process.returncode
        sent = sum(after - before for after, before in zip(network.sent_bytes(), sent_before))
        network.remember_sockets()
        progress("  window over; stopping the peers")
        for slot in slots:
            if slot.process is not None:
                stop(slot, network, "SIGTERM")
        for slot in slots:
            if slot.process is not None:
                try:
                    slot.process.wait(60)
                except TimeoutError:
                    progress(f"  {slot.name} did not stop within 60 s of SIGTERM: killed")
                slot.stopped = slot.stopped or time.time()
    return analyse(mode, slots, window_start, window_stop, sent, args)


# ---------------------------------------------------------------- the figures


def aux_tables(path: Path) -> Dict[int, Dict[str, int]]:
    """The aux peer's table of contributors as it wrote it after each epoch row (its JSONL file): epoch -> {peer ID:
    the epoch of that peer's record then}; empty if there is no file."""
    tables: Dict[int, Dict[str, int]] = {}
    pending: List[int] = []  # the epoch rows written since the last table
    if not path.exists():
        return tables
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "alive_peers" in row:
            pending.append(row["epoch"])
        elif "peers" in row:
            for epoch in pending:
                tables[epoch] = {peer["peer_id"]: peer["epoch"] for peer in row["peers"] if peer.get("peer_id")}
            pending = []
    return tables


def aux_rows(aux_events: Sequence[dict], trainer_events: Dict[str, Sequence[dict]],
             stops: Mapping[str, Tuple[str, float]] = {}, tables: Mapping[int, Mapping[str, int]] = {},
             peer_ids: Mapping[str, Optional[str]] = {}) -> dict:
    """The aux peer's epoch rows against the trainers' own events: the row of epoch E should count every trainer that
    reached E (its ``epoch`` event of E: the record of E carries the work of the epoch it finished). Returns how many
    rows there are, how many count exactly that, and the others as [epoch, counted, reached, missed]: ``missed``
    names the trainers that reached E whose record was still below E in the aux peer's table written with the row
    (``tables``, :func:`aux_tables`; ``peer_ids``: trainer name -> peer ID), each with why: the signal that stopped it
    in that epoch and how soon after reaching it (``stops``: name -> (signal, time); a trainer SIGKILLed as it reaches
    E cannot tell the DHT of it), else when it reached E relative to the row."""
    reached: Dict[int, Dict[str, float]] = {}
    for name, stream in trainer_events.items():
        for event in stream:
            if event["event"] == "epoch":
                reached.setdefault(event["epoch"], {}).setdefault(name, event["time"])
    last_epoch = {name: max(epoch for epoch, names in reached.items() if name in names)
                  for name in trainer_events if any(name in names for names in reached.values())}
    rows = [event for event in aux_events if event["event"] == "swarm_epoch"]
    off = []
    for row in rows:
        epoch, names = row["epoch"], reached.get(row["epoch"], {})
        if row["alive_peers"] == len(names):
            continue
        table, missed = tables.get(epoch), []
        for name in sorted(names, key=names.get) if table is not None else ():  # no table: who is unknown
            if table.get(peer_ids.get(name) or "", -1) >= epoch:
                continue
            if name in stops and last_epoch[name] == epoch:
                why = f"sent {stops[name][0]} {stops[name][1] - names[name]:.1f} s after reaching it"
            else:
                why = f"reached it {names[name] - row['time']:+.1f} s from the row"
            missed.append([name, why])
        off.append([epoch, row["alive_peers"], len(names), missed])
    return {"rows": len(rows), "exact": len(rows) - len(off), "off": off}


def aux_note(rows: Optional[dict]) -> str:
    """:func:`aux_rows` in a few words."""
    if not rows:
        return "no aux rows"
    off = ", ".join(f"epoch {epoch}: {count} of {reached}" + (
        " (" + "; ".join(f"{name} {why}" for name, why in missed) + ")" if missed else "")
        for epoch, count, reached, missed in rows["off"])
    return f"aux rows counting every trainer that reached their epoch: {rows['exact']} of {rows['rows']}" + (
        f" (off: {off})" if off else "")


def dht_buckets(events: Dict[str, Sequence[dict]], peer_ids: Dict[str, Optional[str]], trainers: Sequence[Slot],
                start: float, stop: float) -> List[dict]:
    """The DHT's connectivity per 10 s bucket from ``start`` to ``stop``: how many trainers reported what they see
    (their last progress event in the bucket) and the connected components of "who sees whose record". The graph's
    nodes are the trainers that reported and the trainers alive throughout the bucket whose records they see: two
    trainers that see the record of a third that has not reported yet read one DHT (the window's first bucket,
    before most trackers' first fetch). A record of a peer that had left joins nothing: the halves of a split DHT
    both keep it until it expires."""
    buckets = []
    for bucket_start in range(int(start), int(stop), 10):
        views = {}
        for name, stream in events.items():
            for event in stream:
                # an empty view is a tracker that has not fetched the records yet (not a peer alone in its DHT)
                if event["event"] == "progress" and bucket_start <= event["time"] < bucket_start + 10 \
                        and event.get("visible"):
                    views[peer_ids.get(name) or name] = event["visible"]
        alive = {peer_ids.get(slot.name) for slot in trainers if slot.started is not None
                 and slot.started <= bucket_start and (slot.stopped is None or slot.stopped >= bucket_start + 10)}
        seen = {peer for view in views.values() for peer in view if peer in alive}
        if views:
            buckets.append({"time": bucket_start - start, "reporting": len(views),
                            "components": components(sorted(set(views) | seen), views)})
    return buckets


def components(nodes: Sequence[str], edges: Dict[str, Sequence[str]]) -> int:
    """Connected components of the undirected graph on ``nodes`` (edges to other peers are ignored)."""
    parent = {node: node for node in nodes}

    def find(node: str) -> str:
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for node in nodes:
        for other in edges.get(node, ()):
            if other in parent:
                parent[find(node)] = find(other)
    return len({find(node) for node in nodes})


def rounds_cut_by_leaving(stream: Sequence[dict], kind: str) -> int:
    """A trainer's rounds of ended epochs that were still in flight when it left (the window's end, or churn): the
    ``leaving`` misses of rounds that started before its last epoch began. With ``--outer_overlap`` a DiLoCo round's
    all-reduce runs on into the next epoch, so the round is among the epochs ended but was neither averaged nor
    missed while the peer was alive; a leaving miss of a round started later was the current epoch's, not counted."""
    last_epoch = max((e["time"] for e in stream if e["event"] == "epoch"), default=-math.inf)
    started, cut = -math.inf, 0
    for event in stream:
        if event["event"] == "round_started" and event.get("kind") == kind:
            started = event["time"]
        elif (event["event"] == "round_missed" and event.get("kind") == kind and event.get("reason") == "leaving"
              and started < last_epoch):
            cut += 1
    return cut


def analyse(mode: str, slots: Sequence[Slot], start: float, stop: float, sent: int,
            args: argparse.Namespace) -> dict:
    kind = MAIN_KIND[mode]
    trainers = [slot for slot in slots if slot.name != "aux"]
    events = {slot.name: slot.process.events() for slot in slots if slot.process is not None}
    peer_ids = {slot.name: next((e["peer"] for e in events[slot.name] if e.get("peer")), None) for slot in trainers
                if slot.name in events}

    buckets = dht_buckets(events, peer_ids, trainers, start, stop)
    lookups = sorted(e["dht_lookup_seconds"] for stream in events.values() for e in stream  # in the window
                     if e["event"] == "progress" and start <= e["time"] < stop
                     and e.get("dht_lookup_seconds") is not None)
    per_trainer, group_sizes, downloads, newcomers, crashes, never_joined, rows = [], [], [], [], [], [], []
    reasons: Counter = Counter()  # why trainers downloaded (the state_downloaded event's reason)
    catch_ups = 0  # DiLoCo: missed outer steps replayed from a groupmate's history instead of a download
    ended_by: Counter = Counter()  # why the trainers' epochs ended (None: a label taken or a download, no step)
    catch_up_failures: Counter = Counter()  # DiLoCo: why a peer behind could not replay them
    rematches = 0  # DiLoCo: members of groups dissolved as too small for the swarm (averaging/group_quorum.py)
    for slot in trainers:
        if slot.name not in events:
            continue
        stream = events[slot.name]
        epochs = [e for e in stream if e["event"] == "epoch"]
        ended_by.update(str(e.get("ended_by")) for e in epochs)
        averaged = [e for e in stream if e["event"] == "averaged" and e.get("kind") == kind
                    and (e.get("group_size") or 0) >= 2]
        missed = [e for e in stream if e["event"] == "round_missed" and e.get("kind") == kind
                  and e.get("reason") != "leaving"]  # cancelled as it left: no round it missed while alive
        got = [e for e in stream if e["event"] == "state_downloaded"]
        group_sizes += [e["group_size"] for e in averaged]
        downloads += [e.get("seconds") for e in got]
        reasons.update(e.get("reason") or "unknown" for e in got)
        catch_ups += sum(e["event"] == "outer_caught_up" for e in stream)
        catch_up_failures.update(e.get("kind") or "unknown" for e in stream if e["event"] == "catch_up_failed")
        rematches += sum(e["event"] == "group_rematched" for e in stream)
        transitions = max(0, len(epochs) - 1)
        # an epoch label taken from the group is no round: the step to it was the group's averaged one
        labels = epoch_causes(stream).count("label")
        rounds = (max(transitions - rounds_cut_by_leaving(stream, kind), len(averaged) + len(missed))
                  if kind == "outer" else transitions - labels)
        fraction = min(1.0, len(averaged) / rounds) if rounds else None
        progress_events = [e for e in stream if e["event"] == "progress"]
        last = progress_events[-1] if progress_events and progress_events[-1]["wall_seconds"] > 0 else None
        utilization = last["compute_seconds"] / last["wall_seconds"] if last else None
        waiting = last.get("waiting_seconds", math.nan) / last["wall_seconds"] if last else None
        cpu_share = (last.get("compute_cpu_seconds", math.nan) / last["compute_seconds"]
                     if last and last["compute_seconds"] > 0 else None)
        samples = progress_events[-1]["samples"] if progress_events else 0
        tracebacks = tracebacks_before(slot.process.stdout, stop)
        code = slot.process.returncode
        joined = bool([e for e in stream if e["event"] == "joined"])
        # a crash: it exited by itself during the window, or its log holds a traceback from within the window (the
        # final SIGTERM's exit codes and tracebacks are not crashes: a peer still starting up dies of the signal, and
        # rounds in flight fail as their peers leave)
        crashed = slot.stop_signal is None and (slot.exit_in_window not in (0, None) or tracebacks > 0)
        if crashed:
            crashes.append(f"{slot.name}: exit {code}, {tracebacks} traceback(s)")
        if not joined and not crashed:
            never_joined.append(slot.name)
        if slot.joins_at > 0 and slot.started is not None:
            first = averaged[0]["time"] - slot.started if averaged else None
            newcomers.append({"name": slot.name, "seconds_to_first_average": first,
                              "epochs_before_first_average": (sum(e["time"] < averaged[0]["time"] for e in epochs[1:])
                                                              if averaged else None),
                              "seconds_to_state": got[0].get("seconds") if got else None})  # its join download
        alive = (slot.stopped or stop) - (slot.started or start)
        per_trainer.append({
            "name": slot.name, "nat": slot.nat, "cores": round(slot.cores, 3), "rate_mbit": slot.rate_mbit,
            "rtt_ms": slot.rtt_ms, "measured_rtt_ms": slot.measured_rtt_ms, "joined_at_s": slot.joins_at,
            "stop": slot.stop_signal, "epochs": transitions, "labels_taken": labels, "averaged": len(averaged),
            "missed": len(missed), "averaged_fraction": fraction, "downloads": len(got), "samples": samples,
            "utilization": utilization, "waiting": waiting, "compute_cpu_share": cpu_share,
            "peak_pss_mb": slot.usage.get("peak_pss_mb"),
            "cpu_per_second": slot.usage.get("cpu_seconds", 0.0) / alive if alive > 0 else None,
            "processes": usage_by_kind(slot),
            "exit": code, "joined": joined, "tracebacks": tracebacks})
        rows.append([slot.name, "NAT" if slot.nat else "full", f"{slot.cores:.3f}", f"{slot.rate_mbit:g}",
                     f"{slot.rtt_ms:g}" + ("" if slot.measured_rtt_ms is None else f" ({slot.measured_rtt_ms:.0f})"),
                     slot.stop_signal or ("joined" if slot.joins_at else ""), transitions, len(averaged),
                     "" if fraction is None else f"{fraction:.0%}", len(got), samples,
                     "" if utilization is None else f"{utilization:.0%}",
                     f"{slot.usage.get('peak_pss_mb', 0):.0f}", tracebacks])
    total_samples = sum(t["samples"] for t in per_trainer)
    fractions = [t["averaged_fraction"] for t in per_trainer if t["averaged_fraction"] is not None]
    summary = {
        "mode": mode, "seconds": stop - start, "trainers": args.trainers, "joins": args.joins, "leaves": args.leaves,
        "rate_mbit": args.rate_mbit, "rtt_ms": args.rtt_ms,
        "dht_buckets": buckets, "dht_splits": sum(b["components"] > 1 for b in buckets),
        "max_components": max((b["components"] for b in buckets), default=None),
        # the trainers' DHT lookups (their progress fetches) as their progress events report them
        "dht_lookup_seconds": {"median": statistics.median(lookups), "p90": lookups[int(0.9 * (len(lookups) - 1))],
                               "max": lookups[-1], "count": len(lookups)} if lookups else None,
        "group_sizes": {str(size): group_sizes.count(size) for size in sorted(set(group_sizes))},
        "median_group_size": statistics.median(group_sizes) if group_sizes else None,
        "averaged_fraction_median": statistics.median(fractions) if fractions else None,
        "trainers_at_least_90pct": sum(f >= 0.9 for f in fractions), "trainers_with_rounds": len(fractions),
        "state_downloads": len(downloads), "downloads_by_reason": dict(reasons.most_common()),
        "catch_ups": catch_ups, "catch_up_failures": dict(catch_up_failures.most_common()), "rematches": rematches,
        "epochs_ended_by": dict(ended_by.most_common()),
        "download_seconds_median": statistics.median([d for d in downloads if d is not None] or [math.nan]),
        "newcomers": newcomers, "bytes_per_sample": sent / total_samples if total_samples else None,
        "samples": total_samples,
        **{f"{key}_mean": statistics.mean([t[key] for t in per_trainer if t[key] is not None] or [math.nan])
           for key in ("utilization", "waiting", "compute_cpu_share")},
        "aux_rows": aux_rows(events.get("aux", ()), {slot.name: events[slot.name] for slot in trainers
                                                     if slot.name in events},
                             {slot.name: (slot.stop_signal, slot.stopped) for slot in trainers if slot.stop_signal},
                             aux_tables(Path(args.output_dir) / mode / "aux_metrics.jsonl"), peer_ids),
        # per kind of process, the median trainer's cores and run-queue seconds per second; the aux peer's own
        "processes": {kind: {key: statistics.median(t["processes"][kind][key] for t in per_trainer
                                                    if kind in t["processes"]) for key in ("cores", "waited")}
                      for kind in PROCESS_KINDS if any(kind in t["processes"] for t in per_trainer)},
        "aux_processes": next((usage_by_kind(slot) for slot in slots if slot.name == "aux"), {}),
        "crashes": crashes, "never_joined": never_joined, "per_trainer": per_trainer, "rows": rows, "start": start,
        "timeline": timeline_of(events, slots, start, stop, kind),
    }
    return summary


def tracebacks_before(log: str, moment: float) -> int:
    """Tracebacks in a peer's log whose last timestamped line before them is earlier than ``moment`` (unix time)."""
    count, last = 0, 0.0
    year = time.strftime("%Y", time.localtime(moment))
    for line in log.splitlines():
        if len(line) > 19 and line[:3].isalpha() and line[15] == ".":
            try:
                last = time.mktime(time.strptime(f"{year} {line[:15]}", "%Y %b %d %H:%M:%S"))
            except ValueError:
                pass
        elif line.startswith("Traceback (most recent call last)") and last < moment:
            count += 1
    return count


def timeline_of(events: Dict[str, List[dict]], slots: Sequence[Slot], start: float, stop: float,
                kind: str) -> List[List[float]]:
    """[seconds, peers joined and alive, inside an averaging round, downloading state] every 2 s of the window."""
    alive, rounds, downloading = [], [], []
    for slot in slots:
        if slot.name == "aux" or slot.started is None:
            continue
        joined = [event["time"] for event in events.get(slot.name, []) if event["event"] == "joined"]
        if joined:
            alive.append((joined[0], slot.stopped or stop))
        opened = None
        for event in events.get(slot.name, []):
            if event.get("kind") == kind and event["event"] == "round_started":
                opened = event["time"]
            elif event.get("kind") == kind and event["event"] in ("averaged", "round_missed") and opened:
                rounds.append((opened, event["time"]))
                opened = None
            elif event["event"] == "state_downloaded":
                downloading.append((event["time"] - (event.get("seconds") or 0), event["time"]))
    points = []
    for moment in range(int(start), int(stop) + 1, 2):
        points.append([moment - start] + [sum(a <= moment < b for a, b in spans)
                                          for spans in (alive, rounds, downloading)])
    return points


def span(bounds: Sequence[float]) -> str:
    """A drawn range as the plot's title says it: 20-150, or 100 for one value."""
    low, high = bounds
    return f"{low:g}" if low == high else f"{low:g}-{high:g}"


def plot(results: Sequence[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(results), 1, figsize=(8, 3.2 * len(results)), dpi=80, squeeze=False)
    for axis, result in zip(axes[:, 0], results):
        points = result["timeline"]
        for column, label in ((1, "joined and alive"), (2, "inside an averaging round"), (3, "downloading state")):
            axis.plot([p[0] for p in points], [p[column] for p in points], label=label, linewidth=1.2)
        splits = [b["time"] for b in result["dht_buckets"] if b["components"] > 1]
        if splits:
            axis.scatter(splits, [0] * len(splits), marker="x", color="red", label="DHT split")
        axis.set_title(f"{result['mode']}: {result['trainers']} trainers + aux, churn, NAT, "
                       f"{span(result['rtt_ms'])} ms, {span(result['rate_mbit'])} Mbit/s", fontsize=9)
        axis.set_xlabel("seconds since the trainers started")
        axis.set_ylabel("trainers")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


COLUMNS = ["peer", "link", "CPU cores", "Mbit/s", "RTT ms drawn (measured)", "left/joined", "epochs", "averaged",
           "averaged fraction", "state downloads", "samples", "compute utilization", "peak PSS MB", "tracebacks in window"]


def report(results: Sequence[dict], args: argparse.Namespace, command: str) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    tables = []
    for r in results:
        newcomer = [n["seconds_to_first_average"] for n in r["newcomers"]]
        to_state = [None if n.get("seconds_to_state") is None else round(n["seconds_to_state"], 1)
                    for n in r["newcomers"]]
        tables.append({
            "title": f"{r['mode']}: {r['trainers']} trainers + aux, {r['seconds']:.0f} s window",
            "columns": COLUMNS, "rows": r["rows"],
            "notes": (f"DHT: {r['dht_splits']} split bucket(s) of {len(r['dht_buckets'])} (max components "
                      f"{r['max_components']}); {lookup_note(r.get('dht_lookup_seconds'))}; "
                      f"{processes_note(r.get('processes'), r.get('aux_processes'))}; group sizes "
                      f"{r['group_sizes']} (median {r['median_group_size']}); "
                      f"{r['trainers_at_least_90pct']}/{r['trainers_with_rounds']} trainers averaged in >= 90% of "
                      f"their epochs (median {r['averaged_fraction_median']}); {r['state_downloads']} state "
                      f"downloads {r['downloads_by_reason']} (median {r['download_seconds_median']:.1f} s), "
                      f"{r.get('catch_ups', 0)} outer catch-ups from a groupmate's history "
                      f"({sum(r.get('catch_up_failures', {}).values())} failed), {r.get('rematches', 0)} "
                      f"trainers' groups dissolved to match again as too small for the swarm; "
                      f"newcomers' seconds to their state {to_state} and to their first average {newcomer}; "
                      f"{r['bytes_per_sample'] or 0:,.0f} bytes sent per sample; {aux_note(r.get('aux_rows'))}; "
                      f"mean compute "
                      f"utilization {r['utilization_mean']:.1%} (waiting for the swarm "
                      f"{r.get('waiting_mean', math.nan):.1%}; the rest is the box's: data, logging, and the "
                      f"training thread ran {r.get('compute_cpu_share_mean', math.nan):.0%} of its compute time); "
                      f"crashes: {r['crashes'] or 'none'}; never joined: {r['never_joined'] or 'none'}. RTT measured "
                      f"with a TCP echo through the peer's delay relay (a relay delays TCP only; no ping).")})
    return {"benchmark": "internet", "command": command,
            "machine": f"{os.cpu_count()} CPU cores (x86_64), {psutil.virtual_memory().total / 2 ** 30:.0f} GB RAM, no GPU",
            "date": time.strftime("%Y-%m-%d"), "commit": commit,
            "baseline": "none: absolute figures per mode (targets from issue 23)", "tables": tables,
            "plots": ["internet.png"],
            "raw": {"args": vars(args), "results": [{k: v for k, v in r.items() if k != "rows"} for r in results]}}


def processes_note(trainers: Optional[dict], aux: Optional[dict]) -> str:
    """The ``processes`` figures of :func:`analyse` in a few words."""
    if not trainers:
        return "no process samples"

    def kinds(usage: dict) -> str:
        return ", ".join(f"{kind} {u['cores']:.3f} cores (waited {u['waited']:.2f} s/s)" for kind, u in usage.items())
    return (f"a median trainer's processes: {kinds(trainers)}" + (f"; the aux peer's: {kinds(aux)}" if aux else "")
            + " (waited: seconds its threads were runnable without a core, per second: the box's share)")


def lookup_note(lookups: Optional[dict]) -> str:
    if not lookups:
        return "no DHT lookup times reported"
    return (f"DHT lookups (trainers' progress fetches) took {lookups['median']:.1f} s median, {lookups['p90']:.1f} s "
            f"p90, {lookups['max']:.1f} s max")


# ---------------------------------------------------------------- main


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", type=int, default=16, help="trainers at the start")
    parser.add_argument("--seconds", type=float, default=240, help="the measured window of each mode")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nat_share", type=float, default=0.25, help="share of trainers behind NAT (client mode)")
    parser.add_argument("--leaves", type=int, default=None, help="trainers stopped during the window (default N/4)")
    parser.add_argument("--joins", type=int, default=None, help="trainers joining during the window (default N/4)")
    parser.add_argument("--speed_spread", type=float, default=10.0, help="fastest / slowest trainer's CPU quota")
    parser.add_argument("--rate_mbit", type=float, nargs=2, default=[20.0, 100.0], metavar=("LOW", "HIGH"),
                        help="the range a trainer's link rate is drawn from, in Mbit/s (one rate: LOW = HIGH)")
    parser.add_argument("--rtt_ms", type=float, nargs=2, default=[20.0, 150.0], metavar=("LOW", "HIGH"),
                        help="the range a trainer's round trip is drawn from, in ms")
    parser.add_argument("--trainer_cores", type=float, default=1.4,
                        help="CPU cores the initial trainers' quotas add up to (the rest: aux, relays, this script)")
    parser.add_argument("--quota", choices=["training", "peer"], default="training",
                        help="what a trainer's CPU quota holds: its training process (default; its DHT, p2pd and "
                             "averagers share the rest of the box) or the whole peer")
    parser.add_argument("--training_shares", type=int, default=DEFAULT_SHARES,
                        help="cgroup cpu.shares of a trainer's training process under --quota training, against "
                             f"{DEFAULT_SHARES} for its DHT, p2pd and averagers (and for every other peer's): lower "
                             "gives the network's processes precedence, as on a volunteer's host, whose cores do "
                             "not train")
    parser.add_argument("--target_batch_size", type=int, default=None, help="default 16 x trainers")
    parser.add_argument("--matchmaking_time", type=float, default=CollaborationSettings.matchmaking_time,
                        help="default: the trainer's (%(default)g s)")
    parser.add_argument("--averaging_timeout", type=float, default=60.0)
    parser.add_argument("--output_dir", default="outputs/internet", help="peers' logs and events")
    parser.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "internet.json"))
    args = parser.parse_args(argv)
    if args.trainers < 2:
        parser.error(f"--trainers must be at least 2, got {args.trainers}")
    if not 0 <= args.nat_share < 1:
        parser.error(f"--nat_share must be in [0, 1), got {args.nat_share:g}")
    if not 2 <= args.training_shares <= 262144:  # the kernel's bounds
        parser.error(f"--training_shares must be in [2, 262144], got {args.training_shares}")
    if args.speed_spread < 1:
        parser.error(f"--speed_spread must be >= 1, got {args.speed_spread:g}")
    for flag, (low, high) in (("--rate_mbit", args.rate_mbit), ("--rtt_ms", args.rtt_ms)):
        if not 0 < low <= high:
            parser.error(f"{flag} must be LOW HIGH with 0 < LOW <= HIGH, got {low:g} {high:g}")
    args.leaves = args.trainers // 4 if args.leaves is None else args.leaves
    args.joins = args.trainers // 4 if args.joins is None else args.joins
    if args.leaves >= args.trainers:
        parser.error(f"--leaves must be below --trainers ({args.trainers}), got {args.leaves}")
    args.target_batch_size = args.target_batch_size or 16 * args.trainers
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if (problem := check_requirements()) is not None:
        print(f"internet.py: error: {problem}", file=sys.stderr)
        return 1
    raise_on_signals()
    command = "python benchmarks/internet.py " + " ".join(sys.argv[1:] if argv is None else argv)
    output, path = Path(args.output_dir), Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for mode in args.modes:
            progress(f"{mode}: {args.trainers} trainers + aux, {args.seconds:g} s, {args.leaves} leave, "
                     f"{args.joins} join")
            results.append(run_mode(mode, args, output / mode))
            r = results[-1]
            progress(f"  splits {r['dht_splits']}, groups {r['group_sizes']}, averaged fraction median "
                     f"{r['averaged_fraction_median']}, downloads {r['state_downloads']} {r['downloads_by_reason']}, "
                     f"crashes {len(r['crashes'])}")
            path.write_text(json.dumps(report(results, args, command), indent=1, default=str) + "\n")  # each mode
            plot(results, path.parent / "internet.png")
    except KeyboardInterrupt:
        print("internet.py: interrupted; the network and the peers are removed", file=sys.stderr)
        return 130
    for table in report(results, args, command)["tables"]:
        print(f"\n## {table['title']}\n\n| " + " | ".join(table["columns"]) + " |\n|" + "---|" * len(table["columns"]))
        for row in table["rows"]:
            print("| " + " | ".join(map(str, row)) + " |")
        print("\n" + table["notes"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
