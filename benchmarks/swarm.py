"""Swarm benchmarks on loopback, CPU only: how training scales with peers, what one averaging round costs with each
gradient compression, and how long a newcomer takes to download the swarm's state.

1. Throughput: 1, 2 and 4 trainer peers (run_trainer.py, one torch thread each) train the tiny LeanGPT; samples/s
   of the whole swarm between epochs 1 and 1+K, counted from the peers' ``epoch`` events. Baseline: 1 peer; scaling
   efficiency = samples/s / (peers x samples/s of 1 peer). On a 2-core machine, 4 peers share 2 cores.
2. Averaging: two averagers (each with its own DHT) all-reduce tensors shaped like a 23M-parameter LeanGPT; the time
   of the all-reduce alone (matchmaking done beforehand) and the payload bytes per parameter each peer sends (every
   serialized tensor part is counted). Baseline: no compression.
3. State download: a newcomer's hivemind.Optimizer (built exactly as the trainer builds it) loads the state of a
   100M-parameter LeanGPT (parameters and 8-bit LAMB statistics) from a peer that holds it.

Usage: python benchmarks/swarm.py [--peers 1 2 4] [--epochs 4] [--skip throughput averaging state]
Prints markdown tables. Takes about 4 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import hivemind
import torch
from hivemind.averaging.control import AveragingStage
from hivemind.compression import CompressionBase, CompressionInfo, serialization
from hivemind.utils.crypto import RSAPrivateKey

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from arguments import CollaborationSettings, NetworkSettings, TaskArguments, TrainingSettings  # noqa: E402
from lean_transformer import LeanGPTConfig, LeanGPTForCausalLM  # noqa: E402
from lean_transformer.swarm.protocol.dht import build_dht, visible_maddrs  # noqa: E402
from lean_transformer.swarm.protocol.metrics import make_validators  # noqa: E402
from lean_transformer.swarm.averaging.optimizer import SwarmOptimizer, make_compression  # noqa: E402
from lean_transformer.swarm.peers.processes import PeerProcess  # noqa: E402
from tasks import get_task  # noqa: E402

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
COMPRESSIONS = ["none", "float16", "scaled_float16", "uniform8bit", "quantile8bit", "blockwise8bit", "size_adaptive"]


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- 1. throughput of 1, 2, 4 peers


def swarm_samples_per_second(num_peers: int, epochs: int, target_batch_size: int, workdir: Path) -> float:
    """Run ``num_peers`` trainers for 1 + ``epochs`` epochs; samples/s of the swarm over the last ``epochs``."""
    bootstrap = hivemind.DHT(start=True, host_maddrs=LOOPBACK)
    argv = ["run_trainer.py", "--run_id", f"bench{num_peers}", "--host_maddrs", *LOOPBACK,
            "--initial_peers", *visible_maddrs(bootstrap), "--target_batch_size", str(target_batch_size),
            "--per_device_batch_size", "8", "--max_sequence_length", "64", "--matchmaking_time", "2",
            "--averaging_timeout", "20", "--average_state_every", "5", "--max_epochs", str(1 + epochs),
            "--backup_every_epochs", "0", "--warmup_steps", "1", "--learning_rate", "0.01"]
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    peers = []
    try:
        for i in range(num_peers):
            name = f"{num_peers}-peers-{i}"
            peers.append(PeerProcess(name, [*argv, "--output_dir", str(workdir / name)], workdir, env, cwd=REPO))
        for peer in peers:
            if peer.wait(300) != 0:
                raise RuntimeError(f"a trainer failed, see {peer.stderr_path}")
    finally:
        for peer in peers:
            peer.kill()
        bootstrap.shutdown()

    samples, times = 0, []
    for peer in peers:
        for event in peer.events("epoch"):
            if event["epoch"] == 1:
                times.append(event["time"])
            elif event["epoch"] > 1:
                samples += event["samples"]
                times.append(event["time"])
    return samples / (max(times) - min(times))


def throughput(peer_counts: list[int], epochs: int) -> list[str]:
    target = 1024
    rates = {}
    with tempfile.TemporaryDirectory() as workdir:
        for num_peers in peer_counts:
            progress(f"throughput: {num_peers} peer(s), {epochs} epochs of {target} samples")
            rates[num_peers] = swarm_samples_per_second(num_peers, epochs, target, Path(workdir))
    baseline = rates[min(rates)] / min(rates)
    rows = ["| peers | swarm samples/s | vs 1 peer | scaling efficiency |", "|---|---|---|---|"]
    for num_peers, rate in rates.items():
        rows.append(f"| {num_peers} | {rate:.1f} | {rate / baseline:.2f}x | {rate / (num_peers * baseline):.0%} |")
    return rows


# ---------------------------------------------------------------- 2. one averaging round per compression


class CountingCompression(CompressionBase):
    """Delegates to ``inner`` and adds the size of every serialized tensor part to a counter in shared memory
    (compression runs inside the averagers' processes)."""

    def __init__(self, inner: CompressionBase, counter):
        self.inner, self.counter = inner, counter

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False):
        serialized = self.inner.compress(tensor, info, allow_inplace)
        with self.counter.get_lock():
            self.counter.value += len(serialized.buffer)
        return serialized

    def extract(self, serialized):
        return self.inner.extract(serialized)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.inner.estimate_compression_ratio(info)


@contextlib.contextmanager
def counting_registry(counter):
    """Count what hivemind serializes through its registry of compressions too: the all-reduce sends the averaged
    parts back that way (the averagers fork inside this context, so they inherit it)."""
    original = dict(serialization._BASE_COMPRESSION_TYPES)
    serialization._BASE_COMPRESSION_TYPES.update(
        {name: CountingCompression(compression, counter) for name, compression in original.items()})
    try:
        yield
    finally:
        serialization._BASE_COMPRESSION_TYPES.update(original)


def one_compression(name: str, gradients: list[torch.Tensor], rounds: int) -> tuple[float, float]:
    """Median all-reduce seconds and payload bytes sent per peer, for two fresh peers averaging ``gradients``."""
    counter = mp.Value("q", 0)
    first = hivemind.DHT(start=True, host_maddrs=LOOPBACK)
    second = hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=visible_maddrs(first))
    averagers = []
    try:
        with counting_registry(counter):
            compression = CountingCompression(make_compression(name), counter)
            averagers = [hivemind.DecentralizedAverager([g.clone() for g in gradients], dht, prefix=f"bench_{name}",
                                                        target_group_size=2, min_group_size=2,
                                                        min_matchmaking_time=1.0, compression=compression, start=True)
                         for dht in (first, second)]
        seconds, sent = [], []
        for _ in range(rounds):
            controls = [averager.step(wait=False, require_trigger=True, timeout=60) for averager in averagers]
            deadline = time.monotonic() + 60
            while any(control.stage != AveragingStage.AWAITING_TRIGGER for control in controls):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"matchmaking with {name} did not finish in 60 s")
                time.sleep(0.01)
            counter.value = 0
            start = time.perf_counter()
            for control in controls:
                control.allow_allreduce()
            for control in controls:
                control.result(timeout=60)
            seconds.append(time.perf_counter() - start)
            sent.append(counter.value / len(averagers))
    finally:
        for averager in averagers:
            averager.shutdown()
        second.shutdown()
        first.shutdown()
    return statistics.median(seconds), statistics.median(sent)


def averaging_rounds(rounds: int) -> list[str]:
    config = LeanGPTConfig(vocab_size=8192, hidden_size=512, num_hidden_layers=6, num_attention_heads=8)
    torch.manual_seed(0)
    gradients = [torch.randn_like(param) * 1e-3 for param in LeanGPTForCausalLM(config).parameters()]
    num_params = sum(tensor.numel() for tensor in gradients)
    results = {}
    for name in COMPRESSIONS:
        progress(f"averaging: {rounds} rounds of {num_params / 1e6:.1f}M parameters with {name}")
        results[name] = one_compression(name, gradients, rounds)
    base_seconds, base_bytes = results["none"]
    rows = [f"Two peers, {num_params / 1e6:.1f}M parameters, median of {rounds} rounds. Bytes: the payload each peer "
            f"sends in a round (its half of the vector out, the averaged half back).", "",
            "| compression | all-reduce s | vs none | bytes sent / parameter | vs none |", "|---|---|---|---|---|"]
    for name, (seconds, sent) in results.items():
        rows.append(f"| {name} | {seconds:.3f} | {seconds / base_seconds:.2f}x | {sent / num_params:.3f} | "
                    f"{sent / base_bytes:.2f}x |")
    return rows


# ---------------------------------------------------------------- 3. newcomer loading a 100M-parameter state


def state_download_seconds(task, state_compression: str) -> float:
    """Seconds for a newcomer to load the state of a peer that holds it (checking that it did)."""
    collaboration = CollaborationSettings(target_batch_size=4096, state_compression=state_compression)
    peers = []
    try:
        for role in ("holder", "newcomer"):
            initial = visible_maddrs(peers[0][0]) if peers else []
            network = NetworkSettings(run_id=f"bench_state_{state_compression}", host_maddrs=LOOPBACK,
                                       initial_peers=initial)
            progress(f"state ({state_compression}): building the {role}'s model and optimizer")
            key = RSAPrivateKey()
            dht = build_dht(network, make_validators(network.run_id, key))
            model = task.build_model()
            optimizer = SwarmOptimizer.from_settings(dht, model, task, network, collaboration, task.training_args, key)
            if role == "holder":
                optimizer.state_averager.local_epoch = optimizer.state_averager.state_sharing_priority = 7
            peers.append((dht, optimizer))
        (_, holder), (_, newcomer) = peers
        progress(f"state ({state_compression}): the newcomer downloads the holder's state")
        start = time.perf_counter()
        newcomer.load_state_from_peers()
        seconds = time.perf_counter() - start
        shared = [param for group in holder.opt.param_groups for param in group["params"]]  # what peers download
        received = newcomer.state_averager.main_parameters
        tolerance = 0 if state_compression == "none" else 1e-2
        if newcomer.local_epoch != 7 or not all(torch.allclose(a, b, rtol=0, atol=tolerance)
                                                for a, b in zip(received, shared)):
            raise RuntimeError("the newcomer did not receive the holder's state")
    finally:
        for dht, optimizer in reversed(peers):
            optimizer.shutdown()
            dht.shutdown()
    return seconds


def state_download() -> list[str]:
    with tempfile.TemporaryDirectory() as workdir:
        config_path = Path(workdir) / "gpt_100m.json"
        config_path.write_text(json.dumps(dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)))
        task = get_task("causal_lm")(TaskArguments(model_config_path=str(config_path)), TrainingSettings())
        num_params = sum(param.numel() for param in task.build_model().parameters())
        seconds = {name: state_download_seconds(task, name) for name in ("none", "float16")}
    rows = [f"LeanGPT 1024 x 8 layers, {num_params / 1e6:.1f}M parameters, with 8-bit LAMB statistics; the newcomer "
            f"downloads parameters and optimizer state (hivemind's load_state_from_peers).", "",
            "| --state_compression | download s | vs none | parameters MiB/s |", "|---|---|---|---|"]
    for name, value in seconds.items():
        rows.append(f"| {name} | {value:.1f} | {value / seconds['none']:.2f}x | {num_params * 4 / 2**20 / value:.0f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--epochs", type=int, default=4, help="epochs measured per throughput run")
    parser.add_argument("--rounds", type=int, default=3, help="averaging rounds per compression")
    parser.add_argument("--skip", nargs="*", default=[], choices=["throughput", "averaging", "state"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.monotonic()
    sections = []
    if "throughput" not in args.skip:
        sections.append(("Swarm throughput, tiny LeanGPT, batch 8 x 64 tokens per peer", throughput(args.peers,
                                                                                                      args.epochs)))
    if "averaging" not in args.skip:
        sections.append(("One averaging round per gradient compression", averaging_rounds(args.rounds)))
    if "state" not in args.skip:
        sections.append(("A newcomer loads the swarm's state", state_download()))
    for title, rows in sections:
        print(f"\n### {title}\n")
        print("\n".join(rows))
    print(f"\n(total {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
