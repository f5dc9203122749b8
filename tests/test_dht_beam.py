"""How many peers a DHT search asks (lean_transformer.swarm.hivemind_fixes.dht_beam), on 12 real DHT nodes, each in
its own process: hivemind's default beam asks all 11 others for every get and before every store; ours asks at most
BEAM_SIZE, and still finds every value, the latest one where two were stored."""
from __future__ import annotations

import functools

import pytest

from lean_transformer.swarm.hivemind_fixes.dht_beam import BEAM_SIZE  # installs the fix in the DHTs forked below
from lean_transformer.swarm.peers.processes import wait_until
from swarm_utils import routing_table_size

pytestmark = pytest.mark.swarm
NODES = 12
KEYS = 8


async def asked_by_searches(dht, node, keys: list, hivemind_beam: bool) -> list:
    """For each key, the peers asked by a store's node search and by a get of the latest value (both from ``node``),
    and the value found; with ``hivemind_beam``, the searches run with hivemind's own default beam."""
    asked, call_find = set(), node.protocol.call_find

    async def counted(peer, *args, **kwargs):
        asked.add(peer)
        return await call_find(peer, *args, **kwargs)

    beam = dict(beam_size=max(node.protocol.bucket_size, node.num_replicas)) if hivemind_beam else {}
    node.protocol.call_find = counted
    try:
        results = []
        for key in keys:
            asked.clear()
            nearest = await node.find_nearest_nodes([_key_id(key)], k_nearest=node.num_replicas, **beam)
            store_asked = len(asked)
            assert len(nearest[_key_id(key)]) >= node.num_replicas
            asked.clear()
            found = await node.get_many_by_id([_key_id(key)], sufficient_expiration_time=float("inf"), **beam)
            value = found[_key_id(key)]
            results.append((store_asked, len(asked), None if value is None else value.value))
        return results
    finally:
        del node.protocol.call_find


def _key_id(key: str):
    from hivemind.dht.routing import DHTID

    return DHTID.generate(source=key)


@pytest.fixture(scope="module")
def dhts():
    import hivemind

    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    initial = [str(maddr) for maddr in first.get_visible_maddrs()]
    nodes = [first] + [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial)
                       for _ in range(NODES - 1)]
    try:
        # every node knows every other (hivemind's bootstrap searches its own neighbourhood with the bucket size, 20)
        for dht in nodes:
            wait_until(lambda: dht.run_coroutine(routing_table_size) == NODES - 1, 30.0, "a full routing table",
                       interval=0.2)
        yield nodes
    finally:
        for dht in nodes:
            dht.shutdown()


def test_a_search_asks_a_few_nodes_and_finds_the_latest_value(dhts):
    from hivemind.utils import get_dht_time

    keys = [f"key{i}" for i in range(KEYS)]
    for i, key in enumerate(keys):  # two values per key from two other nodes: the later expiration is the latest
        now = get_dht_time()
        assert dhts[1 + i % 5].store(key, "older", now + 60)
        assert dhts[6 + i % 5].store(key, "latest", now + 120)

    ours = dhts[0].run_coroutine(functools.partial(asked_by_searches, keys=keys, hivemind_beam=False))
    hivemind_own = dhts[0].run_coroutine(functools.partial(asked_by_searches, keys=keys, hivemind_beam=True))

    assert all(store == get == NODES - 1 for store, get, _ in hivemind_own), hivemind_own
    assert all(store <= BEAM_SIZE and get <= BEAM_SIZE for store, get, _ in ours), ours
    assert [value for _, _, value in ours] == ["latest"] * KEYS
