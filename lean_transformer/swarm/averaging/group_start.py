"""A client-mode peer asks a groupmate whether its prepared group has begun the all-reduce.

A DiLoCo round's group forms before the round ends (:meth:`.diloco.OuterLoop.prepare`) and waits for each member's
trigger; a member pulls it when its own view of the swarm shows the round's end, or when a groupmate's part reaches it
(:meth:`.diloco.OuterLoop.group_began`): that view is a DHT lookup old, and a peer whose lookups lag learns of the end
from its groupmates. A client-mode peer (behind NAT) reduces nothing, so no part reaches it: it trained on while its
groupmates waited for its parts, and after ``sparse_allreduce.ABSENT_AFTER`` (20 s) they averaged without it.
benchmarks/internet.py (16 DiLoCo trainers, seed 2, every link 20 Mbit/s and 100 ms, DHT lookups of 9 s at the
median): three of the four client-mode trainers ended their epoch 38-56 s after their group (14 trainers or more)
had begun, its reducers dropped them as absent, and they missed that round: the only trainers below 90% of their
rounds in that run.

Here, while its prepared group awaits its trigger, a client-mode peer asks one full groupmate every
:data:`ASK_EVERY` seconds, in turn, whether the group has begun (``rpc_group_began`` with the group's ID; answered
``BEGIN_ALLREDUCE`` once the answering peer began it or a part for it arrived there), and a yes tells its host process
what an arriving part tells a full peer's. Its price: one small request per client every :data:`ASK_EVERY` seconds
while its group waits, a few per round. A groupmate that says yes falsely ends the asker's epoch early, as a part it
sent early would: nothing a groupmate could not do already.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import time
from typing import Any, Deque, Optional, Set

from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError
from hivemind.proto import averaging_pb2

ASK_EVERY = 2.0  # seconds between two questions of a client-mode peer whose prepared group awaits its trigger
ASK_TIMEOUT = 10.0  # seconds an answer may take (a request on a busy peer over a slow link takes seconds)


class TellsGroupStart:
    """Mixed in front of hivemind's DecentralizedAverager (in its process) of :class:`.diloco._Averager`, whose
    ``groupmate_began`` (shared with the host process) a client-mode peer sets when a groupmate says its group has
    begun. The averager calls :meth:`note_group_started` for each group it begins and each part it receives."""

    _rpc_handlers = None  # hivemind caches the RPC table per class: this class adds rpc_group_began
    _stub_type = None

    def __init__(self, *args: Any, **kwargs: Any):
        self._started_groups: Deque[bytes] = collections.deque(maxlen=64)  # begun here, or a part for it came
        self._awaited_group: Optional[bytes] = None  # the group this client-mode peer's round waits in
        self._askers: Set[asyncio.Task] = set()
        super().__init__(*args, **kwargs)

    def note_group_started(self, group_id: bytes) -> None:
        if group_id not in self._started_groups:
            self._started_groups.append(group_id)

    async def rpc_group_began(self, request: averaging_pb2.AveragingData, context: P2PContext
                              ) -> averaging_pb2.AveragingData:
        began = request.group_id in self._started_groups
        return averaging_pb2.AveragingData(code=averaging_pb2.BEGIN_ALLREDUCE if began else averaging_pb2.NO_CODE)

    async def _step(self, *, step: StepControl, **kwargs: Any) -> None:
        if self.client_mode:
            self._ask_once_grouped()
        await super()._step(step=step, **kwargs)

    def _ask_once_grouped(self) -> None:
        """Wrap the matchmaking's ``look_for_group`` (once): a group found starts :meth:`_ask_whether_began`."""
        matchmaking = self._matchmaking
        look_for_group = matchmaking.look_for_group
        if getattr(look_for_group, "asks_group_start", False):
            return

        async def look_for_group_and_ask(step: StepControl) -> Optional[GroupInfo]:
            group = await look_for_group(step)
            if group is not None and not step.triggered:
                self._awaited_group = group.group_id
                asker = asyncio.create_task(self._ask_whether_began(group, step))
                self._askers.add(asker)
                asker.add_done_callback(self._askers.discard)
            return group

        look_for_group_and_ask.asks_group_start = True
        matchmaking.look_for_group = look_for_group_and_ask

    async def _ask_whether_began(self, group: GroupInfo, step: StepControl) -> None:
        """Ask ``group``'s full members in turn until one says it has begun, or this peer's round stops waiting
        in that group."""
        full = [peer for peer, data in zip(group.peer_ids, group.gathered)
                if peer != self.peer_id and AveragingMode(self.serializer.loads(data)[1]) != AveragingMode.CLIENT]
        for asked in itertools.count():
            await asyncio.sleep(ASK_EVERY)
            if (not full or step.triggered or step.done() or step.stage != AveragingStage.AWAITING_TRIGGER
                    or self._awaited_group != group.group_id):
                return
            stub = type(self).get_stub(self._p2p, full[asked % len(full)], namespace=self.prefix)
            try:
                answer = await asyncio.wait_for(
                    stub.rpc_group_began(averaging_pb2.AveragingData(group_id=group.group_id)), ASK_TIMEOUT)
            except (asyncio.TimeoutError, P2PDaemonError, P2PHandlerError, ConnectionError):
                continue  # a groupmate that left, or is slow to answer: the next one is asked
            if answer.code == averaging_pb2.BEGIN_ALLREDUCE:
                self.groupmate_began.value = time.time()
                return
