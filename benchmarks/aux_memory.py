"""The aux peer's memory over time: does it stay flat?

An aux peer and two trainers (tiny model, 127.0.0.1) run for ``--seconds``; the aux peer refreshes every 0.2 s
(150 times the default rate, so each minute here stands for 2.5 hours of refreshes at the default 30 s) and
checkpoints every 5 epochs. Every ``--every`` seconds the aux peer's resident memory is sampled: its own process,
and its whole process tree (hivemind's DHT and averager processes, the p2p daemon, wandb's service). The baseline is
the first sample after ``--warmup`` seconds; a flat peer stays at a ratio of about 1.00.

Usage: python benchmarks/aux_memory.py [--seconds 300] [--warmup 60] [--every 30]
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's package, also when run as a script

from lean_transformer.swarm.peers.processes import PeerProcess, descendant_pids  # noqa: E402

SWARM = ["--run_id", "bench-aux-memory", "--host_maddrs", "/ip4/127.0.0.1/tcp/0", "--target_batch_size", "16",
         "--per_device_batch_size", "4", "--max_sequence_length", "32", "--matchmaking_time", "2",
         "--averaging_timeout", "10"]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def rss_mib(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) / 1024 if match else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--warmup", type=float, default=60)
    parser.add_argument("--every", type=float, default=30)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="aux_memory_"))
    env = dict(WANDB_MODE="offline", WANDB_DIR=str(work), WANDB_SILENT="true")
    peers = []
    try:
        aux = PeerProcess("aux", ["run_aux_peer.py", *SWARM, "--refresh_period", "0.2", "--checkpoint_every_epochs",
                                  "5", "--keep_checkpoints", "2", "--history_window", "200", "--metrics_path",
                                  str(work / "m.jsonl"), "--checkpoint_dir", str(work / "ckpt")],
                          work, env, cwd=REPO, merge_output=True)
        peers.append(aux)
        initial_peers = aux.initial_peers(timeout=120)
        for index in (1, 2):
            peers.append(PeerProcess(f"trainer{index}", ["run_trainer.py", *SWARM, "--initial_peers", *initial_peers,
                                                         "--output_dir", str(work / f"trainer{index}"),
                                                         "--backup_every_epochs", "0"],
                                     work, env, cwd=REPO, merge_output=True))
        log(f"aux peer and 2 trainers started (logs in {work}); sampling for {args.seconds:g} s")

        started, samples = time.monotonic(), []
        while time.monotonic() - started < args.seconds:
            if aux.returncode is not None:
                raise RuntimeError(f"the aux peer exited with code {aux.returncode}; see {aux.stderr_path}")
            text = aux.stderr  # the status lines of its refreshes, for people: counted, no number read from them
            rows = len(aux.events("swarm_epoch"))
            own = rss_mib(aux.pid)
            tree = own + sum(rss_mib(pid) for pid in descendant_pids(aux.pid))
            samples.append((time.monotonic() - started, text.count("peers reporting") + text.count("peer reporting"),
                            rows, own, tree))
            log(f"{samples[-1][0]:6.0f} s: {samples[-1][1]} refreshes, {rows} epochs logged, aux {own:.0f} MiB, "
                f"tree {tree:.0f} MiB")
            time.sleep(args.every)
    finally:
        for peer in peers:
            peer.terminate()
        for peer in peers:
            try:
                peer.wait(40)
            except TimeoutError as error:
                log(str(error))

    baseline = next((sample for sample in samples if sample[0] >= args.warmup), samples[-1])
    print(f"\nAux peer memory over time (baseline: the sample at {baseline[0]:.0f} s, after warm-up; "
          f"refresh every 0.2 s)\n")
    print("| time (s) | refreshes | epochs logged | aux process RSS (MiB) | ratio | process tree RSS (MiB) | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for seconds, refreshes, rows, own, tree in samples:
        print(f"| {seconds:.0f} | {refreshes} | {rows} | {own:.0f} | {own / baseline[3]:.2f} | {tree:.0f} | "
              f"{tree / baseline[4]:.2f} |")


if __name__ == "__main__":
    main()
