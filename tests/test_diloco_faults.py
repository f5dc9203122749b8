"""DiLoCo mode (``--local_steps``) under faults, in an authorized swarm: real peers on 127.0.0.1, each its own process.

One swarm serves every case: three trainers holding the authority's tokens ("steady", "victim", "faulty") take 3
local 8-bit LAMB steps per outer round, while a stranger (no token; it knows steady's peer ID and the run's keys)
calls steady's outer all-reduce directly. Once the three have taken an outer step together, the victim is SIGKILLed
in the middle of an outer all-reduce and restarted with the same identity; the faulty trainer's every third
micro-batch turns NaN or infinite (``test_faults.py nonfinite``). Gradient-averaging mode's faults: test_faults.py.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch

from aux_utils import REPO, PeerProcess, start_peer, stop_all, wait_until
from swarm_utils import epochs_after_outer_steps, kill_during_round, transitions
from test_auth_averaging import RUN as GATED_RUN
from test_auth_averaging import RUN_ID, _grad_schema_hash, _result

from lean_transformer.demo.local_swarm import command_line
from lean_transformer.swarm.storage.training_state import TRAINING_STATE_FILE

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

TRAINERS = ("steady", "victim", "faulty")
# the model, task and run of test_auth_averaging (so that its visitor computes the right schema hash)
# outer momentum 0.5, not DiLoCo's 0.9: steady trains alone until the others have started (10 s on the 2-core box, 50
# outer rounds once the feed-forward stopped redrawing its dropout mask), and with 3 local steps per round a lone
# peer's Nesterov steps at 0.9 amplify its own progress ~7x and diverged to non-finite parameters by round ~50
RUN = {**GATED_RUN, "target_batch_size": 12, "local_steps": 3, "matchmaking_time": 2, "learning_rate": 0.01,
       "warmup_steps": 2, "outer_momentum": 0.5}
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass
class DiLoCoFaults:
    root: Path
    peers: Dict[str, PeerProcess]  # the three trainers, "victim-restarted" and "stranger"
    killed_at: int  # the epoch whose outer all-reduce the victim was killed in
    kill_landed_mid_round: bool
    seconds_to_go_on: Dict[str, float]
    stranger_probe: dict
    stranger_codes: dict
    exit_codes: List[int]


def outer_state(root: Path, name: str, epoch: int) -> List[torch.Tensor]:
    """The anchor and momentum a trainer backed up when it reached ``epoch``, then its count of outer steps."""
    state = torch.load(root / name / "backups" / f"epoch-{epoch:06d}" / TRAINING_STATE_FILE, weights_only=True)
    return state["outer"]


def states_after_steps_together(run: "DiLoCoFaults", names: Tuple[str, str], backups: Tuple[str, str]) -> list:
    """(outer steps, state, state) for the outer states (anchor and momentum) that two trainers backed up right after
    outer steps with all three trainers, matched by their count of outer steps, not by epoch label: a trainer that
    stepped alone while the other two downloaded its previous state, then downloaded theirs when the three met,
    keeps an epoch label one higher than theirs for the same state (CI: steady's epoch 56 held faulty's epoch 55,
    both after 55 outer steps)."""
    by_steps = []
    for name, folder in zip(names, backups):
        states = [outer_state(run.root, folder, epoch) for epoch in epochs_after_outer_steps(run.peers[name], 3)]
        by_steps.append({int(state[-1].item()): state[:-1] for state in states})
    return [(steps, by_steps[0][steps], by_steps[1][steps])
            for steps in sorted(by_steps[0].keys() & by_steps[1].keys())]


@pytest.fixture(scope="module")
def diloco_faults(tmp_path_factory) -> DiLoCoFaults:
    from hivemind.p2p import PeerID
    from hivemind.utils.crypto import RSAPrivateKey

    from lean_transformer.swarm.auth import issue_token, load_identity_key, save_public_key, save_token

    root = tmp_path_factory.mktemp("diloco_faults")
    authority = RSAPrivateKey()
    save_public_key(authority, root / "authority.pub")
    for name in TRAINERS:
        key = load_identity_key(root / f"{name}.id", create=True)
        save_token(issue_token(authority, key.get_public_key(), datetime.now(timezone.utc) + timedelta(hours=1), name),
                   root / f"{name}.token")
    load_identity_key(root / "stranger.id", create=True)
    steady_id = PeerID.from_identity((root / "steady.id").read_bytes()).to_base58()
    probe_file, stop_file = root / "probe", root / "stop"

    def trainer_argv(name: str, initial_peers: List[str]) -> List[str]:
        joining = ["--initial_peers", *initial_peers] if initial_peers else []
        return ["run_trainer.py", *command_line(RUN), *joining, "--output_dir", str(root / name),
                "--identity_path", str(root / f"{name}.id"), "--auth_token_path", str(root / f"{name}.token"),
                "--authority_public_key_path", str(root / "authority.pub"), "--backup_every_epochs", "1",
                "--keep_backups", "1000", "--max_epochs", "1000"]

    peers: Dict[str, PeerProcess] = {}
    try:
        peers["steady"] = start_peer("steady", trainer_argv("steady", []), root, ENV)
        maddrs = peers["steady"].initial_peers(timeout=90)
        peers["victim"] = start_peer("victim", trainer_argv("victim", maddrs), root, ENV)
        peers["faulty"] = start_peer("faulty", [str(REPO / "tests" / "test_faults.py"), "nonfinite",
                                                 *trainer_argv("faulty", maddrs)], root, ENV)
        peers["stranger"] = start_peer("stranger", [
            str(REPO / "tests" / "test_auth_averaging.py"), "--identity", str(root / "stranger.id"),
            "--initial_peers", *maddrs, "--member", steady_id, "--schema_hash", _grad_schema_hash().hex(),
            "--service", "outer", "--probe_file", str(probe_file), "--stop_file", str(stop_file)], root, ENV,
            events=False)
        steady, victim, faulty = (peers[name] for name in TRAINERS)

        # an outer step of all three that left a peer on the swarm's anchor: the epoch it moved to, with no state
        # download in between (a peer whose outer state was behind steps with the group, then downloads the swarm's)
        wait_until(lambda: epochs_after_outer_steps(steady, 3), timeout=150, what="an outer step of all three trainers",
                   peers=[steady, victim, faulty])
        probe_file.touch()
        stranger_probe = _result(peers["stranger"], "probe", timeout=60)

        # SIGKILL the victim once it and steady are both in the same epoch's outer all-reduce; restart it
        killed_at, mid_round = kill_during_round(victim, steady, "outer", timeout=120)
        killed = time.monotonic()
        peers["victim-restarted"] = start_peer("victim-restarted", trainer_argv("victim", maddrs), root, ENV)
        seconds_to_go_on = {}
        for survivor in (steady, faulty):
            wait_until(lambda: max(transitions(survivor), default=0) > killed_at,
                       timeout=RUN["matchmaking_time"] + RUN["averaging_timeout"] + 30,
                       what=f"{survivor.name} to go on", interval=0.05)
            seconds_to_go_on[survivor.name] = time.monotonic() - killed
        restarted = peers["victim-restarted"]
        restarted.wait_for_event("joined", timeout=120)
        wait_until(lambda: epochs_after_outer_steps(restarted, 3), timeout=120,
                   what="an outer step of the restarted victim with the two others")

        stop_file.touch()
        stranger_codes = _result(peers["stranger"], "codes", timeout=60)
        assert peers["stranger"].wait(30) == 0, peers["stranger"].stderr[-3000:]
        exit_codes = stop_all([steady, restarted, faulty])
        yield DiLoCoFaults(root, peers, killed_at, mid_round, seconds_to_go_on, stranger_probe, stranger_codes,
                           exit_codes)
    finally:
        for peer in peers.values():
            peer.kill()


def test_trainers_survive_and_exit_cleanly(diloco_faults: DiLoCoFaults):
    assert diloco_faults.exit_codes == [0, 0, 0], [peer.stderr[-3000:] for peer in diloco_faults.peers.values()]


def test_sigkill_during_the_outer_all_reduce(diloco_faults: DiLoCoFaults, report):
    run = diloco_faults
    assert run.kill_landed_mid_round
    # the survivors' round failed or formed without the victim, and they went on to the next epoch
    assert max(run.seconds_to_go_on.values()) < RUN["matchmaking_time"] + RUN["averaging_timeout"] + 30
    restarted = run.peers["victim-restarted"]
    (joined,) = [event["epoch"] for event in restarted.events("joined")]
    assert joined >= run.killed_at
    # after an outer step of all three, the restarted victim holds the same anchor and momentum as steady
    pairs = states_after_steps_together(run, ("victim-restarted", "steady"), ("victim", "steady"))
    assert pairs, "the restarted victim and steady took no outer step together"
    steps, *states = pairs[0]
    for mine, theirs in zip(*states):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    report(f"victim SIGKILLed in epoch {run.killed_at}'s outer all-reduce (mid-round for both: "
           f"{run.kill_landed_mid_round}); survivors went on in "
           + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in run.seconds_to_go_on.items())
           + f"; restarted, joined at epoch {joined}, stepped with both to outer step {steps} with steady's outer state")


def test_nonfinite_micro_batches_poison_no_anchor(diloco_faults: DiLoCoFaults, report):
    run = diloco_faults
    skipped = re.findall(r"Skipped (\d+) micro-batch\(es\) with non-finite", run.peers["faulty"].stderr)
    assert len(skipped) >= 3, run.peers["faulty"].stderr[-3000:]
    backups = sorted((run.root / "faulty" / "backups").glob("epoch-*")) + sorted(
        (run.root / "steady" / "backups").glob("epoch-*"))
    for folder in backups:
        state = torch.load(folder / TRAINING_STATE_FILE, weights_only=True)
        assert all(torch.isfinite(tensor).all() for tensor in state["outer"]), folder
    together = states_after_steps_together(run, ("faulty", "steady"), ("faulty", "steady"))
    assert together, "faulty and steady took no outer step together"
    for _, *states in together:
        for mine, theirs in zip(*states):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    report(f"faulty trainer dropped {sum(map(int, skipped))} non-finite micro-batches; its {len(backups)} backups "
           f"and steady's hold finite outer states, equal after the {len(together)} outer steps they took together")


def test_a_stranger_is_refused_by_the_outer_all_reduce(diloco_faults: DiLoCoFaults, report):
    run = diloco_faults
    assert run.stranger_probe == dict(join="PROTOCOL_VIOLATION", aggregate="PROTOCOL_VIOLATION",
                                      download=dict(messages=0, metadata=False)), run.stranger_probe
    answered = {code: n for code, n in run.stranger_codes.items() if not code.startswith("error")}
    assert set(answered) == {"PROTOCOL_VIOLATION"} and sum(answered.values()) >= 10, run.stranger_codes
    stranger_id = json.loads(run.peers["stranger"].stdout.splitlines()[0])["ready"]
    warnings = [event["reason"] for event in run.peers["steady"].events("peer_refused")
                if (event["source"], event["service"]) == (stranger_id, f"{RUN_ID}_outer")]
    assert len(warnings) == 1, warnings
    groups = [step["group_size"] for peer in run.peers.values() for step in peer.events("outer_step")]
    assert groups and max(groups) <= len(TRAINERS), groups  # nobody but the three trainers in any group
    report(f"stranger calling steady's outer all-reduce directly: join and tensor part -> PROTOCOL_VIOLATION, state "
           f"download -> nothing; {sum(answered.values())} more join requests during training, all refused; steady "
           f"logged once: {warnings[0]!r}")
