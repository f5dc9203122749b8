"""Strikes and exclusion (issue 24): a peer caught lying repeatedly is left out of this peer's groups for a while.

A *strike* is one round in which a groupmate was caught: as a sender, CenteredClip found its part far out
(:data:`FAR_OUT` x tau from the result, see :mod:`.robust`); as a reducer, an answer it gave failed this peer's check
(:mod:`.answer_check`). One strike per peer per round at most: a liar's whole share of a round is one lie, and an
honest peer's rare unlucky part should not count many times. ``strikes`` (3) strikes within its last ``window``
(10) rounds exclude it for ``duration`` (600 s): logged once at WARNING, emitted as a ``peer_excluded`` event
(``source``, ``reason``, ``until``: Unix time), which the trainer's metrics record then carries
(:mod:`lean_transformer.swarm.peers.reporting`). While excluded, this peer's reducers give its parts weight 0, its
answers are replaced by this peer's own values (as for a reducer that failed), and it is in none of the groups
this peer forms: when this peer leads matchmaking its join requests are refused, when it leads this peer does not ask
to join it (:class:`RefusesExcluded`). hivemind has no notion of a peer's
reputation (its all-reduce only bans a sender for the rest of one round when it stops sending), hence our own.

The bookkeeping lives in the averager's process (hivemind's averagers run in a forked process); each averager keeps
its own (gradient and DiLoCo outer averagers see different rounds).
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Any, AsyncIterator, Callable, Deque, Dict, List, Optional

from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import as_aiter

from lean_transformer.swarm.hivemind_fixes.stream_answers import lingering
from lean_transformer.swarm.monitoring.events import emit

logger = logging.getLogger(__name__)

FAR_OUT = 10.0  # a sender whose part ends this many tau (CenteredClip's radius) from the result earns a strike


class Exclusions:
    """Strikes per peer ID, counted by round (``begin_round`` once per all-reduce), and the peers excluded now.
    ``clock``: Unix time (the ``until`` of the events is compared across processes)."""

    def __init__(self, strikes: int = 3, window: int = 10, duration: float = 600.0,
                 clock: Callable[[], float] = time.time):
        if strikes < 1 or window < strikes:
            raise ValueError(f"exclusion needs 1 <= strikes <= window, got strikes={strikes}, window={window}")
        if not duration > 0:
            raise ValueError(f"exclusion duration must be positive, got {duration}")
        self.strikes, self.window, self.duration, self.clock = strikes, window, duration, clock
        self.round = 0
        self._struck: Dict[str, Deque[int]] = {}  # peer ID -> the rounds it was struck in (newest last)
        self._until: Dict[str, float] = {}  # peer ID -> when its exclusion ends

    def begin_round(self) -> None:
        self.round += 1

    def strike(self, peer_id: str, reason: str) -> bool:
        """Count a strike against ``peer_id`` in this round (once per round); True if it is excluded from now on."""
        rounds = self._struck.setdefault(peer_id, collections.deque())
        if rounds and rounds[-1] == self.round:
            return False
        rounds.append(self.round)
        while rounds and rounds[0] <= self.round - self.window:
            rounds.popleft()
        if len(rounds) < self.strikes or self.is_excluded(peer_id):
            return False
        return self.exclude(peer_id, reason, f"{self.strikes} strikes within {self.window} rounds, the last: ")

    def exclude(self, peer_id: str, reason: str, why: str = "") -> bool:
        """Exclude ``peer_id`` now, for ``duration`` seconds (a misdeed no honest peer commits); False if it already
        is."""
        if self.is_excluded(peer_id):
            return False
        until = self.clock() + self.duration
        self._until[peer_id] = until
        self._struck.pop(peer_id, None)
        logger.warning(f"Excluding peer {peer_id} for {self.duration:.0f} s: {why}{reason}")
        emit("peer_excluded", source=peer_id, reason=reason, until=until)
        return True

    def is_excluded(self, peer_id: str) -> bool:
        until = self._until.get(peer_id)
        if until is None:
            return False
        if self.clock() >= until:
            del self._until[peer_id]
            return False
        return True

    def excluded(self) -> List[str]:
        """The peer IDs excluded now."""
        return [peer_id for peer_id in list(self._until) if self.is_excluded(peer_id)]


class RefusesExcluded:
    """Mixed in front of a hivemind averager: ``exclusions`` (None: none kept) and groups without excluded peers.
    While this peer leads matchmaking, their join requests are refused (``NOT_LOOKING_FOR_GROUP``, hivemind's answer
    of a leader that forms no group: the peer moves on to another leader); while it looks for a leader, it skips
    them (also when another leader redirects it to one). A group led by a third peer can still hold them (hivemind's
    followers take the leader's list); there their parts weigh 0 and their answers are replaced."""

    # hivemind caches the RPC table per class: a subclass must build its own (see auth.averaging_gate.GatedRPCs)
    _rpc_handlers = None
    _stub_type = None

    def __init__(self, *args, exclusions: Optional[Exclusions] = None, **kwargs):
        self.exclusions = exclusions  # before hivemind's __init__, which starts the averager's process
        super().__init__(*args, **kwargs)

    async def _step(self, **kwargs: Any) -> None:
        if self.exclusions is not None:
            self._skip_excluded_leaders()
        await super()._step(**kwargs)

    def _skip_excluded_leaders(self) -> None:
        """hivemind 1.1.12 builds its Matchmaking inside the averager's process and offers no hook for the choice of a
        leader: its one request method is wrapped on the instance, once (the redirects go through it too)."""
        matchmaking = self._matchmaking
        request = matchmaking._request_join_group
        if getattr(request, "skips_excluded", False):
            return

        async def request_unless_excluded(leader: PeerID) -> Optional[GroupInfo]:
            if self.exclusions.is_excluded(leader.to_base58()):
                return None  # as a leader that refused: the search goes on with the next one
            return await request(leader)

        request_unless_excluded.skips_excluded = True
        matchmaking._request_join_group = request_unless_excluded

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if self.exclusions is not None and self.exclusions.is_excluded(context.remote_id.to_base58()):
            async for message in lingering(as_aiter(averaging_pb2.MessageFromLeader(
                    code=averaging_pb2.NOT_LOOKING_FOR_GROUP))):  # delivered (hivemind_fixes.stream_answers)
                yield message
            return
        async for message in super().rpc_join_group(request, context):
            yield message
