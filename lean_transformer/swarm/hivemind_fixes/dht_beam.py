"""A DHT search asks the few nodes nearest its key, not the whole swarm.

What hivemind 1.1.12 does: every search of its DHT (a ``get``, and the node search that comes before each ``store``)
is a beam search that does not stop before it has asked the ``beam_size`` nodes nearest its key, and ``beam_size``
defaults to the routing table's bucket size, 20. A key lives on its ``num_replicas`` (5) nearest nodes, so in a
swarm of up to ~20 peers every search asks every peer, and each answer from a node that holds the key carries the
key's whole dictionary (a progress answer holds every peer's signed record). Each peer's DHT process then serves one
``find`` per search of the whole swarm: measured on loopback with 16 slow DiLoCo trainers and an aux peer
(the DHT's RPC handlers counted over 40 s, 2026-12-01): 16.8 ``find`` requests and 323 KB of answers per second
per DHT process, which cost each peer 0.036 cores in its DHT process and 0.029 in its p2p daemon, whatever the
swarm's size: on a volunteer's home link, 2.6 Mbit/s of DHT answers at 16 peers; on this 2-core box, more than 24
peers can pay (benchmarks/internet.py, 24 DiLoCo trainers: DHT lookups of 23-25 s at the median, groups of 3).

Here a search asks :data:`BEAM_SIZE` nodes: the 5 that hold the key and a margin of 3 for a routing table that
missed a newcomer or still lists a peer that left. The same swarm: 9.0 ``find`` requests and 174 KB per second per
DHT process, 0.027 + 0.021 cores per peer; the 24 trainers: lookups of 14 s, groups of 6 (still short: the box). A
search for more nodes than that (a node looking up its own neighbourhood, for its routing table: the bucket size)
keeps a beam of that many. Reproduced by ``tests/test_dht_beam.py`` (12 DHT nodes: a search asked 11, now at most 8,
and every value is still found, the latest one). Drop when hivemind's default beam follows its replicas (1.1.12's
does not; its master not checked).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Coroutine, Optional

from hivemind.dht.node import DHTNode

BEAM_SIZE = 8  # nodes a search asks, at least: hivemind's num_replicas (5) and a margin of 3


def _narrowed(search: Callable[..., Coroutine], least: Callable[[DHTNode, dict], int]) -> Callable[..., Coroutine]:
    """``search`` with a default beam of :data:`BEAM_SIZE`, or of ``least(node, kwargs)`` nodes when that is more."""

    @functools.wraps(search)
    async def narrow_search(self: DHTNode, *args: Any, beam_size: Optional[int] = None, **kwargs: Any) -> Any:
        if beam_size is None:
            beam_size = max(BEAM_SIZE, least(self, kwargs))
        return await search(self, *args, beam_size=beam_size, **kwargs)

    narrow_search.narrowed = True
    return narrow_search


def _nodes_wanted(node: DHTNode, kwargs: dict) -> int:
    # hivemind's searches for nodes pass k_nearest by name (a store: num_replicas) or not at all (a node's own
    # neighbourhood: the bucket size)
    return kwargs.get("k_nearest") or node.protocol.bucket_size


def install() -> None:
    """Narrow every DHT search of this process and of the DHT processes it forks later (idempotent)."""
    if not getattr(DHTNode.find_nearest_nodes, "narrowed", False):
        DHTNode.find_nearest_nodes = _narrowed(DHTNode.find_nearest_nodes, _nodes_wanted)
    if not getattr(DHTNode.get_many_by_id, "narrowed", False):
        DHTNode.get_many_by_id = _narrowed(DHTNode.get_many_by_id, lambda node, kwargs: 0)
