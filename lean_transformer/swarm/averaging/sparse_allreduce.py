"""Top-k pseudo-gradients with error feedback (SparseLoCo-style), all-reduced sparsely over hivemind's partition.

Each peer sends the ``fraction`` largest values of each pseudo-gradient tensor (plus what earlier rounds left unsent,
the *error*), as int32 indices and float16 values. The group's reducers split the flattened parameter vector into
contiguous ranges by hivemind's load balancing, as its dense all-reduce does (client-mode peers reduce nothing; aux
peers reduce and send nothing). Each sender sends every reducer the entries of its top-k that fall in that reducer's
range, with its weight; the reducer sums the weighted values of all senders, divides by the total weight and answers
every sender with the same sparse average (the union of the senders' indices, float16 values). Its own share goes
through the same float16 rounding, so every peer ends with bit-identical averages, and a peer sends about its
payload and receives about the union, not the n-1 payloads of an all-gather.

Why not the first version's transport, hivemind's matchmaking ``gather``: the leader relays every member's payload to
every member (n payloads each), inside matchmaking requests whose timeout is a few seconds; at 20 Mbit/s a 1.5 MB
payload did not fit and the first outer round never formed a group (``benchmarks/results/wan.json``). Here the
payloads travel in the all-reduce phase, under the round's all-reduce timeout. No kept library all-reduces sparse
tensors over hivemind; the wire messages are hivemind's own (``AveragingData``), served by the averager's
``rpc_aggregate_part`` (see :class:`lean_transformer.swarm.averaging.diloco._Averager`).

``aggregation="centered_clip"``: the reducer keeps each sender's sparse part and answers with
:func:`..robust.centered_clip` of the senders' parts as dense vectors of its range (a value not sent is a 0, as in the
mean: the weighted mean of those vectors is exactly the sum above over the total weight), computed on the union of the
sent indices only (elsewhere every input is 0, so the result is too, and the distances are the same): at most
senders x k columns, not the range. An honest top-k part is as far from the others as they are from each other
(different supports, alike sizes): not clipped, the result is the mean; a part scaled x1000 is clipped to tau.

``check_answers`` (CenteredClip, for a peer whose contribution is at least a fifth of the group's median and whose
outer state is its group's, see ``diloco.checks_answers``): once every answer has arrived (and this peer has
answered its senders), each reducer's answer is checked against this peer's own entries in its range
(:func:`..answer_check.sparse_share_problem`, with the norm bound ``max_ratio``); one that fails emits
``answer_rejected``, strikes its reducer and fails the round for this peer alone, as in the dense all-reduce
(:mod:`.answer_check`). With ``gross_ratio`` (every peer, under CenteredClip), each answer is first held to
:func:`..answer_check.gross_problem`: a share that fails it is taken as zeros by every member alike, the round goes
on, and its reducer is excluded at once.

A sender that sent nothing within :data:`ABSENT_AFTER` seconds of the group forming is not in the round (its round
was cancelled after the leader had counted it in, or it stopped): a reducer then fails the round at once, and its
senders with it, instead of holding the whole group until the all-reduce timeout. Seen in benchmarks/internet.py
(6 DiLoCo trainers): a trainer cancelled its round as it downloaded a state, and a group of 6 waited 47 s. Where
every absent sender reduces nothing (client mode), the reducer instead finishes its range without them
(``sender_dropped``) and the round goes on: the group lost a contribution, not a range. Seen in
benchmarks/internet.py (16 DiLoCo trainers): hivemind's leader counted in a client-mode follower that had given up
waiting for its answer (3 s) and averaged in another group, and the group of 15 failed its round for it. A dropped
sender that comes late is refused (``CANCELLED``): its own round fails, and its update folds into its next one.

A round with a reducer missing, or a sender that reduces, fails as a whole (a missed round: hivemind retries it
within its deadline), and the error feedback changes only when a round succeeded (``commit``).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import AsyncIterator, Awaitable, Dict, List, Optional, Sequence, Tuple

import torch
from hivemind.averaging.allreduce import AllreduceException, AveragingMode
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import as_aiter

from lean_transformer.swarm.averaging.answer_check import (MAX_RATIO, gross_problem, reject_answer, sparse_share_problem,
                                                           sparse_sums)
from lean_transformer.swarm.averaging.exclusion import Exclusions
from lean_transformer.swarm.averaging.robust import check_aggregation, clip_and_distances, strike_far_out
from lean_transformer.swarm.monitoring.events import emit

logger = logging.getLogger(__name__)
Sparse = Tuple[torch.Tensor, torch.Tensor]  # (int32 indices, float16 values)
# a sender that opened no stream to a reducer this long after its group formed is taken as absent: time for the
# leader's word to reach every member, for a busy peer to start its round and compute its top-k (a few seconds for a
# large model); the payloads' transfer, which depends on the links, comes after the stream is open
ABSENT_AFTER = 20.0
FLOAT16_MAX = float(torch.finfo(torch.float16).max)


def _retrieve(future: asyncio.Future) -> None:
    """A done-callback that reads the future's outcome, so that asyncio never reports it as unretrieved."""
    if not future.cancelled():
        future.exception()


def gather_retrieved(*awaitables: Awaitable) -> asyncio.Future:
    """``asyncio.gather`` whose outcome is always retrieved. A gather cancelled from outside ends with a
    ``CancelledError`` set as its exception (CPython 3.11), and ``wait_for`` re-raises its own cancellation without
    reading it: asyncio then logs "_GatheringFuture exception was never retrieved" with a traceback as an ERROR. Seen
    in benchmarks/internet.py (DiLoCo, 16 trainers): trainers that cancelled their round to download the state."""
    gathered = asyncio.gather(*awaitables)
    gathered.add_done_callback(_retrieve)
    return gathered


class TopKErrorFeedback:
    """Top-k sparsification with error feedback over a list of tensors seen as one flat vector: ``compress`` picks the
    ``fraction`` largest magnitudes of each tensor of ``delta + error`` and returns their flat indices (int64, sorted)
    and float16 values; it keeps exactly what it did not send (float16 rounding included) as the next error once
    ``commit()`` is called (a round that succeeded). Without ``commit`` (a failed round, whose progress folds into
    the next pseudo-gradient) the error stays as it was."""

    def __init__(self, shapes: Sequence[torch.Size], fraction: float):
        self.check_fraction(fraction)
        self.fraction, self.shapes = fraction, [torch.Size(shape) for shape in shapes]
        self.error = torch.zeros(sum(math.prod(shape) for shape in self.shapes))
        self._pending: Optional[torch.Tensor] = None

    @staticmethod
    def check_fraction(fraction: float) -> None:
        """Raise ValueError unless ``fraction`` is in (0, 1] (a peer checks it before it starts its averager)."""
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction (--outer_topk_fraction) must be in (0, 1], got {fraction}")

    @torch.no_grad()
    def compress(self, deltas: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        corrected = torch.cat([delta.detach().float().flatten() for delta in deltas]) + self.error
        chosen, offset = [], 0
        for shape in self.shapes:
            size = math.prod(shape)
            k = max(1, math.ceil(self.fraction * size))
            chosen.append(corrected[offset:offset + size].abs().topk(k, sorted=False).indices.sort().values + offset)
            offset += size
        indices = torch.cat(chosen)
        values = corrected[indices].clamp(-FLOAT16_MAX, FLOAT16_MAX).to(torch.float16)  # no inf from a large value
        corrected[indices] -= values.float()  # what was not sent, rounding and clamping included
        self._pending = corrected
        return indices, values

    def commit(self) -> None:
        if self._pending is not None:
            self.error, self._pending = self._pending, None


def _entries_in(indices: torch.Tensor, values: torch.Tensor, start: int, end: int) -> Sparse:
    """The entries of (sorted flat ``indices``, ``values``) in [start, end), indices relative to ``start``."""
    first, last = torch.searchsorted(indices, torch.tensor([start, end])).tolist()
    return (indices[first:last] - start).to(torch.int32), values[first:last]


def part_bounds(peer_fractions: Sequence[float], total_size: int) -> List[int]:
    """Where each peer's range of the flat vector starts, and the end: ``len(peer_fractions) + 1`` offsets."""
    total_fraction = sum(peer_fractions)
    if not total_fraction > 0:
        raise AllreduceException("no peer in the group can reduce (all are in client mode)")
    bounds, cumulative = [0], 0.0
    for fraction in peer_fractions:
        cumulative += fraction
        bounds.append(round(cumulative / total_fraction * total_size))
    bounds[-1] = total_size
    return bounds


def _serialize(tensor: torch.Tensor) -> runtime_pb2.Tensor:
    return serialize_torch_tensor(tensor, runtime_pb2.CompressionType.NONE)


def read_sparse_part(indices: runtime_pb2.Tensor, values: runtime_pb2.Tensor, size: int) -> Sparse:
    """Deserialize a sparse part of a range of ``size`` values, refusing one too large to be valid before it is
    allocated; ValueError naming the problem."""
    for tensor, itemsize in ((indices, 4), (values, 2)):
        if len(tensor.buffer) > itemsize * size + 64:
            raise ValueError(f"a part of {len(tensor.buffer)} bytes for a range of {size} values")
    return check_sparse_part(deserialize_torch_tensor(indices), deserialize_torch_tensor(values), size)


def check_sparse_part(indices: torch.Tensor, values: torch.Tensor, size: int) -> Sparse:
    """The pair, if it is a valid sparse part of a range of ``size`` values; ValueError naming the problem if not."""
    if indices.dtype != torch.int32 or values.dtype != torch.float16 or indices.dim() != 1 or values.dim() != 1:
        raise ValueError(f"a sparse part must be 1-d int32 indices and float16 values, got {indices.dtype} "
                         f"{tuple(indices.shape)} and {values.dtype} {tuple(values.shape)}")
    if len(indices) != len(values):
        raise ValueError(f"{len(indices)} indices for {len(values)} values")
    if len(indices) and (indices.min() < 0 or indices.max() >= size):
        raise ValueError(f"an index outside the range of {size} values")
    if len(indices) > 1 and not (indices[1:] > indices[:-1]).all():
        raise ValueError("indices not strictly increasing")
    if not torch.isfinite(values).all():
        raise ValueError("a non-finite value")
    return indices, values


def sparse_centered_clip(parts: Sequence[Tuple[float, torch.Tensor, torch.Tensor]], union: torch.Tensor,
                         size: int) -> Tuple[torch.Tensor, List[Optional[float]]]:
    """CenteredClip of sparse ``parts`` ((weight, int64 indices, float32 values) per sender, in a range of ``size``)
    as dense vectors with 0 where a sender sent nothing, at the ``union`` of their indices (sorted; the result is 0
    elsewhere): the values there, float32, and each part's distance from them in units of tau
    (:func:`..robust.clip_and_distances`: the same over the range, where the rest is 0 in every vector)."""
    column = torch.full((size,), -1, dtype=torch.long)
    column[union] = torch.arange(len(union))
    rows = []
    for _, indices, values in parts:
        row = torch.zeros(len(union))
        row[column[indices]] = values
        rows.append(row)
    if not rows:
        return torch.zeros(len(union)), []
    return clip_and_distances(rows, [weight for weight, _, _ in parts])


class SparseAllReduce:
    """One sparse all-reduce round of a formed group (see the module docstring); hivemind's averager serves it like
    its own ``AllReduceRunner``: incoming parts for ``group_id`` go to :meth:`rpc_aggregate_part`.

    ``run(indices, values)`` (flat int64 indices, float16 values; ``None`` for an aux peer) returns the group's
    weighted average (``aggregation`` "mean") or CenteredClip (``"centered_clip"``) as a dense float32 vector of
    ``total_size`` (``None`` for an aux peer) or raises ``AllreduceException``. Every wait is bounded by ``timeout``
    seconds. With ``exclusions`` (CenteredClip; one round each), this peer's range gives an excluded sender's part
    weight 0 and strikes a sender whose part ended far out, as the dense reducer does (:mod:`.exclusion`).
    """

    def __init__(self, *, p2p: P2P, servicer_type: type[ServicerBase], prefix: Optional[str], group_id: bytes,
                 ordered_peer_ids: Sequence[PeerID], modes: Sequence[AveragingMode], peer_fractions: Sequence[float],
                 total_size: int, weight: float, timeout: float, aggregation: str = "mean",
                 exclusions: Optional[Exclusions] = None, check_answers: bool = False,
                 opened: Optional[Dict[PeerID, float]] = None, absent_after: float = ABSENT_AFTER,
                 max_ratio: float = MAX_RATIO, gross_ratio: Optional[float] = None, min_cosine: float = 0.0):
        self.aggregation = check_aggregation(aggregation)
        self.exclusions, self.check_answers, self.max_ratio = exclusions, check_answers, max_ratio
        self.min_cosine = min_cosine
        self.gross_ratio = gross_ratio
        self.rejected = False  # an answer failed the check (check_answers)
        if exclusions is not None:
            exclusions.begin_round()
        self._parts: List[Tuple[float, torch.Tensor, torch.Tensor]] = []  # centered_clip: (weight, indices, values)
        self._part_senders: List[str] = []  # centered_clip: the senders of _parts ("" for this peer)
        if len(modes) != len(ordered_peer_ids) or len(peer_fractions) != len(ordered_peer_ids):
            raise AllreduceException("the group's modes or fractions do not match its peers")
        self.p2p, self.servicer_type, self.prefix, self.group_id = p2p, servicer_type, prefix, group_id
        self.peer_id, self.total_size, self.weight, self.timeout = p2p.peer_id, total_size, weight, timeout
        self.senders = {peer for peer, mode in zip(ordered_peer_ids, modes) if mode != AveragingMode.AUX}
        bounds = part_bounds(peer_fractions, total_size)
        self.ranges: Dict[PeerID, Tuple[int, int]] = {
            peer: (start, end) for peer, start, end in zip(ordered_peer_ids, bounds[:-1], bounds[1:]) if end > start}
        start, end = self.ranges.get(self.peer_id, (0, 0))
        self._sum, self._touched = torch.zeros(end - start), torch.zeros(end - start, dtype=torch.bool)
        self._weight, self._arrived, self.dropped = 0.0, set(), set()
        self._result: asyncio.Future = asyncio.get_running_loop().create_future()
        self._result.add_done_callback(_retrieve)
        if not self.senders or self.peer_id not in self.ranges:
            self._result.set_result(None)  # nothing to reduce here
        # when each sender last opened a stream to this peer (time.monotonic(); the averager's record, which sees a
        # stream open before its first message has arrived)
        self.opened = {} if opened is None else opened
        self._formed = time.monotonic()
        if not self._result.done():
            watchdog = asyncio.create_task(self._watch_for_absent(absent_after))
            self._result.add_done_callback(lambda _: watchdog.cancel())

    async def run(self, indices: Optional[torch.Tensor], values: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        try:
            if indices is None:  # an aux peer: reduce its range for the others
                await asyncio.wait_for(asyncio.shield(self._result), self.timeout)
                return None
            if self.peer_id not in self.senders:
                raise AllreduceException("a peer without a part to send (an aux peer) was given one")
            exchanges = [self._exchange(peer, start, end, indices, values)
                         for peer, (start, end) in self.ranges.items()]
            averages = await asyncio.wait_for(gather_retrieved(*exchanges), self.timeout)
        except asyncio.TimeoutError:
            raise AllreduceException(f"the sparse all-reduce did not finish within {self.timeout} s") from None
        finally:
            self._fail(AllreduceException("the local round ended before every sender arrived"))
        if self.check_answers or self.gross_ratio is not None:
            averages = list(averages)
            self._check(indices, values, averages)
        dense = torch.zeros(self.total_size)
        for (start, _), (part_indices, part_values) in zip(self.ranges.values(), averages):
            dense[start + part_indices.long()] = part_values.float()
        return dense

    async def _exchange(self, peer: PeerID, start: int, end: int, indices: torch.Tensor, values: torch.Tensor
                        ) -> Sparse:
        """Send ``peer`` the entries of its range, get back its sparse average."""
        part = _entries_in(indices, values, start, end)
        if peer == self.peer_id:
            try:
                self._accumulate(peer, self.weight, *part)
            except ValueError as error:  # e.g. a bad sender failed the round first
                raise AllreduceException(f"own part: {error}") from None
            return await asyncio.shield(self._result)
        stub = self.servicer_type.get_stub(self.p2p, peer, namespace=self.prefix)
        answers = []
        try:
            stream = await stub.rpc_aggregate_part(as_aiter(
                averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=self.group_id,
                                            weight=self.weight, tensor_part=_serialize(part[0])),
                averaging_pb2.AveragingData(tensor_part=_serialize(part[1]))))
            async for answer in stream:
                answers.append(answer)
                if len(answers) > 2:  # a reducer that goes on sending: no need to read it all
                    break
        except (P2PDaemonError, P2PHandlerError, ConnectionError) as error:
            # e.g. it left the swarm mid-round ("protocols not supported"): a failed round, not a bug to trace
            raise AllreduceException(f"reducer {peer} is unreachable: {error}") from None
        if len(answers) != 2 or answers[0].code != averaging_pb2.AVERAGED_PART:
            codes = [averaging_pb2.MessageCode.Name(answer.code) for answer in answers]
            raise AllreduceException(f"reducer {peer} answered {codes} instead of a sparse average")
        try:
            return read_sparse_part(answers[0].tensor_part, answers[1].tensor_part, end - start)
        except ValueError as error:
            raise AllreduceException(f"reducer {peer} sent a bad average: {error}") from None

    async def _watch_for_absent(self, after: float) -> None:
        """``after`` s from now, drop the senders that have not opened a stream here if none of them reduces a range,
        else fail the round (see the module docstring)."""
        await asyncio.sleep(after)
        absent = {peer for peer in self.senders - self._arrived
                  if peer != self.peer_id and self.opened.get(peer, -math.inf) < self._formed - after}
        if not absent or self._result.done():
            return
        names = ", ".join(sorted(peer.to_base58() for peer in absent))
        if absent & self.ranges.keys():
            self._fail(AllreduceException(f"{len(absent)} sender(s) sent nothing within {after:g} s of the group "
                                          f"forming, not in this round: {names}"))
            return
        logger.info(f"Averaging this peer's range without {len(absent)} client-mode sender(s) that sent nothing within "
                    f"{after:g} s of the group forming: {names}")
        self.senders -= absent
        self.dropped |= absent
        for peer in absent:
            emit("sender_dropped", source=peer.to_base58(), seconds=after)
        self._finish_if_complete()

    def _check(self, indices: torch.Tensor, values: torch.Tensor, averages: List[Sparse]) -> None:
        """Check every other reducer's answer against this peer's entries in its range (see the module docstring):
        a gross lie's answer becomes empty (zeros) in ``averages``, a failed full check fails the round."""
        problems = []
        for position, ((peer, (start, end)), average) in enumerate(zip(self.ranges.items(), averages)):
            if peer == self.peer_id:
                continue
            own = _entries_in(indices, values, start, end)
            sums = sparse_sums(own, average)
            xx, vv, _, size = sums
            reason = None if self.gross_ratio is None else gross_problem(xx, vv, size, self.gross_ratio)
            gross = reason is not None
            if not gross and self.check_answers:
                reason = sparse_share_problem(own, average, max_ratio=self.max_ratio, sums=sums,
                                              min_cosine=self.min_cosine)
            if reason is None:
                continue
            self.rejected = True
            reject_answer(self.exclusions, peer.to_base58(), reason, end - start, gross)
            if gross:
                averages[position] = (average[0][:0], average[1][:0])
            else:
                problems.append(f"reducer {peer.to_base58()}: {reason}")
        if problems:
            raise AllreduceException(f"answers failed the check: {'; '.join(problems)}")

    def _accumulate(self, sender: PeerID, weight: float, indices: torch.Tensor, values: torch.Tensor) -> None:
        """Add a checked sparse part of this peer's range (``check_sparse_part``) from ``sender``."""
        if sender in self._arrived:
            raise ValueError(f"{sender} sent twice")
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight {weight}")
        if self._result.done():
            raise ValueError("the round has ended")
        if self.aggregation == "mean":
            self._sum.index_add_(0, indices.long(), values.float() * weight)
        else:
            source = "" if sender == self.peer_id else sender.to_base58()
            excluded = self.exclusions is not None and source and self.exclusions.is_excluded(source)
            self._parts.append((0.0 if excluded else weight, indices.long(), values.float()))
            self._part_senders.append(source)
        self._touched[indices.long()] = True
        self._weight += weight
        self._arrived.add(sender)
        self._finish_if_complete()

    def _finish_if_complete(self) -> None:
        """Answer the range's average once every (not dropped) sender's part has arrived."""
        if self._arrived == self.senders and not self._result.done():
            union = self._touched.nonzero().flatten()
            if self.aggregation == "mean":
                average = self._sum[union] / self._weight if self._weight > 0 else torch.zeros(len(union))
            else:
                average, distances = sparse_centered_clip(self._parts, union, len(self._sum))
                strike_far_out(self.exclusions, self._part_senders, [weight for weight, _, _ in self._parts],
                               distances, len(self._sum))
            self._result.set_result((union.to(torch.int32), average.to(torch.float16)))

    def _fail(self, error: Exception) -> None:
        if not self._result.done():
            self._result.set_exception(error)

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A sender's part of this peer's range (two messages: indices with the weight, then values); answers the
        range's sparse average once every sender's part arrived. A bad part fails the round for the whole group.
        The averager's handler, which calls this one, delivers the answers (``AnswersDelivered``)."""
        sender = context.remote_id
        self.opened[sender] = time.monotonic()
        try:
            head = await asyncio.wait_for(anext(stream), self.timeout)
            if head.group_id != self.group_id:
                yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
                return
            if sender in self.dropped:  # too late: the range was averaged without it
                yield averaging_pb2.AveragingData(code=averaging_pb2.CANCELLED)
                return
            if sender not in self.senders:  # a stranger, or an aux peer: refused, the round goes on
                yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
            body = await asyncio.wait_for(anext(stream), self.timeout)
            if head.code != averaging_pb2.PART_FOR_AVERAGING:
                raise ValueError(f"unexpected {averaging_pb2.MessageCode.Name(head.code)}")
            if self.peer_id not in self.ranges:
                raise ValueError("this peer reduces no range")
            self._accumulate(sender, head.weight, *read_sparse_part(head.tensor_part, body.tensor_part,
                                                                   len(self._sum)))
        except (ValueError, TypeError, RuntimeError, StopAsyncIteration, asyncio.TimeoutError) as error:
            self._fail(AllreduceException(f"sender {sender}: {error!r}"))
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        try:
            indices, values = await asyncio.wait_for(asyncio.shield(self._result), self.timeout)
        except (AllreduceException, asyncio.TimeoutError):
            yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
            return
        yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=_serialize(indices))
        yield averaging_pb2.AveragingData(tensor_part=_serialize(values))
