"""A DHT node that has lost every neighbour joins again through its initial peers.

What hivemind 1.1.12 does wrong: a DHT node removes a peer from its routing table when a single request to it goes
unanswered (``DHTProtocol.update_routing_table(..., responded=False)``). It adds peers again only when they answer it
or call it. Nobody calls a client-mode node. So a volunteer behind NAT that joined through one entry peer is cut off
for good once that peer misses one request within the DHT's ``wait_timeout`` (3 s by default, 10 s in ``build_dht``;
a busy aux peer). Its stores and lookups then reach nobody: it sees only its own progress record, trains alone, and no
peer sees it.
``benchmarks/internet.py``, 16 trainers: the first NAT'ed trainer, in two runs, for the whole 240 s window.

The fix: a task in the DHT's own process looks at the routing table every ``period`` seconds. When the table is
empty, the task pings the initial peers again and looks up the node's own neighbours, as hivemind's bootstrap does.
Reproduced by ``tests/test_dht_rejoin.py`` (an entry peer paused for one request). Drop when hivemind refreshes an
empty routing table from its initial peers, or keeps a node's last neighbour.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from typing import Sequence

import hivemind
from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

logger = logging.getLogger(__name__)
REJOIN_TIMEOUT = 30.0  # seconds for one try: the pings (hivemind's wait_timeout each) and the neighbour lookup


def keep_neighbours(dht: hivemind.DHT, initial_peers: Sequence[str], period: float = 10.0) -> None:
    """Start the watch (see the module docstring) in ``dht``'s process; without initial peers there is nobody to
    join again through."""
    peers = sorted({str(Multiaddr(maddr)["p2p"]) for maddr in initial_peers})
    if peers:
        dht.run_coroutine(functools.partial(_start_watch, peers=peers, period=period))


async def _start_watch(dht: hivemind.DHT, node: DHTNode, peers: list[str], period: float) -> None:
    node.rejoin_task = asyncio.create_task(_watch(node, [PeerID.from_base58(peer) for peer in peers], period))


async def _watch(node: DHTNode, peers: list[PeerID], period: float) -> None:
    while True:
        await asyncio.sleep(period)
        if node.protocol.routing_table.uid_to_peer_id:
            continue
        logger.info(f"The DHT lost every neighbour: joining again through {len(peers)} initial peer(s)")
        try:
            await asyncio.wait_for(_rejoin(node, peers), REJOIN_TIMEOUT)
        except asyncio.TimeoutError:
            logger.info(f"Joining the DHT again took over {REJOIN_TIMEOUT:g} s: trying again in {period:g} s")


async def _rejoin(node: DHTNode, peers: list[PeerID]) -> None:
    await asyncio.gather(*(node.protocol.call_ping(peer) for peer in peers))  # each answer re-enters the table
    if node.protocol.routing_table.uid_to_peer_id:
        await node.find_nearest_nodes([node.node_id])
