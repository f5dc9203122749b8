"""A leaving peer's last metrics record reaches the DHT before the peer's DHT shuts down
(``MetricsPublisher.flush`` in ``SwarmPeer``'s exit).

A client-mode ``SwarmPeer`` publishes its record of an epoch and leaves at once, as a trainer that was sent SIGTERM
just after reaching its epoch does. Its DHT's stores go out ``STORE_SECONDS`` late, as in a busy swarm over slow links
(the progress lookups of benchmarks/internet.py's 16-trainer runs: 11-16 s at the 90th percentile): without the wait
its DHT shuts down first and the aux peer's DHT node never gets the record.

Run as a script, this file is one of the two peers: ``python tests/test_last_record.py aux|leaver ...``.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

RUN_ID = "last_record_test"
STORE_SECONDS = 2.0


def _aux() -> None:
    """A full DHT node with the run's validators: prints its addresses, then on each line of stdin the epochs of the
    metrics records it holds."""
    import hivemind

    from lean_transformer.swarm.protocol.metrics import fetch_metrics, make_validators

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=make_validators(RUN_ID))
    print(json.dumps([str(maddr) for maddr in dht.get_visible_maddrs()]), flush=True)
    for _ in sys.stdin:
        print(json.dumps(sorted(record.epoch for record in fetch_metrics(dht, RUN_ID).values())), flush=True)
    dht.shutdown()


def _leaver(timeout: float, initial_peers: list[str]) -> None:
    """A client-mode peer that publishes its record of epoch 7 and leaves at once, waiting at most ``timeout`` s for
    the store, which goes out ``STORE_SECONDS`` late; prints how long the exit took."""
    import asyncio

    from hivemind.dht.protocol import DHTProtocol

    from lean_transformer.swarm.peers import swarm_peer
    from lean_transformer.swarm.protocol.metrics import LocalMetrics
    from lean_transformer.swarm.protocol.settings import NetworkSettings

    send_store = DHTProtocol.call_store

    async def late_store(self, *args, **kwargs):
        await asyncio.sleep(STORE_SECONDS)
        return await send_store(self, *args, **kwargs)

    DHTProtocol.call_store = late_store  # before the DHT's process forks
    swarm_peer.LAST_RECORD_TIMEOUT = timeout
    network = NetworkSettings(run_id=RUN_ID, initial_peers=initial_peers, client_mode=True,
                              host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    with swarm_peer.SwarmPeer(network, swarm_settings={}) as peer:
        peer.metrics.publish(LocalMetrics(epoch=7, samples_per_second=1.0, samples_accumulated=8, loss_sum=2.0,
                                          mini_steps=2), expiration=300)
        leaving = time.monotonic()
    print(json.dumps(time.monotonic() - leaving), flush=True)


if __name__ != "__main__":
    import pytest

    from aux_utils import REPO

    @pytest.fixture(scope="module")
    def aux(tmp_path_factory):
        log = tmp_path_factory.mktemp("last_record")
        with open(log / "aux.err", "wb") as err:
            process = subprocess.Popen([sys.executable, __file__, "aux"], cwd=REPO, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=err, text=True)
            try:
                maddrs = json.loads(process.stdout.readline())
                yield process, maddrs, log
                process.stdin.close()  # it shuts its DHT down and exits
                assert process.wait(60) == 0
            finally:
                process.kill()

    def leave(aux, timeout: float, name: str) -> tuple[float, str, list[int]]:
        """Run a leaver; (seconds its exit took, its log, the epochs of the records the aux then holds)."""
        process, maddrs, log = aux
        with open(log / f"{name}.err", "w+") as err:
            done = subprocess.run([sys.executable, __file__, "leaver", str(timeout), *maddrs], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=err, text=True, timeout=120)
            err.seek(0)
            logged = err.read()
        assert done.returncode == 0, logged
        process.stdin.write("read\n")
        process.stdin.flush()
        return json.loads(done.stdout.strip().splitlines()[-1]), logged, json.loads(process.stdout.readline())

    def test_a_leaving_peer_waits_for_its_last_record_and_only_as_long_as_allowed(aux):
        # the control: a peer that does not wait leaves with the store in flight, and the record is lost
        seconds, logged, epochs = leave(aux, timeout=0.0, name="control")
        assert epochs == [], (epochs, logged)
        assert "was not stored within" in logged, logged  # one line says so
        # the fix: the exit waits for the store (about STORE_SECONDS), and the aux holds the record
        seconds, logged, epochs = leave(aux, timeout=STORE_SECONDS * 5, name="fixed")
        assert epochs == [7], (epochs, logged)
        assert STORE_SECONDS * 0.9 <= seconds < STORE_SECONDS * 5, seconds
        assert "WARN" not in logged, logged


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if sys.argv[1] == "aux":
        _aux()
    else:
        _leaver(float(sys.argv[2]), sys.argv[3:])
