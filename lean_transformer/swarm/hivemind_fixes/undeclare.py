"""A round's all-reduce begins when its group forms, not after a DHT store.

What hivemind 1.1.12 does (its master the same, checked at 4bd43b7): when an averager leaves matchmaking (its group
formed, or its search ended), ``PotentialLeaders.begin_search`` cancels the task that declares the averager under
its group key, and that task's clean-up stores "no longer looking for a group" under the key and awaits the store;
``Matchmaking.look_for_group`` waits for that clean-up before it returns the group. A store takes as long as the
DHT's node search and the replicas' answers: seconds in a busy swarm over slow links. In ``benchmarks/internet.py``
(16 DiLoCo trainers, seed 2, DHT lookups 2.5 s median and 33 s at most) the leader's ``BEGIN_ALLREDUCE`` reached
every follower within 0.6 s, but their ``look_for_group`` returned 2-31 s later, the leader's last (it waits for each
follower's clean-up too); a reducer whose groupmates began the all-reduce more than
``sparse_allreduce.ABSENT_AFTER`` (20 s) after the group formed failed the round for the whole group, and these
late starts were what the internet benchmark's lost rounds had in common.

Here that store runs in the background: the record only spares other peers a join request this averager would
refuse, and it expires at its declared time anyway. Nothing depends on its order against later stores: the DHT keeps
the record with the later expiration, whichever store arrives first. Its failure is a debug line. Reproduced by
``tests/test_undeclare.py`` (hivemind's own ``PotentialLeaders`` with a slow store). Can go once hivemind's
matchmaking does not wait for this store (not in its master).
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Set

from hivemind.averaging.key_manager import GroupKey, GroupKeyManager
from hivemind.p2p import PeerID
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)
HIVEMIND_DECLARE_AVERAGER = GroupKeyManager.declare_averager
_stores: Set[asyncio.Task] = set()  # the withdrawals still in flight, referenced until they end


async def declare_averager(self: GroupKeyManager, group_key: GroupKey, peer_id: PeerID, expiration_time: float,
                           looking_for_group: bool = True) -> bool:
    """hivemind's, except that a withdrawal (``looking_for_group=False``) is stored in the background: it returns
    True at once (hivemind's one caller of it ignores the result)."""
    store = HIVEMIND_DECLARE_AVERAGER(self, group_key, peer_id, expiration_time, looking_for_group)
    if looking_for_group:
        return await store
    task = asyncio.ensure_future(_withdraw(store, group_key))
    _stores.add(task)
    task.add_done_callback(_stores.discard)
    return True


async def _withdraw(store: Awaitable[bool], group_key: GroupKey) -> None:
    try:
        if not await store:
            logger.debug(f"The DHT refused this averager's withdrawal from {group_key}")
    except Exception as error:  # the record expires at its declared time anyway
        logger.debug(f"Could not withdraw this averager from {group_key}: {error!r}")


def install() -> None:
    """Install the fix in this process and the averager processes it forks later (idempotent)."""
    GroupKeyManager.declare_averager = declare_averager
