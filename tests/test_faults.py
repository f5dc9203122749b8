"""The fault suite: a real swarm on 127.0.0.1 (every peer its own process) keeps training through crashes, bad
gradients, bad metrics records and kills at checkpoint time. Each case reports a line: what was tried, what held.

One swarm (the module fixture, 1-2 minutes) serves the first three cases: an aux peer and three trainers, "steady",
"victim" and "faulty". While they train, a metrics attacker (a DHT node without the metrics validator) tries to store
forged, malformed, oversized and negative records; the victim is SIGKILLed in the middle of an averaging round and
restarted; the faulty trainer's gradients turn NaN or infinite on every third micro-batch. Then trainers writing
backups on a slow disk are SIGKILLed at several moments of a write. (Outsiders of an authorized swarm: see
test_auth_swarm.py for the DHT and test_auth_averaging.py for averaging.)

Fault injection is test-only: run as a script, this file is one of two misbehaving peers (see ``__main__``).
``nonfinite SCRIPT ARGS`` runs SCRIPT (``run_trainer.py``) with a forward hook on the model's input embeddings that
turns every ``NONFINITE_EVERY``-th micro-batch non-finite, alternately in the forward pass (the loss is NaN) and
only in the backward pass (the loss is finite, the gradients are infinite). The trainer itself has no fault knob.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import sys
import time
from dataclasses import dataclass
from itertools import combinations, count
from pathlib import Path
from typing import Dict, List, Sequence

import pytest
import torch

# aux_utils and swarm_utils when run as a script; arguments.py and tasks/ (at the repository root) in any case
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

import preloaded  # noqa: E402
from aux_utils import REPO, PeerProcess, start_peer, stop_all, wait_until  # noqa: E402
from swarm_utils import (EpochReport, assert_shut_down, epoch_reports, group_sizes, kill_during_round,  # noqa: E402
                         transitions)

from lean_transformer.demo.local_swarm import command_line  # noqa: E402

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

PREFIX = "@@ "  # marks the attacker's result lines on stdout
SWARM = dict(target_batch_size=64, per_device_batch_size=4, max_sequence_length=32, matchmaking_time=3,
             averaging_timeout=10, startup_timeout=90, learning_rate=0.02, warmup_steps=2)
NONFINITE_EVERY = 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_gradients_are_finite_finds_one_bad_value(dtype, bad):
    from lean_transformer.swarm.peers.trainer import gradients_are_finite

    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3), torch.nn.Linear(3, 1)).to(dtype)
    assert gradients_are_finite(model)  # no gradient yet
    model[2].requires_grad_(False)  # a parameter without a gradient is skipped
    model(torch.randn(2, 5, dtype=dtype)).sum().backward()
    if bad is not None:
        model[1].weight.grad[2, 3] = bad
    assert gradients_are_finite(model) == (bad is None)


def test_a_kill_waits_until_both_peers_are_past_the_round_they_shared():
    """Recorded in CI (times shifted): the victim averaged the round it shared with steady and began its next one
    while steady still waited for that round's results; killing it then landed in no round of steady's."""
    from swarm_utils import in_one_round, open_round

    def events(*timeline):
        return [dict(event=name, epoch=epoch, time=time, **({} if name == "epoch" else {"kind": "gradients"}))
                for name, epoch, time in timeline]

    victim = events(("round_started", 4, 2.22), ("averaged", 4, 5.69), ("epoch", 5, 5.73),
                    ("round_started", 5, 5.85))
    steady = events(("epoch", 5, 2.22), ("round_started", 5, 2.37))
    mine, theirs = open_round(victim, "gradients"), open_round(steady, "gradients")
    assert (mine.epoch, theirs.epoch) == (5, 5), "both are in an open round of epoch 5 ..."
    assert not in_one_round(mine, theirs), "... but steady's is the one the victim has left"
    steady += events(("averaged", 5, 5.88), ("epoch", 6, 5.90), ("round_started", 6, 6.01))
    assert not in_one_round(mine, open_round(steady, "gradients")), "the victim began before steady's round ended"
    victim += events(("averaged", 5, 9.10), ("epoch", 6, 9.12), ("round_started", 6, 9.30))
    steady += events(("averaged", 6, 9.15), ("epoch", 7, 9.17), ("round_started", 7, 9.25))
    assert in_one_round(open_round(victim, "gradients"), open_round(steady, "gradients"))
    assert open_round(steady[:-1], "gradients") is None


def swarm_args(run_id: str, **overrides) -> List[str]:
    options = dict(run_id=run_id, host_maddrs="/ip4/127.0.0.1/tcp/0", **{**SWARM, **overrides})
    return command_line(options)


def trainer_argv(name: str, root: Path, run_id: str, initial_peers: List[str], *extra: str) -> List[str]:
    joining = ["--initial_peers", *initial_peers] if initial_peers else []
    return ["run_trainer.py", *swarm_args(run_id), *joining, "--output_dir", str(root / name),
            "--backup_every_epochs", "1", "--keep_backups", "1000", "--progress_every", "2", *extra]


def read_jsonl(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def newest_epoch(peer: PeerProcess) -> int:
    return max(epoch_reports(peer), default=0)


# ---------------------------------------------------------------- the swarm under faults


@dataclass
class FaultRun:
    root: Path
    aux: PeerProcess
    steady: PeerProcess
    victim: PeerProcess
    restarted: PeerProcess
    faulty: PeerProcess
    attacker: PeerProcess
    killed_at_epoch: int
    kill_landed_mid_round: bool
    seconds_to_go_on: Dict[str, float]  # survivor -> seconds from the kill to its next epoch
    exit_codes: Dict[str, int]

    @property
    def trainers(self) -> List[PeerProcess]:
        return [self.steady, self.victim, self.restarted, self.faulty]

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> FaultRun:
    root = tmp_path_factory.mktemp("faults")
    run_id = "faults"
    peers: List[PeerProcess] = []
    try:
        aux = start_peer("aux", ["run_aux_peer.py", *swarm_args(run_id), "--refresh_period", "0.5",
                                  "--metrics_path", str(root / "metrics.jsonl"), "--checkpoint_every_epochs", "0",
                                  "--wandb_project", ""], root)
        peers.append(aux)
        initial_peers = aux.initial_peers()
        attacker = start_peer("attacker", [__file__, "attack-metrics", "--run_id", run_id, "--initial_peers",
                                            *initial_peers], root, events=False)
        steady = start_peer("steady", trainer_argv("steady", root, run_id, initial_peers), root)
        victim_argv = trainer_argv("victim", root, run_id, initial_peers, "--identity_path", str(root / "victim.id"))
        victim = start_peer("victim", victim_argv, root)
        faulty = start_peer("faulty", [__file__, "nonfinite", *trainer_argv("faulty", root, run_id, initial_peers)],
                             root)
        peers += [attacker, steady, victim, faulty]

        # once the three trainers have averaged together, kill the victim in the middle of a round and restart it
        steady.wait_for_event("averaged", lambda event: event["kind"] == "gradients" and event["group_size"] in (3, 4),
                              timeout=180)
        killed_at, mid_round = kill_during_round(victim, steady, "gradients", timeout=120,
                                                 min_epoch=max(2, newest_epoch(steady) + 1))
        killed = time.monotonic()
        restarted = start_peer("victim-restarted", victim_argv, root)
        peers.append(restarted)
        seconds_to_go_on = {}
        for survivor in (steady, faulty):
            wait_until(lambda: max(transitions(survivor), default=0) > killed_at,
                       timeout=SWARM["averaging_timeout"] + 30, what=f"{survivor.name} to go on", interval=0.05)
            seconds_to_go_on[survivor.name] = time.monotonic() - killed
        joined = restarted.wait_for_event("joined", timeout=150)["epoch"]
        # an epoch after the one it joined at, not joined + 1: the swarm may step while the newcomer checks the state
        # it downloaded, and the newcomer then downloads again (CI: joined at 6, its next epoch was 8); and steady
        # there too, whose report of that epoch the restarted peer's first loss is checked against (CI: the victim
        # took faulty's epoch 10 while steady was at 9)
        first = restarted.wait_for_event("epoch", lambda event: event["epoch"] > joined, timeout=90)["epoch"]
        steady.wait_for_event("epoch", lambda event: event["epoch"] >= first, timeout=90)
        assert attacker.wait(120) == 0, attacker.stderr[-3000:]

        # none crashed: all still running until told to stop, then a clean exit (hivemind may log the tracebacks of
        # averaging rounds it gave up on; those are handled, not crashes)
        trainers = [steady, restarted, faulty]
        crashed = [peer.name for peer in (aux, *trainers) if peer.process.poll() is not None]
        assert not crashed, f"{crashed} exited before the end"
        exit_codes = dict(zip([trainer.name for trainer in trainers], stop_all(trainers)))
        exit_codes["aux"] = aux.stop()
        yield FaultRun(root, aux, steady, victim, restarted, faulty, attacker, killed_at, mid_round,
                       seconds_to_go_on, exit_codes)
    finally:
        for peer in peers:
            peer.kill()


def test_sigkill_during_averaging_survivors_go_on_and_the_victim_catches_up(faults: FaultRun, report):
    timeout = SWARM["averaging_timeout"]
    assert faults.exit_codes == {"steady": 0, "victim-restarted": 0, "faulty": 0, "aux": 0}
    for peer in (faults.steady, faults.faulty, faults.restarted, faults.aux):
        assert_shut_down(peer)
    assert faults.kill_landed_mid_round, "the kill should land while victim and steady were in the same open round"
    for name, seconds in faults.seconds_to_go_on.items():
        assert seconds < timeout + 10, f"{name} took {seconds:.1f} s to go on after the kill"

    # nothing lost: the survivors' epochs only went forward, the restarted victim joined at the swarm's epoch
    for survivor in (faults.steady, faults.faulty):
        epochs = transitions(survivor)
        assert epochs == sorted(epochs) and epochs[-1] >= faults.killed_at_epoch + 2, (survivor.name, epochs)
    (joined,) = [event["epoch"] for event in faults.restarted.events("joined")]
    assert joined >= faults.killed_at_epoch

    # caught up: its first epoch's loss (computed with the parameters it loaded) is the swarm's, not a fresh model's
    # (the swarm's first epoch, trained from the initial parameters; the victim may have joined after it)
    steady_reports, second_life = epoch_reports(faults.steady), epoch_reports(faults.restarted)
    first_reports = [each for peer in (faults.steady, faults.victim, faults.faulty)
                     for each in epoch_reports(peer).values() if each.epoch == 1]
    assert first_reports, "some peer trained the swarm's first epoch from the initial parameters"
    initial = first_reports[0].mean_loss
    first_epoch = min(second_life)
    restarted_first = second_life[first_epoch].mean_loss
    # steady's report of that epoch, or of its next one: a peer moves straight to the swarm's epoch when it is behind,
    # and reports none of the epochs between (CI: the restarted victim reported epoch 4, steady none: it skipped it)
    steady_epoch = min(epoch for epoch in steady_reports if epoch >= first_epoch)
    steady_then = steady_reports[steady_epoch].mean_loss
    assert initial - steady_then > 0.3, "the swarm should have learned something before the check means anything"
    assert abs(restarted_first - steady_then) < abs(restarted_first - initial), (initial, restarted_first, steady_then)
    report(f"SIGKILL of a trainer in the averaging round of epoch {faults.killed_at_epoch}: survivors went on in "
           f"{', '.join(f'{name} {s:.1f} s' for name, s in faults.seconds_to_go_on.items())} (averaging_timeout "
           f"{timeout} s), none crashed; the restarted peer joined at epoch {joined} with loss {restarted_first:.3f} "
           f"(swarm {steady_then:.3f} at epoch {steady_epoch}, fresh model {initial:.3f}) and trained on")


def test_nonfinite_gradients_are_not_contributed_and_poison_nobody(faults: FaultRun, report):
    from safetensors.torch import load_file

    reports = epoch_reports(faults.faulty)
    skipped = sum(each.skipped for each in reports.values())
    skip_lines = faults.faulty.stderr.count("with non-finite loss or gradients (not counted)")
    assert 2 <= skipped <= skip_lines, (skipped, skip_lines)  # the last, unfinished epoch reports no skips
    batch = SWARM["per_device_batch_size"]
    assert all(each.samples == each.mini_steps * batch for each in reports.values()), "skipped ones counted"
    assert set(group_sizes(faults.faulty)) & {2, 3, 4}, "it should still average"

    checked = 0
    for trainer in ("steady", "victim", "faulty"):
        for backup in sorted((faults.root / trainer / "backups").glob("epoch-*")):
            params = load_file(backup / "model.safetensors")
            assert all(bool(tensor.isfinite().all()) for tensor in params.values()), backup
            checked += 1
    for peer in faults.trainers:
        assert "non-finite at epoch" not in peer.stderr, peer.name  # no trainer had to restore a backup
    rows = [row for row in read_jsonl(faults.metrics_path) if "alive_peers" in row]  # NaN: stored as null
    assert rows and all(row["loss"] is not None for row in rows if row["mini_steps"])
    report(f"non-finite gradients on every {NONFINITE_EVERY}rd micro-batch of one trainer: {skipped} micro-batches "
           f"skipped and not counted, it kept averaging; {checked} backups of 3 trainers all finite, no restore, "
           f"{len(rows)} swarm epochs with a finite loss")


def test_bad_metrics_records_are_rejected_and_aggregates_undisturbed(faults: FaultRun, report):
    results = [json.loads(line[len(PREFIX):]) for line in faults.attacker.stdout.splitlines()
               if line.startswith(PREFIX)]
    stores = {result["case"]: result["stored"] for result in results if "case" in result}
    readback = next(result for result in results if "readback" in result)["readback"]
    assert stores.pop("control: a valid record under its own key") is True, "the attacker could not store at all"
    assert len(stores) >= 8 and not any(stores.values()), stores
    assert readback["subkeys"] >= 2 and not readback["forged_seen"] and readback["all_valid"], readback

    # every row the aux peer logged is made of honest trainers' reports only
    honest: Dict[int, List[EpochReport]] = {}
    for trainer in faults.trainers:
        for epoch, each in epoch_reports(trainer).items():
            honest.setdefault(epoch, []).append(each)
    rows = [row for row in read_jsonl(faults.metrics_path) if "alive_peers" in row]  # not the peers tables
    assert len(rows) >= 4
    for row in rows:
        groups = [group for group in combinations(honest.get(row["epoch"], []), row["alive_peers"])
                  if aggregates_to(group, row)]
        assert groups, f"epoch {row['epoch']}: {row} is not an aggregate of the trainers' own reports"
    report(f"metrics attack: {len(stores)} bad records ({', '.join(stores)}) all rejected, a valid control record "
           f"accepted; readback holds {readback['subkeys']} valid records; all {len(rows)} aggregated rows match the "
           f"honest trainers' reports")


# ---------------------------------------------------------------- kills while a checkpoint is written

# moments of a backup's write (CheckpointDir.save) at which the writer is killed, each recognised on disk; each one
# during a save that follows a complete backup, so that there is something to lose
KILL_MOMENTS = {
    "a new backup's temporary directory was just created": ".tmp-epoch-*",
    "the new backup's files are written and being flushed": ".tmp-epoch-*/training_state.pt",
    "the new backup is published and the oldest one is being rotated out": ".trash-epoch-*",
}


def complete_backups(folder: Path) -> List[int]:
    """The epochs of the complete backups in ``folder``, after checking that each one loads and is finite."""
    from transformers.utils.logging import disable_progress_bar

    from lean_transformer import LeanGPTForCausalLM
    from lean_transformer.swarm.storage.training_state import read_epoch

    disable_progress_bar()
    epochs = []
    for path in sorted(folder.glob("epoch-*")):
        model = LeanGPTForCausalLM.from_pretrained(path)
        assert all(bool(param.isfinite().all()) for param in model.parameters()), path
        assert read_epoch(path) == int(path.name.split("-")[1]), path
        epochs.append(read_epoch(path))
    return epochs


def test_backups_stay_loadable_through_kills_at_several_moments_of_a_write(tmp_path: Path, report):
    """One writer per moment, all at once (to stay within the time budget): a solo trainer on a slow disk backs up
    every epoch; it is SIGKILLed at its moment, its backups are checked, then it restarts from them and trains on."""
    def writer(index: int, *extra: str) -> PeerProcess:
        argv = trainer_argv(f"writer{index}", tmp_path, f"kills{index}", [], "--keep_backups", "2",
                            "--target_batch_size", "16", *extra)
        return start_peer(f"writer{index}-{'restarted' if extra else 'killed'}", ["tests/slow_disk.py", *argv],
                           tmp_path, dict(SLOW_FSYNC_SECONDS="0.3"))  # a backup takes ~2 s: time to hit each moment

    folders = [tmp_path / f"writer{index}" / "backups" for index in range(len(KILL_MOMENTS))]
    killed = [writer(index) for index in range(len(KILL_MOMENTS))]
    restarted: List[PeerProcess] = []
    try:
        waiting = dict(enumerate(KILL_MOMENTS.values()))
        def kill_those_at_their_moment() -> bool:
            for index, pattern in list(waiting.items()):
                if list(folders[index].glob("epoch-*")) and list(folders[index].glob(pattern)):
                    killed[index].kill()
                    del waiting[index]
            return not waiting
        wait_until(kill_those_at_their_moment, timeout=180, what="every writer's moment", interval=0.005)

        reports = []
        for index, (moment, folder) in enumerate(zip(KILL_MOMENTS, folders)):
            epochs = complete_backups(folder)
            assert epochs, f"killed when {moment}: no complete backup left"
            partial = [path.name for path in folder.iterdir() if path.name.startswith(".")]
            restarted.append(writer(index, "--resume_from", str(folder), "--max_epochs", str(epochs[-1] + 1)))
            reports.append((moment, epochs, partial))
        for peer, folder, (moment, epochs, partial) in zip(restarted, folders, reports):
            assert peer.wait(120) == 0, peer.stderr[-3000:]
            loaded = re.search(r"Loaded local checkpoint \S+ \(epoch (\d+)\)", peer.stderr)
            assert loaded and int(loaded.group(1)) == epochs[-1], peer.stderr[-3000:]
            assert not any(path.name.startswith(".") for path in folder.iterdir()), "partial directories remain"
            assert complete_backups(folder)[-1] == epochs[-1] + 1
            report(f"SIGKILL when {moment}: left {len(partial)} partial and {len(epochs)} complete backups "
                   f"{epochs}, all loadable; the restarted writer resumed from epoch {epochs[-1]}, removed the partial "
                   f"ones and trained on")
    finally:
        for peer in killed + restarted:
            peer.kill()


def aggregates_to(reports: Sequence[EpochReport], row: dict) -> bool:
    """Whether ``row`` is the aux peer's aggregate of these reports (trainers log mean losses to 4 decimals)."""
    mini_steps = sum(report.mini_steps for report in reports)
    if mini_steps != row["mini_steps"] or sum(report.samples for report in reports) != row["samples_in_epoch"]:
        return False
    if mini_steps == 0:
        return row["loss"] is None
    return abs(sum(report.mean_loss * report.mini_steps for report in reports) / mini_steps - row["loss"]) < 1e-3


# ---------------------------------------------------------------- the misbehaving peers


def run_with_nonfinite_gradients(argv: List[str]) -> None:
    """Run ``argv`` (a trainer script and its arguments) with every NONFINITE_EVERY-th micro-batch made non-finite."""
    from tasks.base import Task

    calls = count(1)

    def poison(_module, _inputs, output):
        # micro-batches only: a forward without autograd (a downloaded state's score, state_check.py) raised on the
        # hook below, the download failed and the trainer kept a state its group had left (CI)
        if not torch.is_grad_enabled():
            return None
        call = next(calls)
        if call % NONFINITE_EVERY:
            return None
        if (call // NONFINITE_EVERY) % 2:
            return output * float("nan")  # the loss turns NaN
        output.register_hook(lambda grad: grad * float("inf"))  # the loss stays finite, the gradients do not
        return None

    build_model = Task.build_model

    def build_poisoned_model(self):
        model = build_model(self)
        model.get_input_embeddings().register_forward_hook(poison)
        return model

    Task.build_model = build_poisoned_model
    sys.argv = argv
    runpy.run_path(str(REPO / argv[0]), run_name="__main__")


def run_diverged(argv: List[str]) -> None:
    """Run ``argv`` (a trainer script and its arguments) with a model whose loss is NaN from the first batch on."""
    from tasks.base import Task

    build_model = Task.build_model

    def build_diverged_model(self):
        model = build_model(self)
        model.get_input_embeddings().register_forward_hook(lambda _module, _inputs, output: output * float("nan"))
        return model

    Task.build_model = build_diverged_model
    sys.argv = argv
    runpy.run_path(str(REPO / argv[0]), run_name="__main__")


@pytest.mark.swarm
@pytest.mark.parametrize("precision", [[], ["--fp16"], ["--fp16", "--block_grad_scaling"]],
                         ids=["fp32", "fp16", "fp16-block-scaling"])
def test_a_diverged_trainer_stops_with_one_line_on_every_precision(precision, tmp_path: Path, report):
    """Non-finite losses in a row end in a backup restore, or (none yet) a clear exit: with --fp16 too, where loss
    scaling used to hide them from the guard and the peer looped forever."""
    argv = [sys.executable, __file__, "diverge", "run_trainer.py", "--run_id", "diverged", "--host_maddrs",
            "/ip4/127.0.0.1/tcp/0", "--output_dir", str(tmp_path), "--per_device_batch_size", "2",
            "--max_sequence_length", "16", *precision]
    started = time.monotonic()
    run = preloaded.run(argv, 240, {**os.environ, **preloaded.PEER_ENV}, cwd=REPO)
    errors = [line for line in run.stderr.splitlines() if line.startswith("run_trainer.py: error:")]
    assert run.returncode == 1 and len(errors) == 1, run.stderr[-3000:]
    assert "local steps in a row had non-finite loss or gradients" in errors[0] and "no local backup" in errors[0]
    report(f"{' '.join(precision) or 'fp32'}: NaN loss from the start -> exit 1 after "
           f"{time.monotonic() - started:.0f} s: {errors[0][:100]}...")


def attack_metrics(argv: List[str]) -> None:
    """Join the swarm's DHT without the metrics validator, try to store bad records under the run's metrics key and
    print one result line per case, then what the swarm's nodes return for that key."""
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils import get_dht_time

    from lean_transformer.swarm.protocol.metrics import MAX_RECORD_BYTES, LocalMetrics, metrics_key

    parser = argparse.ArgumentParser()
    parser.add_argument("--run_id", required=True)
    parser.add_argument("--initial_peers", nargs="+", required=True)
    args = parser.parse_args(argv)
    validator = RSASignatureValidator()  # signs our own records, so that only the content can be at fault
    dht = hivemind.DHT(initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                       record_validators=[validator])
    key, own = metrics_key(args.run_id), validator.local_public_key

    def records(at_least: int = 0, past_epoch: int = -1) -> dict:
        entry = dht.get(key, latest=True)
        found = {} if entry is None or not isinstance(entry.value, dict) else entry.value
        past = [item for item in found.values() if isinstance(item.value, dict)
                and isinstance(item.value.get("epoch"), int) and item.value["epoch"] > past_epoch]
        return found if len(past) >= at_least else {}

    # past epoch 2, the aux peer has released epoch 0's row (the trainers' first epoch may take a while: trainers that
    # start together wait for each other's records at its end)
    victim_key = next(iter(wait_until(lambda: records(at_least=2, past_epoch=2), timeout=240,
                                      what="two trainers' records past epoch 2")))
    valid = LocalMetrics(epoch=1, samples_per_second=10.0, samples_accumulated=64, loss_sum=50.0,
                         mini_steps=16).model_dump()
    cases = {
        "forged: a valid record under another peer's key": (victim_key, {**valid, "epoch": 10**6}),
        "malformed: not a mapping": (own, "loss 0.0"),
        "malformed: missing fields": (own, {"epoch": 1}),
        "malformed: an extra field": (own, {**valid, "admin": True}),
        "malformed: a string count": (own, {**valid, "mini_steps": "16"}),
        "oversized: 4 KiB": (own, {**valid, "padding": "x" * 4 * MAX_RECORD_BYTES}),
        "negative samples": (own, {**valid, "samples_accumulated": -64}),
        "negative epoch": (own, {**valid, "epoch": -1}),
        "negative loss": (own, {**valid, "loss_sum": -50.0}),
        "non-finite loss": (own, {**valid, "loss_sum": float("nan")}),
        "infinite speed": (own, {**valid, "samples_per_second": float("inf")}),
        "no owner key in the subkey": (b"somebody", valid),
        # epoch 0 is long released by the aux peer, and the record expires in seconds: it cannot disturb anything
        "control: a valid record under its own key": (own, {**valid, "epoch": 0}),
    }
    for case, (subkey, value) in cases.items():
        expiration = get_dht_time() + (5 if case.startswith("control") else 600)
        stored = dht.store(key, value, expiration, subkey=subkey, exclude_self=True)
        print(PREFIX + json.dumps(dict(case=case, stored=bool(stored))), flush=True)

    def valid_record(value) -> bool:
        try:
            LocalMetrics.model_validate(value)
            return True
        except Exception:
            return False

    time.sleep(6)  # the control record expires
    found = records()
    print(PREFIX + json.dumps(dict(readback=dict(
        subkeys=len(found), forged_seen=any(item.value.get("epoch") == 10**6 for item in found.values()
                                            if isinstance(item.value, dict)),
        all_valid=all(valid_record(item.value) for item in found.values())))), flush=True)
    dht.shutdown()


if __name__ == "__main__":
    os.chdir(REPO)
    command, rest = sys.argv[1], sys.argv[2:]
    {"nonfinite": run_with_nonfinite_gradients, "diverge": run_diverged, "attack-metrics": attack_metrics}[command](rest)
