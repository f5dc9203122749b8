"""A matchmaking group closes at its declared time and its all-reduce begins when it forms, not after DHT stores.

What hivemind 1.1.12 does (its master the same, checked at 4bd43b7): an averager that matchmakes declares itself
under its group key (``PotentialLeaders._declare_averager_periodically``) and awaits the DHT store; only then does it
sleep until its declared time, and only when that sleep ends does its search, if it leads a group, close the group
(the re-declaration invalidates ``pop_next_leader``, and ``_request_join_potential_leaders`` assembles what it has).
A store takes as long as the DHT's node search and the replicas' answers, so a leader's group closes at its declared
time or when the store ends, whichever is later: in ``benchmarks/internet.py`` (16 DiLoCo trainers on 2 cores,
matchmaking logged at DEBUG) declarations took 0.4-78 s to store, and stores returned up to 34 s after the time
they declared had passed, while the leader's followers waited and the rest of the swarm matched without them.
Likewise, when an averager leaves matchmaking (its group formed,
or its search ended), the task's clean-up stores "no longer looking for a group" and ``look_for_group`` waits for
that store before it returns the group: with 16 DiLoCo trainers (seed 2, DHT lookups 2.5 s median, 33 s at most)
the leader's ``BEGIN_ALLREDUCE`` reached every follower within 0.6 s, but their ``look_for_group`` returned 2-31 s
later, and a reducer whose groupmates began the all-reduce more than ``sparse_allreduce.ABSENT_AFTER`` (20 s) after
the group formed failed the round for the whole group.

Here both stores run in the background (``declare_averager`` returns True at once; hivemind's one caller ignores
the result). A declaration only tells other peers whom to ask, and each record expires at its declared time anyway.
Nothing depends on the stores' order: the DHT keeps the record with the later expiration, and hivemind declares each
time later than the last and withdraws just after its last declared time. A failed store is a debug line.
Reproduced by ``tests/test_declaration_stores.py`` (hivemind's own ``PotentialLeaders`` with slow stores). Can go
once hivemind's matchmaking waits for neither store (not in its master).
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Set

from hivemind.averaging.key_manager import GroupKey, GroupKeyManager
from hivemind.p2p import PeerID
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)
HIVEMIND_DECLARE_AVERAGER = GroupKeyManager.declare_averager
_stores: Set[asyncio.Task] = set()  # the stores still in flight, referenced until they end


async def declare_averager(self: GroupKeyManager, group_key: GroupKey, peer_id: PeerID, expiration_time: float,
                           looking_for_group: bool = True) -> bool:
    """hivemind's, stored in the background: returns True at once."""
    store = HIVEMIND_DECLARE_AVERAGER(self, group_key, peer_id, expiration_time, looking_for_group)
    task = asyncio.ensure_future(_store(store, group_key, looking_for_group))
    _stores.add(task)
    task.add_done_callback(_stores.discard)
    return True


async def _store(store: Awaitable[bool], group_key: GroupKey, looking_for_group: bool) -> None:
    what = "declaration under" if looking_for_group else "withdrawal from"
    try:
        if not await store:
            logger.debug(f"The DHT refused this averager's {what} {group_key}")
    except Exception as error:  # the record expires at its declared time anyway
        logger.debug(f"Could not store this averager's {what} {group_key}: {error!r}")


def install() -> None:
    """Install the fix in this process and the averager processes it forks later (idempotent)."""
    GroupKeyManager.declare_averager = declare_averager
