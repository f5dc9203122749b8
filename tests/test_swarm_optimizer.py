"""SwarmOptimizer's own interface, on a lone peer in each mode: what a checkpoint holds besides hivemind's state, and
restarting from the anchor (after a download or a checkpoint) in DiLoCo mode, a no-op in gradient-averaging mode. And
a newcomer whose view of the swarm's epoch predates its download: it does not download the same state again; a DiLoCo
peer one epoch label behind ends its epoch instead of downloading; a peer that takes its group's epoch label joins
that epoch's parameter round, and one a label behind its group skips the parameter round its group held; a leaving
peer gives up a parameter round that has found no group; a groupmate that starts its all-reduce late is still
averaged in; a peer that leaves with rounds it will not finish logs no traceback; a gradient round is pre-scheduled
and declared for the matchmaking window; a DiLoCo epoch end whose last round is still running trains on; a DiLoCo
peer waits for a trainer that started with it before stepping alone, and two gradient-mode trainers that start
together average their first epoch; an epoch end from a view that shows no other trainer stands only if the swarm's
records agree."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional, Tuple, Union

import pytest

import preloaded
from swarm_utils import listed_entry


def small_peer(dht, run_id: str, **options) -> tuple:
    """A small linear model (seeded) and its SwarmOptimizer: 4 samples a step, target batch 8 unless ``options``
    say otherwise, SGD, offloaded."""
    import functools

    import torch

    from lean_transformer.swarm.averaging.optimizer import SwarmOptimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, SwarmOptimizer(dht=dht, run_id=run_id, batch_size_per_step=4,
                                 params=[dict(params=list(model.parameters()))], offload_optimizer=True,
                                 optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                 **{"target_batch_size": 8, "matchmaking_time": 0.5, "averaging_timeout": 5.0,
                                    **options})


def run_lone_peers() -> dict:
    import hivemind
    import torch

    from lean_transformer.swarm.averaging.diloco import DiLoCoSettings

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    result = {}
    for mode, diloco in ("gradients", None), ("diloco", DiLoCoSettings(local_steps=2)):
        model, optimizer = small_peer(dht, f"swarm_optimizer_{mode}", diloco=diloco)
        initial = [param.detach().clone() for param in model.parameters()]
        state = optimizer.checkpoint_state()
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)  # this peer's drift
        optimizer.restart_from_anchor()
        restarted = all(torch.equal(param, start) for param, start in zip(model.parameters(), initial))
        loaded = dict(outer=[tensor + 2.0 for tensor in state["outer"]]) if state else {}
        optimizer.load_checkpoint_state(loaded)  # anchor and momentum + 2, outer step count 2
        checkpoint_params = [param.detach().clone() for param in model.parameters()]
        optimizer.cancel_rounds_in_flight()  # no round in flight: nothing to cancel
        expected = optimizer.outer_loop.fingerprint() if optimizer.outer_loop is not None else None
        result[mode] = dict(
            donor_entry_labelled=donor_entry_labelled(dht, f"swarm_optimizer_{mode}_state_averager", expected),
            no_host_grads=optimizer.host_grads is None,
            state_keys=sorted(state),
            state_tensors=len(state.get("outer", [])),
            restarted_to_initial=restarted,
            shift_after_checkpoint=[round(float((param - start).mean()), 4) for param, start in
                                    zip(checkpoint_params, initial)],
            outer_steps=float(optimizer.outer_loop.outer.steps) if optimizer.outer_loop is not None else None,
            no_rounds_in_flight=optimizer.scheduled_grads is None and optimizer.scheduled_state is None)
        optimizer.shutdown()
    dht.shutdown()
    return result


def donor_entry_labelled(dht, prefix: str, fingerprint: Optional[list]) -> Optional[bool]:
    """Whether this DHT's peer is listed as a donor with ``fingerprint`` as its label (None: with no label), within
    10 s; None if it is not listed at all."""
    import time

    from lean_transformer.swarm.hivemind_fixes.state_download import parse_entry

    deadline, entry = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        value = listed_entry(dht, f"{prefix}.all_averagers", dht.peer_id.to_bytes())
        entry = parse_entry(value.value) if value is not None else None
        if entry is not None and entry[1] == (None if fingerprint is None else tuple(fingerprint)):
            return True
        time.sleep(0.05)
    return None if entry is None else False


def swarm_peer(dht, run_id: str, seed: int = 0, **options):
    """A SwarmOptimizer over a small linear model, in gradient-averaging mode."""
    import functools

    import torch

    from lean_transformer.swarm.averaging.optimizer import SwarmOptimizer

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return SwarmOptimizer(dht=dht, run_id=run_id, batch_size_per_step=4,
                          params=[dict(params=list(model.parameters()))], offload_optimizer=True,
                          optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                          **dict(dict(target_batch_size=1000, matchmaking_time=0.5, averaging_timeout=5.0,
                                      load_state_timeout=20), **options))


def move_to(peer, epoch: int) -> None:
    """Sets a peer's epoch and publishes it, as a step to ``epoch`` would."""
    peer.state_averager.local_epoch = epoch
    peer.state_averager.state_sharing_priority = epoch
    peer.tracker.report_local_progress(epoch, samples_accumulated=1)  # hivemind publishes no record without samples


def joined_dhts(count: int = 2) -> list:
    """``count`` DHT nodes on 127.0.0.1, each joined through the first."""
    import hivemind

    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    return [first] + [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                   initial_peers=first.get_visible_maddrs()) for _ in range(count - 1)]


def run_stale_newcomer() -> dict:
    """A donor at epoch 1, a newcomer whose tracker reads that and then not again for a minute; the donor moves to
    epoch 2 and the newcomer downloads. hivemind checks once per epoch that a peer's epoch equals the swarm's, and
    took the stale 1 for the swarm's: the newcomer downloaded the same state again at its first step (seen in a
    DiLoCo swarm: "Joined the swarm at epoch 15", "Peer is out of sync", a second state of epoch 15 0.2 s later)."""
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from lean_transformer.swarm.peers.processes import wait_until

    def published_epochs(peer) -> set:
        entry = peer.dht.get(peer.tracker.training_progress_key, latest=True)
        return {record.value.get("epoch") for record in (entry.value.values() if entry is not None else ())}

    dhts, peers = joined_dhts(), []
    try:
        donor = swarm_peer(dhts[0], "stale_view", tracker_opts=dict(private_key=RSAPrivateKey()))
        peers.append(donor)
        move_to(donor, 1)
        newcomer = swarm_peer(dhts[1], "stale_view", tracker_opts=dict(
            min_refresh_period=0.1, max_refresh_period=0.5, private_key=RSAPrivateKey()))
        peers.append(newcomer)
        tracker = newcomer.tracker
        wait_until(lambda: tracker.fetched_global_progress_this_epoch.is_set() and tracker.global_epoch == 1,
                   30, "the newcomer's tracker reads the donor's epoch 1", interval=0.1)
        tracker.min_refresh_period = tracker.max_refresh_period = tracker.default_refresh_period = 60.0
        wait_until(lambda: tracker.global_progress.next_fetch_time > get_dht_time() + 30,
                   30, "the newcomer's tracker reads the swarm once more, then not for a minute", interval=0.1)
        assert tracker.global_epoch == 1
        move_to(donor, 2)
        wait_until(lambda: 2 in published_epochs(newcomer), 30, "the donor's epoch 2 in the DHT", interval=0.1)
        newcomer.load_state_from_peers()
        result = dict(epoch=newcomer.local_epoch, view=newcomer.tracker.global_epoch,
                      downloads_again=newcomer._should_load_state_from_peers())
    finally:
        for each in (*peers, *dhts):
            each.shutdown()
    return result


def run_behind_at_epoch_end() -> dict:
    """A peer in each mode at epoch 1, its once-per-epoch check still to run, and a donor one, then two labels ahead:
    as when the tracker's first fetch of the epoch came after the swarm had moved on (slow DHT lookups, or an epoch
    end that waited for its last round). Whether each would download (``_should_load_state_from_peers``)."""
    from hivemind.utils.crypto import RSAPrivateKey

    from lean_transformer.swarm.averaging.diloco import DiLoCoSettings
    from lean_transformer.swarm.peers.processes import wait_until

    dhts, peers, result = joined_dhts(3), [], {}  # one each: two averagers of a run cannot share a DHT's P2P
    try:
        donor = swarm_peer(dhts[0], "behind", tracker_opts=dict(private_key=RSAPrivateKey()))
        peers.append(donor)
        modes = {mode: swarm_peer(dht, "behind", diloco=diloco, tracker_opts=dict(
                    min_refresh_period=0.1, max_refresh_period=0.5, private_key=RSAPrivateKey()))
                 for dht, (mode, diloco) in zip(dhts[1:], (("gradients", None), ("diloco", DiLoCoSettings(2))))}
        peers += modes.values()
        for peer in modes.values():
            move_to(peer, 1)
        for ahead in (1, 2):
            move_to(donor, 1 + ahead)
            for mode, peer in modes.items():
                wait_until(lambda: peer.tracker.global_epoch == 1 + ahead, 30, f"the {mode} peer reads the donor's "
                           f"epoch {1 + ahead}", interval=0.1)
                peer._should_check_synchronization_on_update = True  # as hivemind sets it at each epoch
                result[f"{mode}, {ahead} behind"] = peer._should_load_state_from_peers()
    finally:
        for each in (*peers, *dhts):
            each.shutdown()
    return result


def run_label_from_majority() -> dict:
    """A lone peer at epoch 4 after a round that ended its epoch 3, whose groupmates gathered ``labels`` (its own 3
    among them); its view of the swarm's epoch has not caught up with theirs. Its epoch after the next check."""
    import hivemind

    dht, result = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]), {}
    try:
        for name, labels in (("majority", [3, 4, 4, 4]), ("pair", [3, 4])):
            peer = swarm_peer(dht, f"label_{name}")
            try:
                move_to(peer, 4)
                peer._group_epochs = labels
                peer._align_epoch_with_group(3)
                peer._should_load_state_from_peers()
                result[name] = peer.local_epoch
            finally:
                peer.shutdown()
    finally:
        dht.shutdown()
    return result


def run_label_taker() -> dict:
    """Two peers averaging parameters every 2 epochs. A stepped to epoch 4 and began that epoch's parameter round;
    B took the same step under its label 3 (it averaged gradients with A one label lower), so it takes A's label 4
    without a download (``_should_load_state_from_peers``). Before B joined the round A began, A's round found no
    group and the two ended apart (CI: a pair's last round, "could not find a group", parameters 0.02 apart)."""
    import tempfile

    import torch
    from hivemind.utils.crypto import RSAPrivateKey

    from lean_transformer.swarm.monitoring.events import open_events, read_events
    from lean_transformer.swarm.peers.processes import wait_until

    events = Path(tempfile.mkdtemp()) / "events.jsonl"
    open_events(events, "trainer")
    dhts, peers = joined_dhts(), []
    try:
        # each its own key: in one process both would sign with hivemind's process-wide one and share one record
        a, b = (swarm_peer(dht, "label_taker", seed, average_state_every=2, averaging_timeout=15.0,
                           tracker_opts=dict(min_refresh_period=0.1, max_refresh_period=0.5,
                                             private_key=RSAPrivateKey())) for seed, dht in enumerate(dhts))
        peers += [a, b]
        mean = [(pa + pb) / 2 for pa, pb in zip(a.state_averager.main_parameters, b.state_averager.main_parameters)]
        move_to(a, 4)
        move_to(b, 3)
        b._group_epoch = 4  # as _align_epoch_with_group notes after a round whose groupmates gathered a label ahead
        wait_until(lambda: b.tracker.global_epoch == 4 and b.tracker.global_progress.num_peers == 2, 30,
                   "B's tracker reads A's epoch 4", interval=0.1)
        a.state_averager.step(averaging_round=True, delay_averaging=True, averaging_opts=dict(timeout=15.0))
        downloads = b._should_load_state_from_peers()
        for peer in peers:
            peer.state_averager.step(wait_for_delayed_updates=True)  # the rounds' results, applied
        params = [peer.state_averager.main_parameters for peer in peers]
        result = dict(downloads=downloads, epochs=[peer.local_epoch for peer in peers],
                      labels=[[event["epoch"], event["previous"]] for event in read_events(events, "label_taken")],
                      agree=all(torch.allclose(pa, pb, rtol=1e-4, atol=1e-5) for pa, pb in zip(*params)),
                      averaged=all(torch.allclose(pa, m, rtol=1e-4, atol=1e-5) for pa, m in zip(params[0], mean)))
    finally:
        for each in (*peers, *dhts):
            each.shutdown()
    return result


def run_state_epoch_behind(hivemind_round: bool) -> dict:
    """Two gradient-mode peers averaging parameters every 2 epochs: A at epoch 2 (it held that epoch's parameter
    round), B one label behind at 1, as a newcomer whose download predates the swarm's last step. Their epochs end
    together and their gradient round averages both: A steps to 3, B to 2. ``hivemind_round``: B's step begins
    hivemind's parameter round of epoch 2, as before the fix. The round's group, the parameter rounds begun, how long
    B's next optimizer step waits for its earlier ones, both epochs, the label B noted to take from its group, and
    whether both took the same step."""
    import tempfile
    import threading
    import time

    import torch
    from hivemind.utils.crypto import RSAPrivateKey

    from lean_transformer.swarm.averaging.optimizer import SwarmOptimizer
    from lean_transformer.swarm.monitoring.events import open_events, read_events
    from lean_transformer.swarm.peers.processes import wait_until

    if hivemind_round:
        SwarmOptimizer._group_held_state_round = lambda self: False
    events = Path(tempfile.mkdtemp()) / "events.jsonl"
    open_events(events, "trainer")
    dhts, peers = joined_dhts(), []
    try:
        a, b = (swarm_peer(dht, "state_behind", seed, target_batch_size=8, average_state_every=2,
                           matchmaking_time=2.0, averaging_timeout=8.0,
                           tracker_opts=dict(min_refresh_period=0.1, max_refresh_period=0.5,
                                             private_key=RSAPrivateKey())) for seed, dht in enumerate(dhts))
        peers += [a, b]
        move_to(a, 2)
        a.tracker.report_local_progress(2, samples_accumulated=8)  # A's epoch 2 is over; B, behind, sees it so
        move_to(b, 1)
        wait_until(lambda: all(peer.tracker.global_progress.num_peers == 2 and peer.tracker.ready_to_update_epoch
                               for peer in peers), 30, "each tracker reads both records and the epoch over",
                   interval=0.1)
        b._should_check_synchronization_on_update = False  # its once-per-epoch exact check ran, as after a download
        before = [[param.detach().clone() for param in peer.state_averager.main_parameters] for peer in peers]

        def end_epoch(peer) -> None:
            params = [param for group in peer.param_groups for param in group["params"]]
            sum(param.pow(2).sum() for param in params).backward()
            peer.step(batch_size=4)  # the swarm's epoch is over: this step ends it

        threads = [threading.Thread(target=end_epoch, args=(peer,)) for peer in peers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        started = time.monotonic()
        b.state_averager.step(wait_for_delayed_updates=True)
        waited = time.monotonic() - started
        steps = [[param - old for param, old in zip(peer.state_averager.main_parameters, olds)]
                 for peer, olds in zip(peers, before)]
        return dict(group=len(b.last_gradient_round.result()),
                    state_rounds=len([event for event in read_events(events, "round_started")
                                      if event["kind"] == "parameters"]),
                    waited=round(waited, 1), epochs=[peer.local_epoch for peer in peers], label=b._group_epoch,
                    same_step=all(torch.allclose(sa, sb, rtol=1e-4, atol=1e-5) for sa, sb in zip(*steps)))
    finally:
        for each in (*peers, *dhts):
            each.shutdown()


def run_leaver(order: str) -> dict:
    """A peer leaves while its delayed step has this epoch's parameter round, which no one else takes part in.
    ``order``: "held" (the delayed step holds the round, looking for a group), "queued" (the delayed step waits
    behind another job of its thread, and the leave lands before it takes the round: it then begins a new one), or
    "hivemind" (held, and hivemind's shutdown alone, which waits for that round's matchmaking)."""
    import threading
    import time

    from hivemind.utils.crypto import RSAPrivateKey

    from lean_transformer.swarm.peers.processes import wait_until

    dhts, peers = joined_dhts(), []
    try:
        a, b = (swarm_peer(dht, "leaver", seed, average_state_every=2, matchmaking_time=5.0, averaging_timeout=8.0,
                           tracker_opts=dict(min_refresh_period=0.1, max_refresh_period=0.5,
                                             private_key=RSAPrivateKey())) for seed, dht in enumerate(dhts))
        peers += [a, b]
        for peer in peers:
            move_to(peer, 2)
        wait_until(lambda: a.tracker.global_progress.num_peers == 2, 30, "A's tracker sees B", interval=0.1)
        averager, released = a.state_averager, threading.Event()
        if order == "queued":
            averager.step_executor.submit(released.wait, 30)  # the delayed step's one thread is busy
            leave = averager.leave

            def leave_then_release() -> int:
                given_up = leave()
                released.set()
                return given_up
            averager.leave = leave_then_release
        elif order == "hivemind":
            averager.leave = lambda: 0
        a.scheduled_state = control = averager.schedule_step(gather=2, timeout=8.0)
        wait_until(lambda: control.stage.name == "LOOKING_FOR_GROUP", 10, "A's round to look for a group",
                   interval=0.05)
        a._join_group_state_round()  # hands the round to the delayed step
        if order != "queued":
            wait_until(lambda: control.triggered, 10, "the delayed step to take the round", interval=0.05)
        held = control.triggered  # False when queued: the leave lands before the step takes the round
        started = time.monotonic()
        a.shutdown()
        peers.remove(a)
        return dict(held=held, cancelled=control.cancelled(), seconds=time.monotonic() - started)
    finally:
        for each in (*peers, *dhts):
            each.shutdown()


def run_late_member(hivemind_timeouts: bool) -> dict:
    """Two peers whose gradient round was pre-scheduled: the group assembles, A starts its all-reduce at once and
    B one and a half matchmaking windows later (its view of the swarm showed the epoch's end later, or its
    micro-batch was still running). ``hivemind_timeouts``: the averagers as hivemind configures them (a sender that
    has not started within next_chunk_timeout, the window, is banned) instead of :func:`averager_options`'."""
    import time

    import torch
    from hivemind.averaging.control import AveragingStage
    from hivemind.utils.crypto import RSAPrivateKey

    from lean_transformer.swarm.averaging.optimizer import averager_options
    from lean_transformer.swarm.peers.processes import wait_until
    from lean_transformer.swarm.protocol.settings import CollaborationSettings, NetworkSettings

    window, run_id = 2.0, "late_member_hivemind" if hivemind_timeouts else "late_member_ours"
    options = {} if hivemind_timeouts else averager_options(
        NetworkSettings(run_id=run_id), CollaborationSettings(matchmaking_time=window))
    dhts, peers = joined_dhts(), []
    try:
        a, b = (swarm_peer(dht, run_id, seed, matchmaking_time=window, averaging_timeout=20.0,
                           averager_opts=options, tracker_opts=dict(private_key=RSAPrivateKey()))
                for seed, dht in enumerate(dhts))
        peers += [a, b]
        grads = []
        for seed, peer in enumerate(peers):
            generator = torch.Generator().manual_seed(seed)
            for param in peer.grad_averager.parameters:
                param.grad = torch.randn(param.shape, generator=generator)
            peer.grad_averager.accumulate_grads_(batch_size=4)
            grads.append([param.grad.clone() for param in peer.grad_averager.parameters])
        controls = [peer.grad_averager.schedule_step(timeout=20.0) for peer in peers]
        wait_until(lambda: all(control.stage == AveragingStage.AWAITING_TRIGGER for control in controls), 20,
                   "the pair's group to assemble", interval=0.05)
        a.grad_averager.step(control=controls[0], wait=False)
        time.sleep(1.5 * window)
        b.grad_averager.step(control=controls[1], wait=False)
        errors = []
        for control in controls:
            try:
                control.result(timeout=30)
            except Exception as error:  # the late member's round fails when its groupmate banned it
                errors.append(type(error).__name__)
        mean = [(ga + gb) / 2 for ga, gb in zip(*grads)]
        averaged = []
        for peer in peers:
            with peer.grad_averager.get_tensors() as tensors:
                averaged.append(all(torch.allclose(tensor, m, rtol=1e-4, atol=1e-5)
                                    for tensor, m in zip(tensors, mean)))
        return dict(errors=errors, averaged=averaged)
    finally:
        for each in (*peers, *dhts):
            each.shutdown()


def run_leaving_mid_round() -> dict:
    """A peer leaves with rounds it will not finish, as every trainer now does (a round is pre-scheduled right after
    each epoch): one found no group (hivemind serves it with weight 0 at shutdown and logged an ERROR traceback when
    it failed), one whose all-reduce is running when its averager shuts down (hivemind's shutdown raised an
    AttributeError in the averager's thread)."""
    import logging

    from hivemind.averaging.control import AveragingStage
    from hivemind.utils.crypto import RSAPrivateKey

    from lean_transformer.swarm.peers.processes import wait_until

    logging.basicConfig(level=logging.INFO)  # this project's lines, as a peer shows them (hivemind's show anyway)
    dhts, peers = joined_dhts(), []
    try:
        a, b = (swarm_peer(dht, "leaving_mid_round", seed, matchmaking_time=1.0, averaging_timeout=20.0,
                           tracker_opts=dict(private_key=RSAPrivateKey())) for seed, dht in enumerate(dhts))
        peers += [a, b]
        alone = a.grad_averager.schedule_step(timeout=2.0)  # B is not looking for a group
        a._tag_along_with_zero_weight(alone)
        controls = [peer.grad_averager.schedule_step(timeout=20.0) for peer in peers]
        wait_until(lambda: all(control.stage == AveragingStage.AWAITING_TRIGGER for control in controls), 20,
                   "the pair's group to assemble", interval=0.05)
        a.grad_averager.step(control=controls[0], wait=False)  # B never starts its part
        wait_until(lambda: controls[0].stage == AveragingStage.RUNNING_ALLREDUCE, 10, "A's all-reduce to run",
                   interval=0.05)
        a.shutdown()
        peers.remove(a)
        return dict(alone_failed=alone.done() and not alone.cancelled() and alone.exception() is not None)
    finally:
        for each in (*peers, *dhts):
            each.shutdown()


def run_gradient_window() -> dict:
    """A lone gradient-averaging peer (matchmaking time 0.5 s, averaging timeout 10 s) whose swarm is expected to end
    its epoch in 4 s: when may it pre-schedule the round, and for when, after DHT lookups of 0.1 s, then of 2.5 s."""
    import types

    import hivemind
    from hivemind.utils import get_dht_time

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peer = swarm_peer(dht, "swarm_optimizer_window", averaging_timeout=10.0)
    tracker, result = peer.tracker, {}
    try:
        for lookup in 0.1, 2.5:
            peer.dht_lookups.recent.append(lookup)
            began = get_dht_time()  # the epoch's ETA as the tracker would give it, away from its fetches' timing
            peer.tracker = types.SimpleNamespace(performance_ema=tracker.performance_ema,
                                                 estimated_next_update_time=began + 4.0)
            peer._maybe_schedule_gradient_averaging()
            control, peer.tracker = peer.scheduled_grads, tracker
            result[str(lookup)] = None if control is None else dict(
                declared=round(control.scheduled_time - began, 1), deadline=round(control.deadline - began, 1))
    finally:
        peer.shutdown()
        dht.shutdown()
    return result


def run_round_in_flight() -> dict:
    """A lone DiLoCo peer (overlap) whose round sent in the background is still running (no partner: it looks for a
    group until its deadline, 8 s) when its next epoch ends (2 local steps of 4 samples, target 8), each local step
    0.1 s of "compute": its steps meanwhile, and its epoch and outer steps once the round is over."""
    import time

    import hivemind
    import torch

    from lean_transformer.swarm.averaging.diloco import DiLoCoSettings

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    model, peer = small_peer(dht, "swarm_optimizer_in_flight", matchmaking_time=3.0,
                             diloco=DiLoCoSettings(local_steps=2, overlap=True))

    def local_step() -> float:
        model(torch.randn(4, 4)).pow(2).mean().backward()
        time.sleep(0.1)
        started = time.monotonic()
        peer.step(batch_size=4)
        peer.zero_grad()
        return time.monotonic() - started

    try:
        peer.outer_loop.end_round()  # the round sent at the last epoch end
        steps, started = [], time.monotonic()
        while peer.outer_loop.seconds_in_flight() is not None and time.monotonic() < started + 30:
            steps.append(local_step())
        over = []  # the round is over: the epoch ends at the next step
        while peer.local_epoch == 0 and len(over) < 3:
            over.append(local_step())
        return dict(steps_in_flight=len(steps), slowest_step=round(max(steps), 1), epoch=peer.local_epoch,
                    outer_steps=float(peer.outer_loop.outer.steps), steps_after=len(over))
    finally:
        peer.shutdown()
        dht.shutdown()


def run_startup_alone() -> dict:
    """A DiLoCo peer at its first epoch end, right after its first local step (matchmaking time 2 s), sees no other
    trainer: whether it concludes it is alone, and when, with a second trainer whose first progress record appears
    1 s later (a trainer that started with it), with none, and with none as it is told to leave 1 s later."""
    import threading
    import time

    import torch
    from hivemind.optim.progress_tracker import ProgressTracker
    from hivemind.utils.crypto import RSAPrivateKey

    from lean_transformer.swarm.averaging.diloco import DiLoCoSettings
    from lean_transformer.swarm.averaging.optimizer import STARTUP_WINDOWS

    dhts, result = joined_dhts(), {}
    try:
        for case in "partner", "none", "leaving":
            run_id = f"swarm_optimizer_startup_{case}"
            model, peer = small_peer(dhts[0], run_id, matchmaking_time=2.0, diloco=DiLoCoSettings(local_steps=2))
            partner = ProgressTracker(dhts[1], run_id, 8, private_key=RSAPrivateKey(), start=True)
            try:
                if case == "partner":  # its first local step: 4 samples, 1 s from now
                    threading.Timer(1.0, partner.report_local_progress, (0, 4)).start()
                    partner.performance_ema.reset_timer()
                if case == "leaving":  # Ctrl+C: the trainer's watchdog gives up the rounds in flight
                    threading.Timer(1.0, peer.cancel_rounds_in_flight).start()
                model(torch.randn(4, 4)).pow(2).mean().backward()
                peer.step(batch_size=4)  # its first local step (its epoch ends at the next)
                started = time.monotonic()
                alone, seconds = peer._alone(), time.monotonic() - started
                result[case] = dict(alone=alone, seconds=round(seconds, 1),  # and the wait it was allowed
                                    allowed=round(STARTUP_WINDOWS * peer.matchmaking_window(), 1))
            finally:
                partner.shutdown()
                peer.shutdown()
    finally:
        for dht in dhts:
            dht.shutdown()
    return result


def run_startup_pair() -> dict:
    """Two gradient-mode trainers that start together (the same initial weights, their own batches; matchmaking time
    2 s), each filling the target batch in two steps, before either can have seen the other's first progress record.
    Each steps until its first epoch ends: the size of the group it stepped with (None: alone), and whether their
    parameters then agree."""
    import threading
    import time

    import torch
    from hivemind.utils.crypto import RSAPrivateKey

    dhts, peers, models = joined_dhts(), [], []
    try:
        for dht in dhts:
            model, peer = small_peer(dht, "startup_pair", matchmaking_time=2.0, averaging_timeout=10.0,
                                     average_state_every=100,  # parameters agree only if the gradients were averaged
                                     tracker_opts=dict(private_key=RSAPrivateKey()))
            models.append(model)
            peers.append(peer)

        def train(model, peer, seed: int) -> None:
            generator, deadline = torch.Generator().manual_seed(seed), time.monotonic() + 30
            while peer.local_epoch == 0 and time.monotonic() < deadline:
                model(torch.randn(4, 4, generator=generator)).pow(2).mean().backward()
                time.sleep(0.1)  # the micro-batch's compute
                peer.step(batch_size=4)
                peer.zero_grad()

        threads = [threading.Thread(target=train, args=(model, peer, seed))
                   for seed, (model, peer) in enumerate(zip(models, peers))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        rounds = [peer.last_gradient_round for peer in peers]
        return dict(epochs=[peer.local_epoch for peer in peers],
                    groups=[len(control.result()) if control is not None and control.done()
                            and not control.cancelled() and control.exception() is None else None
                            for control in rounds],
                    agree=all(torch.allclose(a, b, rtol=1e-4, atol=1e-5)
                              for a, b in zip(*(model.parameters() for model in models))))
    finally:
        for each in (*peers, *dhts):
            each.shutdown()


def run_lone_view_at_epoch_end() -> dict:
    """A gradient-mode peer (target batch 1000) whose tracker has not read the swarm since it started, and whose view's
    ETA has passed: as hivemind's ETA from a peer's own speed alone ended a newcomer's epoch 0 after 12 of 256 samples
    (benchmarks/internet.py). Its partner's record shows 40 samples at 40 samples/s. At its epoch end: its epoch
    after, and what its view then shows."""
    import dataclasses
    import time

    import torch
    from hivemind.optim.progress_tracker import ProgressTracker
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from lean_transformer.swarm.peers.processes import wait_until

    def trainers_published(dht) -> int:
        entry = dht.get(peer.tracker.training_progress_key, latest=True)
        return sum(record.value.get("samples_per_second", 0) > 0 for record in
                   (entry.value.values() if entry is not None else ()))

    dhts, peers = joined_dhts(), []
    try:
        slow = dict(min_refresh_period=60.0, max_refresh_period=60.0, default_refresh_period=60.0)
        model, peer = small_peer(dhts[0], "lone_view", target_batch_size=1000,
                                 tracker_opts=dict(slow, private_key=RSAPrivateKey()))
        partner = ProgressTracker(dhts[1], "lone_view", 1000, private_key=RSAPrivateKey(), start=True)
        peers += [peer, partner]
        partner.performance_ema.reset_timer()
        model(torch.randn(4, 4)).pow(2).mean().backward()
        peer.step(batch_size=4)  # its first step: 4 of the 1000 samples
        time.sleep(1.0)
        partner.report_local_progress(0, 40)
        wait_until(lambda: trainers_published(dhts[0]) == 2, 30, "both records in the DHT", interval=0.1)
        with peer.tracker.lock_global_progress:  # the view it started with, its ETA passed
            peer.tracker.global_progress = dataclasses.replace(peer.tracker.global_progress, num_peers=1,
                                                               eta_next_epoch=get_dht_time() - 1.0)
        assert peer.tracker.ready_to_update_epoch
        peer._update_global_epoch(None)  # as hivemind's step calls it
        return dict(epoch=peer.local_epoch, peers=peer.tracker.global_progress.num_peers,
                    due=peer.tracker.ready_to_update_epoch)
    finally:
        for each in (*peers, *dhts):
            each.shutdown()


def run_script(*args: str, stderr: bool = False) -> Union[dict, Tuple[dict, str]]:
    done = preloaded.run([sys.executable, __file__, *args], 120, dict(os.environ, **preloaded.PEER_ENV))
    lines = done.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), done.stderr[-3000:]
    return (json.loads(lines[-1]), done.stderr) if stderr else json.loads(lines[-1])


@pytest.mark.swarm
def test_a_newcomer_whose_view_predates_its_download_does_not_download_again():
    result = run_script("stale")
    # the newcomer holds the donor's epoch 2; its view counts its own epoch, so it is in sync, no second download
    assert result == dict(epoch=2, view=2, downloads_again=False), result


@pytest.mark.swarm
def test_a_diloco_peer_one_label_behind_ends_its_epoch_instead_of_downloading():
    result = run_script("behind")
    # hivemind's exact check downloads at one label behind; a DiLoCo peer ends its epoch and lets its round's group
    # decide (before: True, and benchmarks/internet.py's trainers threw away the round they had just averaged). Two
    # labels behind, both download
    assert result == {"gradients, 1 behind": True, "diloco, 1 behind": False,
                      "gradients, 2 behind": True, "diloco, 2 behind": True}, result


@pytest.mark.swarm
def test_a_peer_that_takes_its_groups_epoch_label_joins_that_epochs_parameter_round():
    result = run_script("label")
    # no download, both at epoch 4 (B took label 4, one event), and the round A began averaged both peers' parameters
    assert result == dict(downloads=False, epochs=[4, 4], labels=[[4, 3]], agree=True, averaged=True), result


@pytest.mark.swarm
def test_a_peer_a_label_behind_its_group_skips_the_parameter_round_its_group_held():
    hivemind_round, ours = run_script("state_epoch", "hivemind"), run_script("state_epoch", "ours")
    # both: one gradient round of the pair, the same step for both, A at 3 and B at 2, noting A's label 3 to take
    for result in hivemind_round, ours:
        assert (result["group"], result["epochs"], result["label"], result["same_step"]) == (2, [3, 2], 3, True), result
    # hivemind's step to epoch 2 began a parameter round that no one else takes part in, and B's next optimizer step
    # waited for it to fail; ours begins none and does not wait
    assert hivemind_round["state_rounds"] == 1 and hivemind_round["waited"] >= 2.0, hivemind_round
    assert ours["state_rounds"] == 0 and ours["waited"] < 1.0, ours


@pytest.mark.swarm
def test_a_peer_takes_the_label_most_of_its_group_stepped_from_without_waiting_for_its_view():
    result = run_script("label_majority")
    # 3 of 4 groupmates a label ahead: taken at once (before: only once a fetch showed epoch 5, which never came in
    # time on CI); 1 of 2: it waits for its view of the swarm, as before
    assert result == dict(majority=5, pair=4), result


@pytest.mark.swarm
def test_checkpoint_state_and_restart_from_anchor_in_both_modes():
    result = run_script()
    # gradient averaging: no state of its own, the drifted parameters stay (hivemind's own state is all there is);
    # each peer is listed as a donor, in DiLoCo mode labelled with its outer state's fingerprint, here with no label
    assert result["gradients"] == dict(donor_entry_labelled=True, no_host_grads=True, state_keys=[], state_tensors=0,
                                       restarted_to_initial=False, shift_after_checkpoint=[1.0, 1.0], outer_steps=None,
                                       no_rounds_in_flight=True)
    # DiLoCo: anchor (2 tensors), momentum (2) and the step count; the parameters restart from the anchor, then
    # from the checkpoint's (anchor + 2)
    assert result["diloco"] == dict(donor_entry_labelled=True, no_host_grads=True, state_keys=["outer"],
                                    state_tensors=5, restarted_to_initial=True, shift_after_checkpoint=[2.0, 2.0],
                                    outer_steps=2.0, no_rounds_in_flight=True)


@pytest.mark.swarm
def test_a_leaving_peer_gives_up_its_parameter_round_that_has_no_group_yet(report):
    hivemind, held, queued = run_script("leave", "hivemind"), run_script("leave", "held"), run_script("leave", "queued")
    # hivemind's shutdown waits for the round's matchmaking (5 s) and more; ours gives it up and leaves at once,
    # also when the delayed step takes the round after the leave (and begins another round, also given up)
    assert hivemind["held"] and not hivemind["cancelled"] and hivemind["seconds"] >= 5.0, hivemind
    assert held["held"] and held["cancelled"] and held["seconds"] < 5.0, held
    assert not queued["held"] and queued["cancelled"] and queued["seconds"] < 5.0, queued
    report(f"leaving with a parameter round still looking for a group: hivemind's shutdown took "
           f"{hivemind['seconds']:.1f} s; ours {held['seconds']:.1f} s with the round held by the delayed step, "
           f"{queued['seconds']:.1f} s with the step still to take it")


@pytest.mark.swarm
def test_a_groupmate_that_starts_its_all_reduce_late_is_averaged_in_fully():
    result = run_script("late")
    hivemind, ours = result["hivemind"], result["ours"]
    # with hivemind's timeouts A banned B after one window: neither peer held the pair's mean
    assert not any(hivemind["averaged"]), hivemind
    assert ours == dict(errors=[], averaged=[True, True]), ours


@pytest.mark.swarm
def test_a_peer_that_leaves_with_unfinished_rounds_logs_no_traceback():
    result, log = run_script("leave_mid_round", stderr=True)
    assert result == dict(alone_failed=True), result
    assert "The round this peer served with weight 0 ended without averaging" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.swarm
def test_a_gradient_round_is_declared_for_the_matchmaking_window():
    result = run_script("window")
    # fast lookups: the window is the matchmaking time (0.5 s), 4 s ahead is too early to pre-schedule; lookups of
    # 2.5 s stretch it to 5 s: the round begins matchmaking now and is declared for 5 s, its deadline the averaging
    # timeout after the window's end, less the matchmaking time (hivemind's 10 s from 0.5 s of matchmaking)
    assert result == {"0.1": None, "2.5": dict(declared=5.0, deadline=14.5)}, result


@pytest.mark.swarm
def test_an_epoch_end_with_the_last_round_still_running_trains_on():
    result = run_script("in_flight")
    # the epoch end waits for the round and the peer takes local steps meanwhile (before: its step blocked until the
    # round's deadline, 8 s, and it took 2 steps); then it ends its epoch, alone, with one outer step
    assert result["steps_in_flight"] >= 10 and result["slowest_step"] < 1.0, result
    assert (result["epoch"], result["outer_steps"]) == (1, 1.0) and result["steps_after"] <= 1, result


@pytest.mark.swarm
def test_a_diloco_peer_waits_for_a_partner_that_started_with_it_before_stepping_alone():
    result = run_script("startup")
    # before: alone at once in both cases (the partner's record was not there yet); now the partner's record is seen
    # about 1 s later, and with none the peer steps alone after 2 matchmaking windows (4 s here) from its first step;
    # told to leave 1 s into the wait, it stops waiting then
    partner, none, leaving = result["partner"], result["none"], result["leaving"]
    assert partner["alone"] is False and 0.8 <= partner["seconds"] < partner["allowed"] - 0.5, result
    assert none["alone"] is True and none["allowed"] - 1.0 <= none["seconds"] <= none["allowed"] + 1.5, result
    assert leaving["alone"] is True and 0.8 <= leaving["seconds"] < 2.0, result



@pytest.mark.swarm
def test_two_gradient_mode_trainers_that_start_together_average_their_first_epoch():
    result = run_script("startup_pair")
    # before: each filled the target alone before the other's record came, stepped alone (groups None, None) and the
    # two went on from different parameters; now each waits for the other's record and they average as a pair
    assert result == dict(epochs=[1, 1], groups=[2, 2], agree=True), result



@pytest.mark.swarm
def test_an_epoch_end_from_a_view_without_other_trainers_stands_only_if_the_swarm_agrees():
    result = run_script("lone_view")
    # before: it stepped alone to epoch 1 on its stale view; now it looks the records up, finds its partner, and its
    # view (44 of 1000 samples, ETA ~24 s) shows the epoch not over: it trains on
    assert result == dict(epoch=0, peers=2, due=False), result


if __name__ == "__main__":
    scripts = dict(stale=run_stale_newcomer, behind=run_behind_at_epoch_end, label=run_label_taker,
                   label_majority=run_label_from_majority,
                   state_epoch=lambda: run_state_epoch_behind(sys.argv[2] == "hivemind"),
                   leave=lambda: run_leaver(sys.argv[2]),
                   late=lambda: {case: run_late_member(case == "hivemind") for case in ("hivemind", "ours")},
                   leave_mid_round=run_leaving_mid_round, window=run_gradient_window, in_flight=run_round_in_flight,
                   startup=run_startup_alone, startup_pair=run_startup_pair, lone_view=run_lone_view_at_epoch_end)
    print(json.dumps(scripts[sys.argv[1]]() if sys.argv[1:] else run_lone_peers()), flush=True)
