"""A volunteer started before the organizer's entry peer is up (or while it restarts) waits for it, up to
``--startup_timeout``, instead of exiting: real processes on 127.0.0.1, every wait bounded.

``benchmarks/internet.py`` saw 2 of 8 newcomers exit because their one initial peer was killed, or too starved to
answer hivemind's first ping, when they started.
"""
from __future__ import annotations

import pytest
from hivemind.p2p import PeerID

from aux_utils import closed_port, start_peer
from swarm_utils import assert_shut_down

from lean_transformer.demo.local_swarm import command_line
from lean_transformer.swarm.auth import load_identity_key

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(150)]

ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def test_trainer_waits_for_an_initial_peer_that_starts_after_it(tmp_path):
    identity = tmp_path / "entry.id"
    load_identity_key(identity, create=True)
    address = f"/ip4/127.0.0.1/tcp/{closed_port()}"
    entry_line = f"{address}/p2p/{PeerID.from_identity(identity.read_bytes())}"
    trainer = start_peer("trainer", ["run_trainer.py", *command_line(dict(
        run_id="late_entry", host_maddrs="/ip4/127.0.0.1/tcp/0", initial_peers=entry_line, target_batch_size=16,
        per_device_batch_size=4, max_sequence_length=32, max_epochs=1, startup_timeout=90))], tmp_path, ENV)
    entry = None
    try:
        trainer.wait_for(r"None of --initial_peers answered yet", 60)  # it tried, and is trying again
        entry = start_peer("entry", ["-m", "hivemind.hivemind_cli.run_dht", "--host_maddrs", address,
                                     "--identity_path", str(identity)], tmp_path, ENV, events=False)
        joined = trainer.wait_for_event("joined", timeout=60)
        assert trainer.wait(60) == 0, trainer.log_tail()
    finally:
        trainer.kill()
        if entry is not None:
            entry.stop()
    assert joined["epoch"] == 0
    assert_shut_down(trainer, "finished")
