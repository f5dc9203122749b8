"""A leader's group that reaches a follower as its round ends is declined, not an ERROR traceback.

What hivemind 1.1.12 does: a round's matchmaking waits for its group until the round's deadline
(``asyncio.wait_for`` on the ``assembled_group`` future), and at the deadline ``wait_for`` cancels that future before
it cancels the task that asks leaders. If a leader's ``BEGIN_ALLREDUCE`` wakes that task in the same turn of the
event loop, ``follower_assemble_group`` asserts that the group's future is not done; the task ends in an
``AssertionError`` that hivemind logs as an ERROR with a traceback. Seen once in ``benchmarks/internet.py`` with 24
DiLoCo trainers on 2 cores, whose event loops ran seconds late (a follower still waited for its leader at its
round's deadline). The round is over either way: the averager reports "could not find a group", and the leader's
group averages without this peer, which answers its parts ``BAD_GROUP_ID`` (hivemind's all-reduce leaves the part
of the tensors a failed member reduces as each member's own).

Here the follower declines such a group as it does a leader that disbanded: ``None``, one debug line. Reproduced by
``tests/test_late_group.py`` (hivemind's matchmaking in the state the race leaves). Can go once hivemind's
matchmaking checks its group's future before it assembles (master not checked).
"""
from __future__ import annotations

from typing import Optional

from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)
HIVEMIND_FOLLOWER_ASSEMBLE_GROUP = Matchmaking.follower_assemble_group


async def follower_assemble_group(self: Matchmaking, leader: PeerID, msg: averaging_pb2.MessageFromLeader
                                  ) -> Optional[GroupInfo]:
    """hivemind's, or None where this peer's round ended (its group's future done) before the leader's group came."""
    if self.assembled_group.done():
        logger.debug(f"{self.peer_id} - the group of {leader} came after this round's end: declined")
        return None
    return await HIVEMIND_FOLLOWER_ASSEMBLE_GROUP(self, leader, msg)


def install() -> None:
    """Install the fix in this process and the averager processes it forks later (idempotent)."""
    Matchmaking.follower_assemble_group = follower_assemble_group
