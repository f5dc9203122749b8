"""A swarm member that serves a broken state to peers that download it (test-only fault injection).

It joins like ``run_trainer.py`` (same arguments, the project's model, LAMB and swarm optimizer), announces its
state with the highest priority, so it is the first peer a newcomer asks, and serves its real state broken in one way
(``--kind``): ``truncated`` (the last tensors missing, as when the connection closes mid-stream), ``reshaped``,
``nan``, ``dtype`` (a float64 tensor), ``oversized`` (an extra 64 MB tensor), ``wrong`` (well formed, every float
tensor x10, at epoch 50 in its state and its progress record: only the newcomer's loss check catches it), or
``honest`` (nothing broken; with other model or optimizer flags it is a misconfigured peer). It prints its ``--initial_peers`` line and then "serving",
and runs until SIGTERM.

Usage: python tests/bad_state_peer.py --kind KIND [run_trainer.py arguments]
"""
import argparse
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: arguments.py, tasks/

import torch

from arguments import CollaborationSettings, NetworkSettings, TaskArguments, TrainingSettings, parse_arguments
from lean_transformer.swarm.protocol.dht import build_dht, initial_peers_line, peer_private_key
from lean_transformer.swarm.averaging import averagers
from lean_transformer.swarm.protocol.metrics import make_validators
from lean_transformer.swarm.averaging.optimizer import SwarmOptimizer
from tasks import get_task

WRONG_EPOCH = 50
KINDS = ("truncated", "reshaped", "nan", "dtype", "oversized", "wrong", "honest")


def break_state(kind: str, metadata: dict, tensors: list) -> tuple[dict, list]:
    if kind == "truncated":
        return metadata, tensors[:-3]  # the count in the metadata still says all of them
    if kind == "reshaped":
        tensors[0] = tensors[0].reshape(-1)
    elif kind == "nan":
        tensors[1] = tensors[1].clone()
        tensors[1].view(-1)[0] = float("nan")
    elif kind == "dtype":
        tensors[0] = tensors[0].double()
    elif kind == "oversized":
        tensors.append(torch.zeros(2**24))
        metadata["num_tensors"] = len(tensors)
    elif kind == "wrong":
        tensors = [tensor * 10 if tensor.is_floating_point() else tensor for tensor in tensors]
    return metadata, tensors


def main() -> None:
    own = argparse.ArgumentParser()
    own.add_argument("--kind", choices=KINDS, required=True)
    options, rest = own.parse_known_args()
    network, collaboration, training, task_args = parse_arguments(
        [NetworkSettings, CollaborationSettings, TrainingSettings, TaskArguments], rest)

    serve = averagers.TrainingStateAverager.get_current_state

    def get_broken_state(self):
        metadata, tensors, infos = serve(self)
        metadata, tensors = break_state(options.kind, metadata, list(tensors))
        return metadata, tensors, None  # hivemind describes the tensors itself

    averagers.TrainingStateAverager.get_current_state = get_broken_state  # before the averager starts

    task = get_task(task_args.task)(task_args, training)
    private_key = peer_private_key(network)
    dht = build_dht(network, make_validators(network.run_id, private_key))
    optimizer = SwarmOptimizer.from_settings(dht, task.build_model(), task, network, collaboration, training,
                                             private_key)
    optimizer.state_averager.state_sharing_priority = 10**6  # newcomers ask this peer first
    if options.kind == "wrong":  # it also says it is far ahead: a newcomer that refused it must not stay out of sync
        optimizer.state_averager.local_epoch = WRONG_EPOCH
        optimizer.tracker.report_local_progress(WRONG_EPOCH, 1)  # hivemind reports a peer with samples only
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(initial_peers_line(dht), flush=True)
    print("serving", flush=True)
    stop.wait(600)
    optimizer.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
