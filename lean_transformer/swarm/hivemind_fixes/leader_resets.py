"""A leader whose connection breaks while a peer asks to join its group no longer ends that peer's round.

What hivemind 1.1.12 does (its master the same, checked at 4bd43b7): ``Matchmaking._request_join_group`` takes a
leader that cannot be reached or refuses (``P2PDaemonError``, ``P2PHandlerError``, a stream that ends) as a leader
that said no, and the search goes on with the next one. But when the connection to the leader breaks mid-request
(the leader leaving, or its end closing with the request partly unread), hivemind's p2p client raises
``ConnectionResetError`` (p2pd closed the stream's socket with the request unread) or ``BrokenPipeError`` (the
request could not be written), and ``_request_join_potential_leaders`` re-raises it: the averager's whole matchmaking
ends in an ERROR traceback ("Task exception was never retrieved") and the peer misses the round. Seen in
``benchmarks/internet.py`` (16 DiLoCo trainers with churn: a trainer logged two such tracebacks for one join request,
which the benchmark counts as a crash).

Here a broken connection is a leader that said no: one debug line, then the next leader. Reproduced by
``tests/test_leader_resets.py`` (hivemind's own matchmaking asks a real leader that closes its end at once, an 8 MB
request in flight). Can go once hivemind's matchmaking catches ``ConnectionError`` there.
"""
from __future__ import annotations

from typing import Optional

from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import PeerID
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)
HIVEMIND_REQUEST_JOIN_GROUP = Matchmaking._request_join_group


async def request_join_group(self: Matchmaking, leader: PeerID) -> Optional[GroupInfo]:
    """hivemind's, or None when the connection to ``leader`` breaks (as for a leader that refused)."""
    try:
        return await HIVEMIND_REQUEST_JOIN_GROUP(self, leader)
    except ConnectionError as error:
        logger.debug(f"{self.peer_id} - the connection to potential leader {leader} broke: {error!r}")
        return None


def install() -> None:
    """Install the fix in this process and the averager processes it forks later (idempotent)."""
    Matchmaking._request_join_group = request_join_group
