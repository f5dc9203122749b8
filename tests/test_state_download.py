"""No peer dies from the state another peer sends: downloads are validated before they touch the model.

A broken state (``tests/bad_state_peer.py``: truncated as by a closed connection, reshaped, NaN, float64, oversized,
or well formed and wrong, which only the newcomer's loss check catches) served by the first peer a newcomer asks is
rejected in one log line; the newcomer trains on, also when the wrong state's server says it is far ahead. On 71fc88d the
truncated state killed the newcomer with hivemind's uncaught ``IndexError`` (the crash of ``make demo``'s aux peer).
The server side is checked directly: a served state is a copy taken between two optimizer steps.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from aux_utils import start_peer, stop_all

from lean_transformer.demo.local_swarm import command_line
from lean_transformer.swarm.hivemind_fixes.state_download import StateLayout, ValidatedStateSharing, rank_donors

TINY = dict(host_maddrs="/ip4/127.0.0.1/tcp/0", per_device_batch_size=4, max_sequence_length=32,
            target_batch_size=16, matchmaking_time=0.5, averaging_timeout=10, shutdown_timeout=20)
ENV = {"OMP_NUM_THREADS": "1"}
REASONS = {"truncated": "the stream was cut", "reshaped": "tensor 0 is torch.float32", "nan": "holds inf or nan",
           "dtype": "tensor 0 is torch.float64", "oversized": "more than the", "wrong": "loss on a local batch"}
# the wrong state's server also says it is at epoch 50: the newcomer's epochs must outlast its first read of the
# swarm's progress (16 samples took 0.05 s), which without IgnoresRefusedDonors left it out of sync at every step
SETTINGS = {kind: dict(TINY, target_batch_size=320) if kind == "wrong" else TINY for kind in REASONS}


@pytest.mark.swarm
def test_a_broken_state_is_rejected_in_one_line_and_the_newcomer_trains_on(tmp_path: Path, report):
    servers, trainers = {}, {}
    try:
        for kind in REASONS:
            servers[kind] = start_peer(f"bad-{kind}", ["tests/bad_state_peer.py", "--kind", kind, *command_line(
                dict(SETTINGS[kind], run_id=f"bad_{kind}"))], tmp_path, ENV, events=False)  # not a trainer: no events
        for kind, server in servers.items():
            server.wait_for("^serving$", 120, stream="stdout")
            initial_peers = server.wait_for(r"^--initial_peers (.+)$", 1, stream="stdout").group(1).split()
            trainers[kind] = start_peer(f"newcomer-{kind}", ["run_trainer.py", *command_line(dict(
                SETTINGS[kind], run_id=f"bad_{kind}", output_dir=str(tmp_path / kind), max_epochs=2)),
                "--initial_peers", *initial_peers], tmp_path, ENV)
        codes = {kind: trainer.wait(240) for kind, trainer in trainers.items()}
    finally:
        stop_all([*servers.values(), *trainers.values()])
    for kind, trainer in trainers.items():
        log = trainer.stderr
        rejected = [event["reason"] for event in trainer.events("state_rejected")]
        assert codes[kind] == 0, f"{kind}:\n{log[-3000:]}"
        assert rejected and all(REASONS[kind] in reason for reason in rejected), f"{kind}: {rejected}\n{log[-2000:]}"
        assert trainer.events("state_downloaded") == [], kind  # it kept its own state
        training = log.partition("Leaving the swarm")[0]  # (hivemind's DHT may log a pipe race while it shuts down)
        assert "Traceback" not in training, f"{kind}:\n{log[-3000:]}"
        assert [event["epoch"] for event in trainer.events("epoch")][-1] == 2, kind
        report(f"{kind}: rejected ({rejected[0][:70]}), the newcomer trained to epoch 2 and exited 0")


class ServedState:
    """What hivemind's get_current_state returns: the live tensors (no copies)."""

    def get_current_state(self):
        return dict(epoch=self.steps), list(self.params), None


class CountingState(ValidatedStateSharing, ServedState):
    """The server side of ValidatedStateSharing over a plain optimizer whose step adds 1 to every parameter."""

    def __init__(self, params: list[torch.Tensor]):
        self.params, self.lock_optimizer, self.steps = params, threading.Lock(), 0

    def step(self) -> None:
        with self.lock_optimizer:
            for param in self.params:
                param.add_(1.0)
                time.sleep(0.01)  # a long step: a snapshot taken in the middle would see mixed values
            self.steps += 1


def test_a_served_state_is_a_copy_taken_between_two_steps():
    server = CountingState([torch.zeros(1000) for _ in range(20)])
    stepping = threading.Thread(target=lambda: [server.step() for _ in range(10)])
    stepping.start()
    snapshots = []
    while stepping.is_alive():
        snapshots.append(server.get_current_state())
    stepping.join()
    for metadata, tensors, _ in snapshots:
        values = {float(tensor[0]) for tensor in tensors}
        assert values == {float(metadata["epoch"])} and metadata["num_tensors"] == len(tensors)
    metadata, tensors, _ = snapshots[0]
    kept = [tensor.clone() for tensor in tensors]
    server.step()
    assert all(torch.equal(tensor, copy) for tensor, copy in zip(tensors, kept)), "served tensors must be copies"
    assert len(snapshots) > 1


def test_state_layout_names_what_does_not_fit():
    layout = StateLayout(shapes=((2, 3), (4,)), dtypes=(torch.float32, torch.uint8),
                         optimizer_skeleton=(("tensor", 0), ("value", "float")), min_epoch=5)
    good = dict(epoch=5, num_tensors=2, optimizer_metadata=[dict(type="tensor", index=0),
                                                            dict(type="value", value=0.5)])
    tensors = [torch.zeros(2, 3), torch.zeros(4, dtype=torch.uint8)]
    assert layout.problem(good, tensors) is None
    cases = {
        "epoch 4 is not an integer >= 5": (dict(good, epoch=4), tensors),
        "epoch '5' is not an integer": (dict(good, epoch="5"), tensors),
        "the stream was cut: 1 of 2": (good, tensors[:1]),
        "3 tensors, this peer has 2": (dict(good, num_tensors=3), [*tensors, torch.zeros(1)]),
        "tensor 1 is torch.float32 (4,)": (good, [tensors[0], torch.zeros(4)]),
        "tensor 0 (2, 3) holds inf or nan": (good, [torch.full((2, 3), float("inf")), tensors[1]]),
        "another structure": (dict(good, optimizer_metadata=[dict(type="value", value=0.5)]), tensors),
        "holds the value nan": (dict(good, optimizer_metadata=[dict(type="tensor", index=0),
                                                               dict(type="value", value=float("nan"))]), tensors),
        "metadata is a list": ([], tensors),
    }
    for expected, (metadata, received) in cases.items():
        problem = layout.problem(metadata, received)
        assert problem is not None and expected in problem, (expected, problem)
    # from a named donor (DiLoCo's groupmates holding the state the group converged on): any epoch, nothing else
    assert layout.problem(dict(good, epoch=0), tensors, any_epoch=True) is None
    assert "epoch -1 is not an integer >= 0" in layout.problem(dict(good, epoch=-1), tensors, any_epoch=True)
    for expected, (metadata, received) in cases.items():
        if not expected.startswith("epoch 4"):
            assert expected in layout.problem(metadata, received, any_epoch=True), expected


def test_donors_named_by_the_caller_are_tried_first_then_by_priority():
    from hivemind.p2p import PeerID
    from hivemind.utils.timed_storage import ValueWithExpiration

    peers = [PeerID.from_base58(name) for name in (
        "QmaTNn4hy3td4LG4rVFBXS9QWW58g86UKfctMqLvJwHBaF", "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN",
        "QmXuPFimLAF4VFrKN6yY8sCKyA4k2hK9trfZ1Jkf6hWaWe", "QmS4ustL54uo8FzR9455qaxZwuMiUhyvMcX9Ba8nUH4uVv")]
    own, low, high, named = peers
    priorities = {peer.to_bytes(): ValueWithExpiration(priority, 1e12)
                  for peer, priority in ((own, 9), (low, 1), (high, 5), (named, 0))}
    priorities[12345] = ValueWithExpiration(3, 1e12)  # a subkey is any msgpack value
    priorities[named.to_bytes() + b"x"] = "not a priority"
    assert rank_donors(priorities, own) == [high, low, named]
    assert rank_donors(priorities, own, donors=[str(named)]) == [named, high, low]


class Offers(ValidatedStateSharing):
    """load_state_from_peers' loop over candidates alone: the averager process's side answers each request at once
    with the next offer (donor, tensors) whose donor is not skipped; the check refuses every state it sees."""

    def __init__(self, offers: list[tuple[str, list[torch.Tensor]]]):
        self.offers, self.adopted, self.checked = offers, [], []
        self.download_check = lambda: lambda tensors: self.checked.append(tensors) or "its loss is worse"
        self._outer_pipe = self

    def _local_layout(self) -> None:
        return None

    def send(self, message: tuple) -> None:
        _, _, kwargs = message
        offer = next((offer for offer in self.offers if offer[0] not in kwargs["skip"]), None)
        kwargs["future"].set_result(None if offer is None else (dict(epoch=1), offer[1], offer[0], 0.01))

    def _adopt(self, metadata: dict, tensors: list[torch.Tensor]) -> None:
        self.adopted.append(tensors)


def test_a_trusted_donors_state_skips_the_loss_check_and_the_others_are_refused():
    a, b = [torch.zeros(2)], [torch.ones(2)]
    trusting_b = Offers([("a", a), ("b", b)])
    trusting_b.load_state_from_peers(donors=["b"], trusted=["b"])
    assert trusting_b.checked == [a] and trusting_b.adopted == [b]  # a was checked and refused, b adopted unchecked
    assert trusting_b.refused_donors() == {"a"} and (trusting_b.adopted_from, trusting_b.adopted_count) == ("b", 1)

    trusting_none = Offers([("a", a), ("b", b)])
    trusting_none.load_state_from_peers(donors=["a", "b"])
    assert trusting_none.checked == [a, b] and trusting_none.adopted == []  # a named donor is checked all the same
    assert trusting_none.refused_donors() == {"a", "b"} and trusting_none.adopted_from is None


@pytest.mark.parametrize("donors, rounds, trusted", [
    (["a", "b"], 3, ["a"]),  # the donor it joined from, named by its first round since
    (["a", "b"], 4, []),  # two rounds on: its own state has history of its own
    (["b"], 3, []),  # the group holds another donor's state
])
def test_a_diloco_peer_trusts_the_donor_it_downloaded_from_for_one_round(donors, rounds, trusted):
    from types import SimpleNamespace

    from lean_transformer.swarm.averaging.optimizer import SwarmOptimizer

    peer = SimpleNamespace(_downloaded=("a", 2), outer_loop=SimpleNamespace(donors=donors, rounds=rounds))
    assert SwarmOptimizer._trusted_donors(peer) == trusted
    assert SwarmOptimizer._trusted_donors(SimpleNamespace(_downloaded=None, outer_loop=peer.outer_loop)) == []
