"""Swarm-wide agreement: a newcomer whose run settings differ from the swarm's is refused within 30 s, with one line
naming the first field that differs and both values, while the swarm goes on (real peers on 127.0.0.1)."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from aux_utils import PeerProcess, start_peer, stop_all

from lean_transformer.demo.local_swarm import command_line
from lean_transformer.swarm.protocol.agreement import AgreementRecord, first_difference, settings_digest, swarm_mismatch

TINY = dict(run_id="agreement", host_maddrs="/ip4/127.0.0.1/tcp/0", per_device_batch_size=4,
            max_sequence_length=32, target_batch_size=16, matchmaking_time=0.5, averaging_timeout=10,
            shutdown_timeout=20)
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
REFUSAL_LIMIT = 30  # seconds from the newcomer's DHT start to its exit


def mismatches(tmp_path: Path) -> dict[str, tuple[dict, str]]:
    """name -> (flags that differ from the swarm's, the fragment the error line must hold)"""
    config = json.loads(Path("tasks/configs/tiny_gpt.json").read_text())
    wider = tmp_path / "wider.json"
    wider.write_text(json.dumps(dict(config, intermediate_size=2 * config["intermediate_size"])))
    return {
        "model config": (dict(model_config_path=str(wider)),
                         f"--model_config_path (intermediate_size): this peer has {2 * config['intermediate_size']}, "
                         f"the swarm has {config['intermediate_size']}"),
        "8-bit threshold": (dict(min_8bit_size=1), "--min_8bit_size: this peer has 1, the swarm has 4096"),
        "learning rate": (dict(learning_rate=0.5), "--learning_rate: this peer has 0.5, the swarm has"),
        "target batch": (dict(target_batch_size=32), "--target_batch_size: this peer has 32, the swarm has 16"),
        "compression": (dict(grad_compression="float16"),
                        '--grad_compression: this peer has "float16", the swarm has "size_adaptive"'),
    }


def watch(peers: dict[str, PeerProcess], pattern: str, timeout: float) -> tuple[dict, dict]:
    """When (time.monotonic) each peer first logged ``pattern``, and when it exited; every peer must do both."""
    seen, exited = {}, {}
    deadline = time.monotonic() + timeout
    while len(exited) < len(peers) and time.monotonic() < deadline:
        now = time.monotonic()
        for name, peer in peers.items():
            done = peer.process.poll() is not None  # before reading the log: all it logged before exiting is there
            if name not in seen and re.search(pattern, peer.stderr):
                seen[name] = now
            if done and name not in exited:
                exited[name] = now
        time.sleep(0.1)
    missing = {name: peers[name].stderr[-2000:] for name in peers if name not in seen or name not in exited}
    assert not missing, f"peers that did not log {pattern!r} and exit in {timeout} s: {missing}"
    return seen, exited


@pytest.mark.swarm
def test_a_misconfigured_newcomer_is_refused_in_one_line_and_the_swarm_goes_on(tmp_path: Path, report):
    swarm = start_peer("swarm", ["run_trainer.py", *command_line(dict(TINY, output_dir=str(tmp_path / "swarm")))],
                        tmp_path, ENV)
    newcomers = {}
    try:
        initial_peers = swarm.initial_peers(timeout=120)  # its joined event
        cases = mismatches(tmp_path)
        for name, (flags, _) in cases.items():  # all at once; each one's time is counted from its own DHT start
            newcomers[name] = start_peer(name.replace(" ", "-"), ["run_trainer.py", *command_line(dict(
                TINY, output_dir=str(tmp_path / name), **flags)), "--initial_peers", *initial_peers], tmp_path, ENV)
        started = time.monotonic()
        joined, exited = watch(newcomers, r"Comparing this peer's .* run settings with the swarm's", timeout=180)
        for name, (flags, fragment) in cases.items():
            newcomer = newcomers[name]
            seconds = exited[name] - joined[name]  # the DHT is up: the rest is this feature's own time
            errors = [line for line in newcomer.stderr.splitlines() if line.startswith("run_trainer.py: error:")]
            assert newcomer.wait(1) == 1 and len(errors) == 1, f"{name}:\n{newcomer.stderr[-3000:]}"
            assert fragment in errors[0], (name, errors[0])
            (mismatch,) = newcomer.events("settings_mismatch")
            assert fragment.split(":")[0][2:] in mismatch["differences"], (name, mismatch)
            assert (newcomer.events()[-1]["event"], newcomer.events()[-1]["reason"]) == ("shutdown", "error"), name
            assert seconds <= REFUSAL_LIMIT, f"{name}: refused {seconds:.0f} s after its DHT started"
            report(f"{name}: refused {seconds:.1f} s after its DHT started ({exited[name] - started:.0f} s after "
                   f"launch): {errors[0][len('run_trainer.py: error: '):][:100]}")
        assert swarm.process.poll() is None, f"the swarm's peer stopped:\n{swarm.stderr[-3000:]}"
        epoch = swarm.events("epoch")[-1]["epoch"]
        swarm.wait_for_event("epoch", lambda event: event["epoch"] > epoch, timeout=60)  # and it still trains
    finally:
        stop_all([swarm, *newcomers.values()])


def test_digest_and_first_difference():
    ours = {"a": "1", "b": '"x"'}
    assert settings_digest(ours) == settings_digest(dict(reversed(list(ours.items()))))
    assert settings_digest(ours) != settings_digest({**ours, "b": '"y"'})
    assert first_difference(ours, {**ours, "b": '"y"'}) == "b"
    assert first_difference(ours, {"a": "1"}) == "b" and first_difference(ours, dict(ours)) is None


def record(since: float, **settings: str) -> AgreementRecord:
    return AgreementRecord(digest=settings_digest(settings), since=since, settings=settings)


def test_only_the_oldest_peer_sets_the_swarm_settings():
    """A newcomer compares with the oldest record only: a refused newcomer's record, still listed, that is older
    than this peer but younger than the swarm does not refuse a correct peer, nor name its own setting to a wrong
    one (both happened before: the first older record that differed won)."""
    swarm, ours = record(10.0, lr="0.1", batch="16"), record(30.0, lr="0.1", batch="16")
    refused = record(20.0, lr="0.1", batch="32")
    assert swarm_mismatch(ours, [refused.model_dump(), swarm.model_dump()]) is None
    wrong_lr = record(30.0, lr="0.5", batch="16")
    error = swarm_mismatch(wrong_lr, [refused.model_dump(), swarm.model_dump()])
    assert "--lr: this peer has 0.5, the swarm has 0.1" in str(error)
    assert swarm_mismatch(swarm, [refused.model_dump(), wrong_lr.model_dump()]) is None  # the oldest goes on
    forged = dict(record(1.0, lr="9").model_dump(), digest=settings_digest({"lr": "0.1", "batch": "16"}))
    assert swarm_mismatch(ours, [forged, {"junk": 1}, swarm.model_dump()]) is None  # malformed records are ignored
