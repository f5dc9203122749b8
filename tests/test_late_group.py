"""lean_transformer.swarm.hivemind_fixes.late_group: a leader's group that reaches a follower as its round ends.

hivemind's own ``Matchmaking`` is put in the state the race leaves: this peer follows a leader (both matchmaking locks
held, as in ``_request_join_group``) and its round's deadline has passed, so ``asyncio.wait_for`` has cancelled the
group's future; then the leader's ``BEGIN_ALLREDUCE`` is handled. The object is built without its constructor (a
P2P and a DHT that these methods never touch).
"""
from __future__ import annotations

import asyncio

import pytest
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from lean_transformer.swarm.hivemind_fixes import late_group

LEADER, FOLLOWER = PeerID(b"leader"), PeerID(b"follower")
BEGIN = averaging_pb2.MessageFromLeader(code=averaging_pb2.BEGIN_ALLREDUCE, group_id=b"group",
                                        ordered_peer_ids=[LEADER.to_bytes(), FOLLOWER.to_bytes()],
                                        gathered=[b"", b""])


async def follower_gets_the_group(assemble, round_ended: bool):
    """``assemble`` (a ``follower_assemble_group``) called as the follower's request task does, with the group's
    future cancelled by the round's deadline (``round_ended``) or still pending; its result and the future."""
    matchmaking = Matchmaking.__new__(Matchmaking)
    matchmaking.peer_id, matchmaking.current_leader = FOLLOWER, LEADER
    matchmaking.lock_looking_for_group, matchmaking.lock_request_join_group = asyncio.Lock(), asyncio.Lock()
    keys = matchmaking.group_key_manager = GroupKeyManager.__new__(GroupKeyManager)
    keys.peer_id, keys.prefix, keys.group_bits, keys.target_group_size = FOLLOWER, "fix", "", 2
    matchmaking.assembled_group = asyncio.get_running_loop().create_future()
    if round_ended:  # what look_for_group's wait_for does at the round's deadline
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(matchmaking.assembled_group, timeout=0)
    async with matchmaking.lock_looking_for_group, matchmaking.lock_request_join_group:
        result = await assemble(matchmaking, LEADER, BEGIN)
    return result, matchmaking.assembled_group


def test_a_group_that_comes_after_the_round_ended_is_declined():
    # the control: hivemind asserts (its request task ends in an AssertionError, logged as an ERROR traceback)
    with pytest.raises(AssertionError):
        asyncio.run(follower_gets_the_group(late_group.HIVEMIND_FOLLOWER_ASSEMBLE_GROUP, round_ended=True))
    # the fix: declined as from a leader that disbanded, the round's future left as the deadline left it
    group, future = asyncio.run(follower_gets_the_group(late_group.follower_assemble_group, round_ended=True))
    assert group is None and future.cancelled()


def test_a_group_in_time_is_assembled_as_hivemind_does_and_the_fix_is_installed():
    group, future = asyncio.run(follower_gets_the_group(late_group.follower_assemble_group, round_ended=False))
    assert group.group_id == b"group" and group.peer_ids == (LEADER, FOLLOWER)
    assert future.done() and future.result() is group
    # importing the package (above, for late_group) installs its global fixes
    assert Matchmaking.follower_assemble_group is late_group.follower_assemble_group
