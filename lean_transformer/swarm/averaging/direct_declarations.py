"""Matchmaking declarations go straight to the trainers a peer knows, besides the DHT.

hivemind's matchmaking finds a leader among the averagers declared under the group's DHT key: each peer stores its
declaration (its peer ID and the time its group closes), and looks the key up again and again until it finds an
earlier-declared peer to join. Its rule is sound (the earliest declaration leads; a leader that finds an earlier one
hands its followers over), but every step of it waits for the DHT. benchmarks/internet.py (16 DiLoCo trainers on 2
cores, matchmaking logged at DEBUG): declarations took 0.4-78 s to store and lookups 11 s median, 47 s at worst, so
peers that began matching 15 s before a round's end found each other late or not at all; rounds split into groups of
2-7, and in one round no trainer found a group for 70 s (4 of 20 trainers averaged in >= 90% of their rounds; 16
of 20 with this module, groups of 12 median against 7).

A trainer already knows who trains with it: the progress records it reads every few seconds name the trainers that
accept connections (``SwarmOptimizer._full_trainers``). Here each declaration a peer stores in the DHT (and its
withdrawal, as its search ends) also goes to those trainers, one small request each (``rpc_declare``, answered with
the receiver's own declaration), and each adds what it receives to what its DHT lookups find: hivemind's search then
sees a known peer's declaration a round trip after it was made, with its true time, so its leader rule works
unchanged, and no peer asks another that could not lead it (asking every known peer instead would make two peers ask
each other at once, each holding hivemind's lock until the other's answer times out). The answers tell a peer that
begins matching who matches already, also those that told it before its averager was up. The DHT lookup goes on in
the background (it finds the peers this one does not know: aux peers, newcomers), and a received declaration ends the
wait for it.

A client-mode peer (behind NAT) declares nothing and cannot be reached: it asks the known trainers to lead it
directly, offered to hivemind's search at its own time every ``ASK_AGAIN`` seconds (one that was not yet matching
answers NOT_LOOKING_FOR_GROUP and is asked again later). Nobody asks a client, so these requests make no cycle.

What a peer is told is its message: only its own declaration counts (the sender is its libp2p identity), for the
group key and tensors of this averager, within ``MAX_AHEAD`` seconds, ``MAX_DECLARED`` peers at most; a false one
costs the receiver a request that the sender refuses or leads as hivemind's rules allow. Its price: a request per
known trainer per declaration (one per matchmaking time while a peer matches): a few a second in a swarm of dozens.

Hooked where hivemind offers no hook: its Matchmaking and GroupKeyManager are built inside the averager's process,
so the key manager's ``declare_averager`` and ``get_averagers`` are wrapped on the instance, once (as
:mod:`.group_quorum` wraps ``look_for_group``); the known trainers reach that process through hivemind's control pipe
(:meth:`DeclaresDirectly.set_known_trainers`) before each round.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from hivemind.averaging.key_manager import GroupKey
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import DHTExpiration, get_dht_time

from lean_transformer.swarm.hivemind_fixes.dht_pacing import LOOKUPS_PER_WINDOW

logger = logging.getLogger(__name__)

ASK_AGAIN = 5.0  # seconds between two offers of the known trainers to a client-mode peer's search
MAX_AHEAD = 600.0  # a declaration further ahead than this is ignored (a round's matchmaking lasts a minute or two)
MAX_DECLARED = 1024  # received declarations kept at most (the live ones of a swarm of dozens)
WITHDRAWN = 0.0  # the expiration of a declaration that withdraws the last one (hivemind's looking_for_group=False)


class DeclaresDirectly:
    """Mixed in front of hivemind's DecentralizedAverager (in its process): declarations go to the known trainers
    directly and what they declare joins the DHT's answers (see the module)."""

    _rpc_handlers = None  # hivemind caches the RPC table per class: this class adds rpc_declare
    _stub_type = None

    def __init__(self, *args: Any, **kwargs: Any):
        self._known: Tuple[PeerID, ...] = ()  # before hivemind's __init__, which starts the averager's process
        self._declared: Dict[PeerID, DHTExpiration] = {}  # received: peer -> its declared time
        self._news = asyncio.Event()  # set when a declaration arrives
        super().__init__(*args, **kwargs)

    def set_known_trainers(self, peer_ids: Sequence[str]) -> None:
        """Called in the trainer's process: the peer IDs (base58) of the trainers its next rounds tell and ask."""
        self._outer_pipe.send(("_set_known", [list(peer_ids)], {}))

    async def _set_known(self, peer_ids: List[str]) -> None:
        known = []
        for peer_id in peer_ids:
            try:
                known.append(PeerID.from_base58(peer_id))
            except Exception:  # a record's claim: what is no peer ID is not asked
                continue
        self._known = tuple(peer for peer in known if peer != self.peer_id)

    async def rpc_declare(self, request: averaging_pb2.JoinRequest, context: P2PContext) -> averaging_pb2.JoinRequest:
        """A peer's declaration (``expiration``; ``WITHDRAWN``: it stopped matching), sent to this peer directly; the
        answer is this peer's own (so a peer that tells the others as it begins matching learns who matches already,
        also those that told it before it was up). With an averaging gate (:mod:`..auth.averaging_gate`), only with
        a peer it admits: else this peer would ask a stranger to lead it."""
        gate = getattr(self, "_gate", None)
        matchmaking = getattr(self, "_matchmaking", None)
        if matchmaking is None or gate is not None and not await gate.admits(context.remote_id, self.prefix):
            return averaging_pb2.JoinRequest()
        self._receive(context.remote_id, request, matchmaking)
        leaders = matchmaking.potential_leaders
        declared = leaders.declared_expiration_time if matchmaking.is_looking_for_group else WITHDRAWN
        key = leaders.declared_group_key or matchmaking.group_key_manager.current_key  # not matching: withdrawn there
        return averaging_pb2.JoinRequest(schema_hash=matchmaking.schema_hash, group_key=key,
                                         expiration=declared if math.isfinite(declared) else WITHDRAWN)

    def _receive(self, peer: PeerID, declaration: averaging_pb2.JoinRequest, matchmaking: Any) -> None:
        """Keep ``peer``'s declaration if it is one for this averager's group key and tensors."""
        if declaration.schema_hash != matchmaking.schema_hash or not isinstance(declaration.expiration, float) or (
                declaration.group_key != matchmaking.group_key_manager.current_key):
            return
        declared, now, expiration = self._declared, get_dht_time(), declaration.expiration
        for stale in [other for other, until in declared.items() if until <= now]:
            del declared[stale]
        if not now < expiration <= now + MAX_AHEAD:  # a withdrawal, or none this peer can use (inf and NaN too)
            declared.pop(peer, None)
            return
        if peer in declared or len(declared) < MAX_DECLARED:
            declared[peer] = expiration
            self._news.set()
            matchmaking.potential_leaders.update_triggered.set()  # hivemind's search looks again now

    async def _step(self, **kwargs: Any) -> None:
        self._declare_directly()
        await super()._step(**kwargs)

    def _declare_directly(self) -> None:
        key_manager = self._matchmaking.group_key_manager
        if getattr(key_manager.get_averagers, "declares_directly", False):
            return
        key_manager.declare_averager = TellsKnown(key_manager.declare_averager, self)
        key_manager.get_averagers = DeclaredAndReceived(key_manager.get_averagers, self)

    async def _tell(self, peer: PeerID, group_key: GroupKey, expiration: DHTExpiration) -> None:
        matchmaking = self._matchmaking
        request = averaging_pb2.JoinRequest(schema_hash=matchmaking.schema_hash, expiration=expiration,
                                            group_key=group_key)
        try:
            stub = type(self).get_stub(self._p2p, peer, namespace=self.prefix)
            answer = await asyncio.wait_for(stub.rpc_declare(request), timeout=matchmaking.request_timeout)
        except Exception as error:  # gone, older, or slow: it still has the DHT
            logger.debug(f"Could not tell {peer} of this peer's declaration: {error!r}")
            return
        self._receive(peer, answer, matchmaking)


class TellsKnown:
    """``GroupKeyManager.declare_averager``: the DHT store, and this peer's own declaration sent to the known trainers
    at once (each request in the background: the store is not held up)."""

    declares_directly = True

    def __init__(self, store: Any, averager: DeclaresDirectly):
        self.store, self.averager = store, averager
        self._telling: Set[asyncio.Task] = set()

    async def __call__(self, group_key: GroupKey, peer_id: PeerID, expiration_time: DHTExpiration,
                       looking_for_group: bool = True) -> bool:
        if peer_id == self.averager.peer_id:
            expiration = expiration_time if looking_for_group else WITHDRAWN
            for peer in self.averager._known:
                task = asyncio.create_task(self.averager._tell(peer, group_key, expiration))
                self._telling.add(task)
                task.add_done_callback(self._telling.discard)
        return await self.store(group_key, peer_id, expiration_time, looking_for_group)


class DeclaredAndReceived:
    """``GroupKeyManager.get_averagers`` as hivemind's search calls it (each time its queue of potential leaders ran
    dry, or a declaration arrived): what the DHT showed, with the declarations received directly; for a client-mode
    peer also the known trainers, at the time of the current offer (hivemind skips a peer and time it asked already).
    The DHT lookups run in the background, paced as :mod:`..hivemind_fixes.dht_pacing` paces hivemind's (at most
    ``LOOKUPS_PER_WINDOW`` per matchmaking time), but a received declaration is returned at once: a call returns when
    one arrives, when the running lookup ends, or when the next lookup (or a client's next offer) is due."""

    declares_directly = paces_lookups = True

    def __init__(self, lookup: Any, averager: DeclaresDirectly):
        self.lookup, self.averager = lookup, averager
        self._running: Optional[asyncio.Task] = None
        self._next_lookup = -math.inf  # time.monotonic() at which the next lookup may start
        self._found: List[Tuple[PeerID, DHTExpiration]] = []
        self._offered_at, self._offered_time, self._offers = -math.inf, -math.inf, 0

    async def __call__(self, group_key: GroupKey, only_active: bool) -> List[Tuple[PeerID, DHTExpiration]]:
        matchmaking = self.averager._matchmaking
        idle = self._running is None or self._running.done()
        if idle and time.monotonic() >= self._next_lookup:
            self._running, idle = asyncio.create_task(self.lookup(group_key, only_active)), False
            self._next_lookup = time.monotonic() + matchmaking.min_matchmaking_time / LOOKUPS_PER_WINDOW
        news = self.averager._news
        asks = matchmaking.client_mode and bool(self.averager._known)
        if not news.is_set():
            due = [self._next_lookup - time.monotonic()] if idle else []
            if asks:
                due.append(self._offered_at + ASK_AGAIN - get_dht_time())
            waiting = asyncio.create_task(news.wait())
            await asyncio.wait({waiting} if idle else {waiting, self._running}, return_when=asyncio.FIRST_COMPLETED,
                               timeout=max(0.0, min(due)) if due else None)
            waiting.cancel()
        news.clear()
        running = self._running
        if running is not None and running.done() and not running.cancelled() and running.exception() is None:
            self._found = running.result()
        now = get_dht_time()
        declared = dict((peer, until) for peer, until in self._found if until > now)
        declared.update((peer, until) for peer, until in self.averager._declared.items() if until > now)
        if asks:
            if now - self._offered_at >= ASK_AGAIN or self._offered_time <= now:
                self._offer(now)
            if self._offered_time > now:
                declared.update((peer, self._offered_time) for peer in self.averager._known if peer not in declared)
        return list(declared.items())

    def _offer(self, now: float) -> None:
        """Offer the known trainers anew to a client's search: at its own request's time (hivemind's queue pops only
        leaders declared no later), distinct from the earlier offers' times."""
        matchmaking = self.averager._matchmaking
        own = min(max(matchmaking.step_control.scheduled_time, now + matchmaking.min_matchmaking_time),
                  matchmaking.potential_leaders.search_end_time)
        self._offers += 1
        self._offered_at, self._offered_time = now, own - 1e-3 * self._offers
