"""lean_transformer.swarm.hivemind_fixes.leader_resets: a join request whose connection to the leader breaks.

Run as a script, this file is one variant of the scenario, in its own process with two real P2P daemons on 127.0.0.1:
hivemind's own ``Matchmaking._request_join_group`` asks a leader whose end of the join stream closes at once (as a
leader's leaving process), while the request, with an 8 MB ``gather`` (DiLoCo's can carry a top-k payload), is still
in flight. Variant ``hivemind``: its method as shipped; ``lean_transformer``: with the fix. The Matchmaking is built
without its constructor (a DHT that the method never touches).
"""

import asyncio
import json
import sys
import time
from types import SimpleNamespace
from typing import AsyncIterator

import pytest

import preloaded
from swarm_utils import p2p_pair

CALLS, GATHER_BYTES = 6, 8_000_000


async def _scenario(variant: str) -> dict:
    from hivemind.averaging.key_manager import GroupKeyManager
    from hivemind.averaging.matchmaking import Matchmaking
    from hivemind.p2p import P2PContext, ServicerBase
    from hivemind.proto import averaging_pb2

    from lean_transformer.swarm.hivemind_fixes import leader_resets

    class Averager(ServicerBase):
        async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
            yield averaging_pb2.MessageFromLeader()  # never called: the leader's handler below closes at once

    async def close_at_once(_stream_info, _reader, writer) -> None:
        writer.close()

    request = leader_resets.HIVEMIND_REQUEST_JOIN_GROUP if variant == "hivemind" else leader_resets.request_join_group
    async with p2p_pair() as (leader, follower):
        await leader.add_binary_stream_handler(Averager._get_handle_name("fix", "rpc_join_group"), close_at_once)
        outcomes = []
        for _ in range(CALLS):
            matchmaking = Matchmaking.__new__(Matchmaking)
            matchmaking._p2p, matchmaking._servicer_type, matchmaking._prefix = follower, Averager, "fix"
            matchmaking.peer_id, matchmaking.schema_hash, matchmaking.client_mode = follower.peer_id, b"schema", False
            matchmaking.request_timeout, matchmaking.current_leader, matchmaking.current_followers = 5.0, None, {}
            matchmaking.lock_looking_for_group, matchmaking.lock_request_join_group = asyncio.Lock(), asyncio.Lock()
            matchmaking.was_accepted_to_group = asyncio.Event()
            keys = matchmaking.group_key_manager = GroupKeyManager.__new__(GroupKeyManager)
            keys.peer_id, keys.prefix, keys.group_bits, keys.target_group_size = follower.peer_id, "fix", "", 2
            matchmaking.step_control = SimpleNamespace(data_for_gather=b"\0" * GATHER_BYTES)
            matchmaking.get_request_expiration_time = lambda: time.time() + 30
            async with matchmaking.lock_looking_for_group:  # held while a peer looks for a group
                try:
                    outcomes.append(repr(await asyncio.wait_for(request(matchmaking, leader.peer_id), 30)))
                except Exception as error:
                    outcomes.append(type(error).__name__)
        return dict(outcomes=outcomes)


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_a_leader_whose_connection_breaks_mid_request_is_a_leader_that_said_no(report):
    upstream, fixed = (result["outcomes"] for result, _ in
                       preloaded.run_side_by_side(__file__, ["hivemind", "lean_transformer"]))
    broken = [outcome for outcome in upstream if outcome in ("ConnectionResetError", "BrokenPipeError")]
    # when hivemind's matchmaking catches these itself, this fails: drop leader_resets (see its docstring)
    assert len(broken) >= CALLS // 2, f"hivemind 1.1.12 raised only {len(broken)} of {CALLS}: {upstream}"
    assert fixed == ["None"] * CALLS, fixed
    report(f"a leader closing its end with {GATHER_BYTES / 1e6:g} MB of join request in flight: hivemind's "
           f"matchmaking raised {sorted(set(broken))} in {len(broken)} of {CALLS} requests (its search ends there); "
           f"with leader_resets, {CALLS} of {CALLS} were a leader that said no")


if __name__ == "__main__":
    print(json.dumps(asyncio.run(_scenario(sys.argv[1]))))
