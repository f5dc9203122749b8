"""A trainer-like test peer with known gradients, to check what all-reduce returns.

It joins the swarm like ``run_trainer.py`` (same arguments; the project's model, LAMB and swarm optimizer), but
instead of computing gradients it sets each parameter's gradient to a fixed random tensor drawn from ``--grad_seed``
before every ``step``. After each epoch transition it records the averaging round's weight, its group and the
averaged gradients, and at the end saves everything to ``--out``.

It prints its ``--initial_peers`` line and "ready" once it has joined, and starts stepping when ``--start_file``
appears, so that the test's peers start together. It stops after ``--rounds`` rounds with at least ``--group_size``
peers, at epoch ``--max_epochs`` or when ``--stop_file`` appears (fresh peers race alone through their first
epochs until they see each other, and a peer that falls behind catches up by downloading the state, in which case it
records no round).

Usage: python tests/grad_peer.py --out FILE --grad_seed N --rounds R --group_size G --max_epochs E --start_file F
       [run_trainer.py arguments]
"""
import argparse
import sys
import time
from pathlib import Path
from typing import Dict, Set

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: arguments.py, tasks/

import torch

from arguments import CollaborationSettings, NetworkSettings, TaskArguments, TrainingSettings, parse_arguments
from lean_transformer.swarm.monitoring.events import emit, open_events, set_peer
from lean_transformer.swarm.protocol.dht import build_dht, initial_peers_line, peer_private_key, visible_maddrs
from lean_transformer.swarm.protocol.metrics import make_validators
from lean_transformer.swarm.averaging.optimizer import SwarmOptimizer
from tasks import get_task


def main() -> None:
    own = argparse.ArgumentParser()
    own.add_argument("--out", required=True)
    own.add_argument("--grad_seed", type=int, required=True)
    own.add_argument("--rounds", type=int, required=True)
    own.add_argument("--group_size", type=int, required=True)
    own.add_argument("--max_epochs", type=int, required=True)
    own.add_argument("--start_file", required=True)
    own.add_argument("--deadline", type=float, default=120.0)
    own.add_argument("--stop_file", help="stop early when this file appears (e.g. once the other peers are done)")
    options, rest = own.parse_known_args()
    network, collaboration, training, task_args = parse_arguments(
        [NetworkSettings, CollaborationSettings, TrainingSettings, TaskArguments], rest)

    task = get_task(task_args.task)(task_args, training)
    private_key = peer_private_key(network)
    if training.events_path is not None:
        open_events(training.events_path, "trainer")
    dht = build_dht(network, make_validators(network.run_id, private_key))
    set_peer(str(dht.peer_id))  # before the averagers fork: their events (rounds, refusals) name this peer
    model = task.build_model()
    optimizer = SwarmOptimizer.from_settings(dht, model, task, network, collaboration, training, private_key)
    params = [param for group in optimizer.param_groups for param in group["params"]]
    generator = torch.Generator().manual_seed(options.grad_seed)
    grads = [torch.randn(param.shape, generator=generator) for param in params]
    batch_size = training.per_device_batch_size

    print(initial_peers_line(dht), flush=True)
    emit("joined", epoch=optimizer.local_epoch, client_mode=network.client_mode,
         initial_peers=[] if network.client_mode else visible_maddrs(dht), from_swarm=False)
    print("ready", flush=True)
    deadline = time.monotonic() + options.deadline
    while not Path(options.start_file).exists() and time.monotonic() < deadline:
        time.sleep(0.05)

    rounds = []
    while (sum(len(r["group"]) >= options.group_size for r in rounds) < options.rounds
           and optimizer.local_epoch < options.max_epochs and time.monotonic() < deadline
           and not (options.stop_file and Path(options.stop_file).exists())):
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        epoch = optimizer.local_epoch
        optimizer.step(batch_size=batch_size)
        control = optimizer.last_gradient_round
        if (optimizer.local_epoch != epoch and control is not None and control.done() and not control.cancelled()
                and control.exception() is None):  # a failed round: hivemind went on with the local gradients
            group = control.result()
            with optimizer.grad_averager.get_tensors() as averaged:
                rounds.append(dict(epoch=optimizer.local_epoch, weight=float(control.weight),
                                   group=sorted(peer.to_base58() for peer in group),
                                   averaged=[tensor.clone() for tensor in averaged]))
            print(f"round at epoch {optimizer.local_epoch}: {len(group)} peers", flush=True)
        time.sleep(0.3)  # slower than the trackers' first look at each other (they would race alone otherwise)

    torch.save(dict(peer_id=dht.peer_id.to_base58(), grads=grads, rounds=rounds), options.out)
    optimizer.shutdown()
    dht.shutdown()


def check_rounds(dumps: Dict[str, dict], outsiders: Set[str]) -> int:
    """Check the rounds that grad_peers recorded (``dumps``: their saved files by name): no peer ID of ``outsiders``
    is in any group, and every all-reduce that all of its grad_peer members recorded (the same group and the same
    result; one round may fall on different local epochs of its members) holds exactly the weighted mean of their
    known gradients. Members that are not grad_peers (e.g. an assisting aux peer) contribute no weight. Returns how
    many rounds with two or more grad_peers were checked."""
    by_id = {dump["peer_id"]: dump for dump in dumps.values()}
    checked = 0
    for dump in dumps.values():
        for round_ in dump["rounds"]:
            assert not outsiders & set(round_["group"]), f"an outsider was averaged in: {round_['group']}"
            members = [by_id[peer] for peer in round_["group"] if peer in by_id]
            if members[0] is not dump or len(members) < 2:
                continue  # each round is checked once, from its first grad_peer member's records
            matches = [next((other for other in member["rounds"] if other["group"] == round_["group"] and all(
                torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(other["averaged"], round_["averaged"]))),
                None) for member in members]
            if any(match is None for match in matches):
                continue  # a member did not record it (it gave up on the round or caught up by downloading the state)
            total = sum(match["weight"] for match in matches)
            for index, averaged in enumerate(round_["averaged"]):
                expected = sum(match["weight"] * member["grads"][index] for match, member in zip(matches, members))
                torch.testing.assert_close(averaged, expected / total, rtol=1e-4, atol=1e-5)
            checked += 1
    return checked


if __name__ == "__main__":
    main()
