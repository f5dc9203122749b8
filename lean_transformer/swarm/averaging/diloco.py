"""DiLoCo's outer loop: peers take many local optimizer steps, then average how far they moved and step together.

A round starts from shared parameters (the *anchor*). Each peer trains on its own (the task's 8-bit LAMB, offloaded,
one local step per ``optimizer.step``); its *pseudo-gradient* is then ``anchor - parameters``. The swarm all-reduces
the pseudo-gradients, weighted by the samples each peer processed, and every peer applies the same outer step to the
anchor: SGD with Nesterov momentum (DiLoCo's outer optimizer), after which the parameters restart from the new
anchor. Since every peer applies the same step to the same anchor with the same momentum, the peers stay identical
without exchanging parameters.

How it runs in a swarm (:class:`~lean_transformer.swarm.averaging.optimizer.SwarmOptimizer` given
:class:`DiLoCoSettings`): the inner loop is ``hivemind.Optimizer(use_local_updates=True)``
(a local LAMB step on each ``step``; hivemind's progress tracker counts the swarm's samples), so a round is hivemind's
epoch and ends when the swarm has processed ``local_steps x target_batch_size`` samples: with ``target_batch_size`` =
the swarm's samples per inner step, each peer takes about ``local_steps`` inner steps, a faster peer more, a slower one
fewer. The anchor and the outer momentum are hivemind's ``extra_tensors``, so newcomers download them with the inner
optimizer state (through the validated downloads of :mod:`..hivemind_fixes.state_download`) and restart from the anchor.
A round that fails (no group, a broken all-reduce) leaves the anchor where it is: the peer's progress and samples fold
into its next round. A peer alone in the swarm (no other peer reports training speed; aux peers report none) steps
with its own pseudo-gradient.

Every peer must end a round with the same average, or the anchors drift apart. hivemind's all-reduce returns each peer
``own part + decompress(compress(average - own part))``, which differs between peers under a lossy codec; here the
reducer sends the compressed average itself and decodes its own part the same way (:class:`_SameResultRunner`), so all
peers apply bit-identical averages. Top-k (``outer_compression="topk"``) sends each peer's largest values with error
feedback, SparseLoCo-style, through a sparse all-reduce over the same partition
(:mod:`lean_transformer.swarm.averaging.sparse_allreduce`), whose reducers answer every peer with the same sparse average.

With ``overlap`` the all-reduce of round t runs in the background while round t+1 trains, and its outer step is applied
as soon as the all-reduce is over (between two local steps of round t+1; at the end of round t+1 at the latest): the
anchor then moves by the swarm's average of round t, and the peer carries its own round-(t+1) progress on top of the
new anchor.

Built from kept parts: the outer step is ``torch.optim.SGD(nesterov=True)`` on the anchor tensors, the all-reduce is
hivemind's ``DecentralizedAverager`` (with the cancel fixes of :mod:`..hivemind_fixes.averagers`). Ours: the round
bookkeeping and the same-result runner (hivemind has no such mode).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import logging
import math
import multiprocessing as mp
import statistics
import threading
import time
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import (Any, AsyncIterator, Callable, Collection, Deque, Iterable, Iterator, List, Mapping, Optional,
                    Sequence, Tuple)

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.partition import BannedException
from hivemind.compression import (CompressionBase, CompressionInfo, NoCompression, deserialize_torch_tensor,
                                  serialize_torch_tensor)
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import achain, amap_in_executor, as_aiter

from lean_transformer.swarm.auth.averaging_gate import AveragingGate, GatedRPCs
from lean_transformer.swarm.averaging.answer_check import GROSS_RATIO, ChecksAnswers
from lean_transformer.swarm.hivemind_fixes.averagers import CancelSafe, end_step_without_retry, give_up, serving_only
from lean_transformer.swarm.hivemind_fixes.control_pipe import WholeControlMessages
from lean_transformer.swarm.hivemind_fixes.stream_answers import AnswersDelivered
from lean_transformer.swarm.averaging.round_events import ReportsRounds
from lean_transformer.swarm.averaging.exclusion import Exclusions, RefusesExcluded
from lean_transformer.swarm.averaging.group_quorum import RematchesMinorityGroups
from lean_transformer.swarm.averaging.group_start import TellsGroupStart
from lean_transformer.swarm.averaging.direct_declarations import DeclaresDirectly
from lean_transformer.swarm.averaging.outer_history import (HISTORY_BYTES_PER_VALUE, HISTORY_OUTSIDERS, OuterHistory,
                                                            ServesOuterHistory, history_key, path_to)
from lean_transformer.swarm.averaging.robust import CenteredClipReduction, check_aggregation, robust_exclusions
from lean_transformer.swarm.averaging.sparse_allreduce import SparseAllReduce, TopKErrorFeedback
from lean_transformer.swarm.monitoring.events import emit

logger = logging.getLogger(__name__)

NEVER = 2**62  # average_state_every in DiLoCo mode: hivemind never averages parameters itself


@dataclass(frozen=True)
class DiLoCoSettings:
    """DiLoCo mode (``--local_steps``): an outer round every ``local_steps`` inner steps (of the swarm's target batch
    each), outer SGD-Nesterov with ``outer_lr`` and ``outer_momentum``, ``overlap`` (a one-round-delayed outer
    update), and the pseudo-gradients sent with ``compression`` or, with ``topk_fraction``, as top-k values;
    ``branch_depth``: with top-k, the outer states a peer keeps from before its last outer steps (``OuterLoop``)."""

    local_steps: int
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    overlap: bool = False
    compression: CompressionBase = NoCompression()
    topk_fraction: Optional[float] = None
    branch_depth: int = 0


class RoundProgress(ProgressTracker):
    """hivemind's progress tracker, except that a peer alone in the swarm ends a round on its own samples, never on an
    estimate of them nor on the swarm's count read back from the DHT.

    hivemind also ends an epoch once the time it estimated for the swarm to reach the target has passed, which keeps
    a group together when a peer stops reporting. A lone peer has no group: the estimate is its own speed, and a few
    local steps slower than its average (a busy machine) end its round early, with fewer local steps than its
    ``local_steps``; and the count it reads back can lag behind its own, which ends a round late. Reproduced by
    ``tests/test_diloco.py`` (``test_a_lone_peer_ends_a_round_on_its_samples``); it made the host-gradient comparison
    of ``tests/test_trainer_host_gradients.py`` take different steps on a loaded box.

    In a swarm, a round also ends when a groupmate of this peer's prepared round has begun its all-reduce
    (``group_began``, set by SwarmOptimizer to :meth:`OuterLoop.group_began`)."""

    group_began: Callable[[], bool] = staticmethod(lambda: False)

    @property
    def ready_to_update_epoch(self) -> bool:
        progress = self.global_progress
        if progress.num_peers <= 1 and self.global_epoch <= self.local_progress.epoch:
            return self.local_progress.samples_accumulated >= self.target_batch_size
        return super().ready_to_update_epoch or self.group_began()


def host_float32(tensor: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """``tensor`` as float32 in host memory (a copy, or with ``copy=False`` the tensor itself where it already is)."""
    return tensor.detach().to("cpu", torch.float32, copy=copy)


class OuterNesterov:
    """The outer optimizer's state: float32 anchor copies of ``parameters`` and SGD-Nesterov momentum over them.

    ``pseudo_gradients()`` gives ``anchor - parameters`` (float32, fresh tensors); ``step(averaged)`` applies one outer
    step to the anchor with ``averaged`` as its gradient and copies the new anchor into the parameters.
    ``state_tensors()`` are the live anchor and momentum tensors (hivemind shares and loads them in place).

    The outer state lives in host memory whatever the parameters' device: 8 bytes per parameter that a trainer's GPU
    need not hold, beside the offloaded optimizer and the averagers, which send it from there. Pseudo-gradients are
    taken on the host; new anchors are copied to the parameters' device. Before, the anchor was copied on the
    model's GPU, then bound to the offloaded optimizer's host copies, and every DiLoCo trainer on a GPU stopped at its
    first outer step ("found at least two devices, cuda:0 and cpu"; seen on a lent H100 by
    ``tests/test_trainer_host_gradients.py`` and ``tests/test_diloco_swarm.py``; ``tests/test_diloco.py`` holds a
    CUDA test of it).
    """

    def __init__(self, parameters: Iterable[torch.Tensor], lr: float = 0.7, momentum: float = 0.9):
        self.parameters: List[torch.Tensor] = list(parameters)
        if not self.parameters:
            raise ValueError("parameters: OuterNesterov needs at least one tensor")
        if not lr > 0:
            raise ValueError(f"lr (--outer_lr) must be positive, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum (--outer_momentum) must be in [0, 1), got {momentum}")
        self.anchor = [host_float32(param) for param in self.parameters]
        self.momenta = [torch.zeros_like(anchor) for anchor in self.anchor]
        self.steps = torch.zeros(1, dtype=torch.float64)  # outer steps the anchor has taken (shared with it)
        self.optimizer = torch.optim.SGD(self.anchor, lr=lr, momentum=momentum, nesterov=momentum > 0)
        if momentum > 0:  # zeros give torch's first step exactly (m = 0 * mu + g); SGD updates them in place
            for anchor, momentum_buffer in zip(self.anchor, self.momenta):
                self.optimizer.state[anchor]["momentum_buffer"] = momentum_buffer

    def bind(self, parameters: Sequence[torch.Tensor]) -> None:
        """Measure and move ``parameters`` from now on (e.g. the offloaded optimizer's copies of the model's)."""
        parameters = list(parameters)
        if [tuple(p.shape) for p in parameters] != [tuple(a.shape) for a in self.anchor]:
            raise ValueError("bind: the parameters do not have the anchor's shapes")
        self.parameters = parameters

    @torch.no_grad()
    def pseudo_gradients(self) -> List[torch.Tensor]:
        return [anchor - host_float32(param, copy=False) for anchor, param in zip(self.anchor, self.parameters)]

    @torch.no_grad()
    def step(self, averaged: Sequence[torch.Tensor], keep: Optional[Sequence[torch.Tensor]] = None) -> float:
        """One outer step with gradient ``averaged``; the parameters become the new anchor, minus ``keep`` (a peer's
        own progress not yet averaged, with ``overlap``) if given. Returns how far the anchor moved (L2 norm)."""
        if len(averaged) != len(self.anchor):
            raise ValueError(f"averaged: expected {len(self.anchor)} tensors, got {len(averaged)}")
        for anchor, delta in zip(self.anchor, averaged):
            if delta.shape != anchor.shape:
                raise ValueError(f"averaged: a tensor of shape {tuple(delta.shape)} for a parameter of shape "
                                 f"{tuple(anchor.shape)}")
            anchor.grad = delta.to(torch.float32)
        self.optimizer.step()
        self.steps += 1
        moved = self._moved()
        for anchor in self.anchor:
            anchor.grad = None
        self.reset_parameters(keep)
        return moved

    def _moved(self) -> float:
        """The norm of the step just taken: lr x |g + momentum x m| with torch's Nesterov SGD (m: the momentum after
        the step), lr x |g| without momentum; from dot products, so no tensor of the model's size is allocated."""
        group = self.optimizer.param_groups[0]
        mu, squares = group["momentum"], 0.0
        for anchor, momentum in zip(self.anchor, self.momenta):
            grad, buffer = anchor.grad.reshape(-1), momentum.reshape(-1)
            squares += float(torch.dot(grad, grad))
            if mu > 0:
                squares += 2 * mu * float(torch.dot(grad, buffer)) + mu * mu * float(torch.dot(buffer, buffer))
        return group["lr"] * math.sqrt(max(squares, 0.0))

    @torch.no_grad()
    def reset_parameters(self, keep: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Parameters back to the anchor (a newcomer that downloaded the swarm's outer state), minus ``keep`` (a
        peer's own progress not yet averaged, with ``overlap``) if given."""
        for index, (anchor, param) in enumerate(zip(self.anchor, self.parameters)):
            param.copy_(anchor if keep is None else anchor - keep[index])

    def state_tensors(self) -> List[torch.Tensor]:
        """What a newcomer needs besides the inner optimizer: the anchor and the momentum (zeros before the first
        step), in parameter order, and the count of outer steps. The live tensors: hivemind serves and loads them in
        place."""
        return self.anchor + self.momenta + [self.steps]

    @torch.no_grad()
    def load_state_tensors(self, tensors: Sequence[torch.Tensor],
                           keep: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Load :meth:`state_tensors` and restart the parameters from the loaded anchor (minus ``keep``)."""
        if len(tensors) != 2 * len(self.anchor) + 1:
            raise ValueError(f"tensors: expected {2 * len(self.anchor) + 1} (anchor, momentum, step count), got "
                             f"{len(tensors)}")
        for local, source in zip(self.state_tensors(), tensors):
            if local.shape != source.shape:
                raise ValueError(f"tensors: {tuple(source.shape)} for an outer state tensor of {tuple(local.shape)}")
            local.copy_(source)
        self.reset_parameters(keep)


class _SameResultRunner(AllReduceRunner):
    """hivemind's all-reduce (same wire format), except that each reducer returns the compressed *average* of its part
    (not average - sender's part) and decodes its own part through the same codec: every peer ends with the same
    tensors under a lossy codec."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        container = self.tensor_part_container
        container.return_deltas = False  # a reducer that fails leaves the sender's own part
        own = container._input_parts_by_peer[self.ordered_peer_ids.index(self.peer_id)]
        self._own_infos = [info for _, info in own]

    async def _communicate_with_peer(self, peer_id):
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        peer_index, sender_index = self.ordered_peer_ids.index(peer_id), self.sender_peer_ids.index(peer_id)
        compression = self.tensor_part_container.compression
        for part_index, (part, info) in enumerate(zip(self.parts_for_local_averaging, self._own_infos)):
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, part,
                                                                      weight=self.weight)
            codec = compression.compress(part, info).compression  # the codec this part travels with
            same = deserialize_torch_tensor(serialize_torch_tensor(averaged, codec))
            self.tensor_part_container.register_processed_part(peer_index, part_index, same)

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        part_index = 0
        try:
            loop = asyncio.get_event_loop()
            async for tensor_part, weight, part_compression in amap_in_executor(
                    lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression),
                    stream, max_prefetch=self.tensor_part_container.prefetch):
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight)
                    part_index += 1
                except BannedException:
                    break
                serialized = await loop.run_in_executor(
                    None, lambda: serialize_torch_tensor(averaged_part, part_compression))
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


class _CheckedSameResultRunner(ChecksAnswers, CenteredClipReduction, _SameResultRunner):
    """The same-result all-reduce with CenteredClip reducers (:mod:`lean_transformer.swarm.averaging.robust`), each
    reducer's answers checked against this peer's own pseudo-gradient
    (:mod:`lean_transformer.swarm.averaging.answer_check`; only the gross check, ``gross_only``, where this peer's
    own values are not representative, see :func:`checks_answers`): a share that fails the check is not applied, so
    the round fails for this peer (a missed round, not retried: see :class:`_Averager`), and its reducer earns a
    strike; but a share that fails the gross check, which every member judges alike, is taken as zeros and the round
    goes on, and its reducer is excluded at once."""


# a peer checks its reducers' answers if its weight is at least this x the group's median: at 0.5, an honest trainer
# with a quarter of the median's samples applied a lie that the others rejected, and the group's anchors parted
# (benchmarks/byzantine.py, DiLoCo, a reducer flipping its answers)
CHECKING_SHARE = 0.2


def expected_samples(samples: int, samples_per_second: float, seconds_left: float) -> int:
    """The samples a peer expects to have in its round when it ends ``seconds_left`` from now, at its speed: the claim
    a prepared round gathers (:meth:`PseudoGradientAverager.prepare`). Its samples so far were what the others compared
    their final samples with (:func:`checks_answers`), and they were all a fraction of the final ones: a peer with 1
    local step in the round (8 samples against 72-144) checked answers and rejected an honest reducer's (cosine
    -0.05; tests/test_lying_reducer.py), which failed its round and sent it to download the state."""
    if not (math.isfinite(samples_per_second) and samples_per_second > 0):
        return samples
    return samples + int(samples_per_second * max(0.0, seconds_left))


def claimed_weights(weights: Sequence[Any]) -> List[float]:
    """The plausible weights among a group's claims (all-gathered; a peer's message: anything), sorted."""
    return sorted(float(weight) for weight in weights if isinstance(weight, (int, float))
                  and not isinstance(weight, bool) and math.isfinite(weight) and weight > 0)


def checks_answers(own_weight: float, weights: Sequence[Any]) -> bool:
    """Whether a peer whose pseudo-gradient weighs ``own_weight`` (its samples) checks its reducers' answers, in a
    group whose members claimed ``weights`` (all-gathered, its own included; a peer's message: anything): only a
    contribution of at least ``CHECKING_SHARE`` x the median claimed weight, a median that one inflated claim cannot
    move far.

    The check asks that an average correlate with the receiver's own values. A peer that joined mid-round sends a
    pseudo-gradient of a few local steps against the others' many; the honest average need not correlate with it
    (cosine -0.08 in tests/test_diloco_faults.py), and when every answer was checked such peers rejected honest
    answers and struck honest reducers until they were excluded. Such a peer holds the answers to the gross check
    only (:func:`gross_ratio`): the group's whole average is still checked before the outer step
    (:func:`implausible_average`), and the other members check the same answers."""
    claimed = claimed_weights(weights)
    if not (math.isfinite(own_weight) and own_weight > 0) or not claimed:
        return False
    return own_weight >= CHECKING_SHARE * statistics.median(claimed)


def gross_ratio(own_weight: float, weights: Sequence[Any]) -> float:
    """The bound of the gross check (:func:`..answer_check.gross_problem`) that every peer applies to its reducers'
    answers, checking or not: ``GROSS_RATIO``, times the group's median claimed weight over ``own_weight`` where
    that is more than 1. A pseudo-gradient grows with the local steps it sums, so a peer that took 1 step while the
    others took 100 may see honest averages far more than 100x its own: its bound grows with the difference (an
    inflated claim moves the median little). Below it: zeros, and noise or scaling x1000, for every member alike."""
    claimed = claimed_weights(weights)
    if not (math.isfinite(own_weight) and own_weight > 0) or not claimed:
        return math.inf
    return GROSS_RATIO * max(1.0, statistics.median(claimed) / own_weight)


class _Averager(ServesOuterHistory, ReportsRounds, TellsGroupStart, RematchesMinorityGroups, DeclaresDirectly,
               WholeControlMessages, CancelSafe, RefusesExcluded, AnswersDelivered, DecentralizedAverager):
    """hivemind's DecentralizedAverager, safe to cancel, reading large control messages whole, its answers delivered
    (also before it shuts down), every peer getting the same average (same wire format), and all of it or
    nothing, in groups that hold at least half of the swarm's trainers where one more match can find such a group
    (:mod:`lean_transformer.swarm.averaging.group_quorum`); with ``topk_fraction``, the sparse all-reduce of
    :mod:`lean_transformer.swarm.averaging.sparse_allreduce` instead (its error feedback lives here, in the averager's process).

    hivemind accepts a partial result: where a reducer fails half-way (a peer killed in the round), each peer keeps
    its *own* values for that reducer's part ("received 97.9% results"), so the peers' averages, hence their anchors,
    differ. Here a round with any part missing fails instead (a missed round; hivemind retries it within the step's
    deadline), and the buffers change only once every part has arrived, so a retry sends the peer's own
    pseudo-gradient again, not a half-averaged one. The price: one more copy of the pseudo-gradients in host memory
    during the round. Reproduced by ``tests/test_diloco.py`` (a reducer that dies in the round).
    ``aggregation="centered_clip"``: the reducers (dense or sparse) use CenteredClip instead of the mean, and senders
    clipped far out repeatedly are excluded (``exclusions``, :mod:`lean_transformer.swarm.averaging.exclusion`).

    A round in which a reducer's answer failed this peer's check (:meth:`_answer_checks`) is not retried: the
    round ends missed and the peer moves on to its next one, as the liar does. Retried until the step's deadline,
    the honest peers stayed at their epoch while the liar, which applies its own rounds, ran ahead 3 epochs; the
    honest trainers then found themselves out of sync and downloaded its state (benchmarks/byzantine.py)."""

    def __init__(self, *args: Any, topk_fraction: Optional[float] = None, aggregation: str = "mean",
                 exclusions: Optional[Exclusions] = None, **kwargs: Any):
        check_aggregation(aggregation)
        # set before hivemind starts the averager's process
        self.topk_fraction, self.topk, self.aggregation = topk_fraction, None, aggregation
        self.answer_norms = {}  # the answer check's reference: each tensor's last accepted RMS (answer_check)
        self._streams_opened: dict = {}  # peer ID -> when it last opened a part stream here (sparse all-reduce)
        self._begun_groups: Deque[bytes] = collections.deque(maxlen=16)  # the groups whose all-reduce began here
        # time.time() when a groupmate last opened a part stream for a group whose all-reduce this peer has not
        # begun (read by the host process: OuterLoop.group_began); shared memory, made before the process forks
        self.groupmate_began = mp.Value(ctypes.c_double, 0.0, lock=False)
        super().__init__(*args, exclusions=robust_exclusions(aggregation, exclusions), **kwargs)

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        tensors = serving_only(tensors, kwargs, released_too=True)  # CancelSafe's, which this method replaces
        group_id = group_info.group_id if group_id is None else group_id
        self._begun_groups.append(group_id)
        self.note_group_started(group_id)
        checked, gross = (False, None) if self.aggregation == "mean" else \
            self._answer_checks(group_info, kwargs.get("weight", 1.0))
        if self.topk_fraction is not None:
            return await self._run_sparse_allreduce(tensors, group_info, group_id, check_answers=checked,
                                                    gross_ratio=gross, **kwargs)
        if self.aggregation == "mean":
            runner_class, robust = _SameResultRunner, {}
        else:
            runner_class, robust = _CheckedSameResultRunner, dict(
                exclusions=self.exclusions, replace_excluded=False, answer_norms=self.answer_norms,
                max_ratio=OUTER_MAX_RATIO, min_cosine=OUTER_MIN_COSINE, gross_only=not checked, gross_ratio=gross,
                drop_gross=True)
        runner = runner_class(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                              group_id=group_id, ordered_peer_ids=group_info.peer_ids, **robust, **kwargs)
        assert group_id in self._running_groups, f"Group id {group_id} was not registered"
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
            return
        averaged = [tensor async for tensor in runner]
        container = runner.tensor_part_container
        if container.failed_size:
            if self.aggregation != "mean" and runner.rejected:
                end_step_without_retry()
            raise AllreduceException(f"{container.failed_size} of {container.total_size} values were not averaged "
                                     f"(a reducer failed during the round, or its answers failed the check)")
        for tensor, average in zip(tensors, averaged):
            tensor.copy_(average)
        self.last_updated = get_dht_time()
        self._state_updated.set()

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's, noting when the sender opened the stream: hivemind reads its first message (the group ID)
        before it hands the stream to the round, which over a slow link takes the first part's transfer time. A
        part for a group whose all-reduce this peer has not begun (it waits for this peer's trigger) tells the host
        process that a groupmate has ended its round (:attr:`groupmate_began`)."""
        self._streams_opened[context.remote_id] = time.monotonic()
        request = await anext(stream)
        if request.group_id not in self._running_groups and request.group_id not in self._begun_groups:
            self.groupmate_began.value = time.time()
        self.note_group_started(request.group_id)  # a client-mode groupmate may ask (group_start)
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    def _answer_checks(self, group_info: Any, weight: float) -> Tuple[bool, float]:
        """Whether this peer checks its reducers' answers in this round, and the bound of its gross check
        (:func:`gross_ratio`, which every peer applies): by :func:`checks_answers` on the samples the members
        gathered (:meth:`PseudoGradientAverager.start`), and only if its outer state is the one the group converges
        on. A peer out of step measures its pseudo-gradient from another anchor: one that had not
        applied a round found the group's next honest averages anticorrelated with its own (cosine -0.26 to -0.62,
        tests/test_lying_reducer.py), rejected them round after round and struck honest reducers; applying the
        round instead, it learns that it is behind and downloads the group's state (:meth:`OuterLoop._applied`)."""
        gathered = [self.serializer.loads(self.serializer.loads(data)[2]) for data in group_info.gathered]
        gathered = [data if isinstance(data, dict) else {} for data in gathered]
        own = gathered[list(group_info.peer_ids).index(self.peer_id)]
        winner = converged_state({str(index): data.get("tag") for index, data in enumerate(gathered)})
        in_step = winner is None or fingerprint_of(own.get("tag")) == winner
        claimed = [data.get("samples") for data in gathered]
        return in_step and checks_answers(weight, claimed), gross_ratio(weight, claimed)

    async def _run_sparse_allreduce(self, tensors, group_info, group_id, *, peer_fractions, weight,
                                    check_answers: bool, gross_ratio: Optional[float], **_) -> None:
        modes = [AveragingMode(self.serializer.loads(data)[1]) for data in group_info.gathered]
        runner = SparseAllReduce(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, group_id=group_id,
                                 ordered_peer_ids=group_info.peer_ids, modes=modes, peer_fractions=peer_fractions,
                                 total_size=self.total_size, weight=weight, timeout=self._allreduce_timeout,
                                 aggregation=self.aggregation, exclusions=self.exclusions,
                                 check_answers=check_answers, gross_ratio=gross_ratio, opened=self._streams_opened,
                                 max_ratio=OUTER_MAX_RATIO, min_cosine=OUTER_MIN_COSINE)
        self._running_groups[group_id].set_result(runner)
        if self.mode == AveragingMode.AUX:
            await runner.run(None, None)
            return
        if self.topk is None:
            self.topk = TopKErrorFeedback([tensor.shape for tensor in tensors], self.topk_fraction)
        loop = asyncio.get_running_loop()
        indices, values = await loop.run_in_executor(None, self.topk.compress, tensors)
        try:
            average = await runner.run(indices, values)
        except AllreduceException:
            if runner.rejected:
                end_step_without_retry()
            raise
        if weight > 0:  # else the round only served its group (serving_only): its values counted for nothing
            self.topk.commit()
        offset = 0
        for tensor in tensors:
            tensor.copy_(average[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
        self.last_updated = get_dht_time()
        self._state_updated.set()


class GatedPseudoGradientAverager(GatedRPCs, _Averager):
    """The outer all-reduce's averager serving token holders only (authorized swarms; ``gate=`` is required)."""


def pseudo_gradient_averager_class(gated: bool) -> type[_Averager]:
    """The averager class of the outer all-reduce; ``gated``: serving token holders only (authorized swarms).
    hivemind names RPC handlers after the class, so callers build stubs from this very class."""
    return GatedPseudoGradientAverager if gated else _Averager


class PseudoGradientAverager:
    """All-reduces pseudo-gradients with the peers under ``prefix``, weighted by samples, through hivemind.

    ``start(pseudo_gradients, samples, tag)`` begins a round in the background; ``finish(round)`` returns the swarm's
    weighted mean, the group size, the group's tags by peer ID (each peer's ``tag``, all-gathered: the outer loop
    sends the fingerprint of its outer state) and the peer IDs of the members not in client mode (those that serve
    states), or ``None`` when no group formed or the all-reduce failed within ``timeout``.
    ``average`` does both. With ``topk_fraction`` the peers send top-k values with error feedback (a sparse
    all-reduce) instead of ``compression``; ``aggregation`` picks the reducers' rule (mean or centered_clip).
    ``auxiliary``: join rounds without a pseudo-gradient of its own (an aux peer helping averaging). ``window``: how
    long a round begun without :meth:`prepare` is declared for (its matchmaking), at least ``matchmaking_time``.
    ``swarm_size``: how many trainers this peer sees in the swarm, itself included, gathered with each round (a group
    that holds less than half of its members' median count matches once more: :mod:`.group_quorum`); 0: not known.
    ``known_trainers``: the peer IDs of the trainers that accept connections, by this peer's progress records; each
    round's matchmaking declarations go to them directly, besides the DHT (:mod:`.direct_declarations`).
    """

    def __init__(self, dht: hivemind.DHT, prefix: str, shapes: Sequence[torch.Size], *,
                 matchmaking_time: float = 5.0, window: Optional[Callable[[], float]] = None,
                 allreduce_timeout: float = 60.0,
                 compression: CompressionBase = NoCompression(), topk_fraction: Optional[float] = None,
                 gate: Optional[AveragingGate] = None, swarm_size: Callable[[], int] = lambda: 0,
                 known_trainers: Callable[[], Sequence[str]] = tuple, **averager_opts):
        self.shapes = [torch.Size(shape) for shape in shapes]
        self.swarm_size, self.known_trainers = swarm_size, known_trainers
        averager_class = pseudo_gradient_averager_class(gated=gate is not None)
        if gate is not None:
            averager_opts["gate"] = gate
        if topk_fraction is not None:  # the error feedback is built in the averager's process: check it here
            TopKErrorFeedback.check_fraction(topk_fraction)
        self.averager = averager_class([torch.zeros(shape) for shape in self.shapes], dht, start=True, prefix=prefix,
                                       min_matchmaking_time=matchmaking_time, allreduce_timeout=allreduce_timeout,
                                       compression=compression, topk_fraction=topk_fraction, **averager_opts)
        self.timeout, self.matchmaking_time = matchmaking_time + allreduce_timeout, matchmaking_time
        self.allreduce_timeout = allreduce_timeout
        self.window = window if window is not None else lambda: matchmaking_time
        self.auxiliary = averager_opts.get("auxiliary", False)
        self.client_mode = averager_opts.get("client_mode", False)  # gathered: a client-mode peer serves nothing

    def prepare(self, scheduled_time: float, samples: int, tag: Any = None) -> Any:
        """Begin matchmaking for a round expected to end at ``scheduled_time`` (DHT time): the group forms meanwhile and
        its all-reduce waits for :meth:`start` with the round's pseudo-gradients (``prepared=``). ``samples`` and
        ``tag`` are all-gathered now, so they are the samples this peer expects to have when the round ends (what
        its groupmates compare their own final samples with: :func:`checks_answers`) and its outer state's
        fingerprint as it will be then."""
        timeout = max(0.0, scheduled_time - get_dht_time()) + self.timeout
        self.averager.set_known_trainers(self.known_trainers())
        return self.averager.step(scheduled_time=scheduled_time,
                                  gather=self._gather(tag, max(1, samples), get_dht_time() + timeout),
                                  timeout=timeout, require_trigger=True, wait=False)

    def start(self, pseudo_gradients: Optional[Sequence[torch.Tensor]], samples: int, tag: Any = None,
              prepared: Any = None) -> Any:
        """Begin the round (see the class); ``prepared``: the round :meth:`prepare` began for it, used if it is
        still waiting (if it ended meanwhile, e.g. no group formed, a round begins now)."""
        if self.auxiliary:
            return self.averager.step(timeout=self.timeout, wait=False)
        if samples <= 0:
            raise ValueError(f"samples must be positive, got {samples}")
        usable = prepared is not None and not prepared.done()  # only this method triggers it
        with self.averager.get_tensors() as buffers:
            for buffer, delta in zip(buffers, pseudo_gradients):
                buffer.copy_(delta)
        if usable:
            prepared.weight = float(samples)
            prepared.allow_allreduce()
            return prepared
        window = max(self.matchmaking_time, self.window())
        scheduled = get_dht_time() + window
        self.averager.set_known_trainers(self.known_trainers())
        return self.averager.step(weight=float(samples),
                                  gather=self._gather(tag, samples, scheduled + self.allreduce_timeout),
                                  scheduled_time=scheduled, timeout=window + self.allreduce_timeout, wait=False)

    def _gather(self, tag: Any, samples: int, deadline: float) -> dict:
        """What this trainer sends its groupmates with a round (all-gathered); ``swarm``, ``window`` and ``deadline``
        (DHT time) are what :mod:`.group_quorum` decides a re-match by."""
        return dict(tag=tag, samples=samples, client=self.client_mode, swarm=int(self.swarm_size()),
                    window=float(max(self.matchmaking_time, self.window())), deadline=float(deadline))

    def groupmate_began_since(self, since: float) -> bool:
        """Whether a groupmate opened a part stream to this peer after ``since`` (time.time()) for a group whose
        all-reduce this peer has not begun (see :meth:`OuterLoop.group_began`)."""
        return self.averager.groupmate_began.value > since

    def release(self, control: Any) -> None:
        """Stop waiting for a round without failing its group (this peer's parameters were replaced, e.g. by a
        downloaded state): a prepared round still waiting for :meth:`start` serves its group with weight 0, a started
        one goes on with what this peer sent; nobody reads the result. Cancelled instead, a round whose group had
        formed failed for every member: the peer, one of its reducers, answered their parts with BAD_GROUP_ID, and
        the members' retries split the round or missed it (benchmarks/internet.py, 6 DiLoCo trainers, 120 s: 22 of
        the 28 all-reduces that failed on a reducer's answer got BAD_GROUP_ID; tests/test_diloco.py)."""
        if not control.done() and not control.triggered:
            control.weight = 0.0
            control.allow_allreduce()

    def finish(self, control: Any) -> Optional[tuple]:
        try:
            gathered = control.result(max(self.timeout, control.deadline - get_dht_time()) + 5)
        except Exception as error:  # hivemind raises its own errors on a failed round; the round is simply missed
            logger.debug(f"Outer all-reduce failed: {error!r}")
            if not control.done():
                control.cancel()
            return None
        if gathered is None or self.auxiliary:
            return None
        tags = {str(peer): data.get("tag") for peer, data in gathered.items() if isinstance(data, dict)}
        serving = {str(peer) for peer, data in gathered.items() if isinstance(data, dict) and not data.get("client")}
        with self.averager.get_tensors() as buffers:
            return [buffer.clone() for buffer in buffers], len(gathered), tags, serving

    def average(self, pseudo_gradients: Sequence[torch.Tensor], samples: int, tag: Any = None) -> Optional[tuple]:
        return self.finish(self.start(pseudo_gradients, samples, tag))

    def serve_history(self, history: OuterHistory) -> None:
        """Serve ``history`` to groupmates catching up (:mod:`.outer_history`)."""
        self.averager.outer_history = history

    def fetch_history(self, peer: str, history: OuterHistory) -> dict:
        """``peer``'s outer history, parsed against ``history``'s shapes, within the all-reduce's timeout; raises
        on a failure or a malformed answer."""
        max_bytes = 2 * HISTORY_BYTES_PER_VALUE * history.total + (1 << 20)  # twice what an honest peer keeps
        return history.parse(*self.averager.fetch_history(peer, self.timeout - self.matchmaking_time, max_bytes))

    def shutdown(self) -> None:
        self.averager.shutdown()


def fingerprint_of(tag: Any) -> Optional[list]:
    """A groupmate's gathered tag as an outer-state fingerprint ([outer steps, anchor checksum], see
    :meth:`OuterLoop.fingerprint`), or None if it is not one (a peer's message: any msgpack value)."""
    if not isinstance(tag, (list, tuple)) or len(tag) != 2:
        return None
    if not all(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
               for value in tag):
        return None
    return list(tag)


def converged_state(tags: Mapping[str, Any]) -> Optional[list]:
    """The outer state (fingerprint) a group settles on when its members' states differ; the others download it.

    Outer states differ after a split: two groups of the same round applied different averages to one anchor, and
    they meet again in a later round. Every member decides from the same all-gathered tags, so all agree: the
    fingerprint the most members hold (the fewest downloads), then the most outer steps (a peer whose round failed
    has one fewer), then the larger checksum. It used to be the largest [steps, checksum]: a 5 + 1 split made the 5
    download half of the time (the internet benchmark's DiLoCo swarms downloaded 4-7 states a peer in 120 s). A
    peer that claims more steps than its group no longer wins by that alone. None if no member sent a fingerprint."""
    counts: dict = {}
    for tag in tags.values():
        fingerprint = fingerprint_of(tag)
        if fingerprint is not None:
            counts[tuple(fingerprint)] = counts.get(tuple(fingerprint), 0) + 1
    if not counts:
        return None
    return list(max(counts, key=lambda fingerprint: (counts[fingerprint], *fingerprint)))


# a peer ahead of the state its group converged on (it stepped alone, or its round succeeded where the others'
# failed) once held that state: the group's anchor, one round on, lies within this many times the length of the
# peer's own path since (see SwarmOptimizer._download_if_behind). Measured: at most 0.84 x that length (random outer
# steps, momentum 0-0.9, 1-4 steps ahead, the group's round applied to both)
AHEAD_REACH = 2.0
OUTER_MAX_RATIO = 10.0  # an outer average this many times larger than every reference is not applied
# ... and this many times its own pseudo-gradient, for a peer with nothing else to compare with (the swarm's first
# round): one that started late took 1 local step where the others took 8 or more, and saw honest averages 19.5x and
# 23x its own (13 trainers, benchmarks/byzantine.py's honest swarm)
OUTER_FIRST_RATIO = 100.0
OUTER_MIN_CHECKED = 1024  # tensors of fewer values are checked only within the whole
# a reducer's answer fails the direction check where its cosine with the own pseudo-gradient is at most this, not 0:
# honest pseudo-gradients in step with their group can anticorrelate (each peer's inner optimizer carries its own
# momentum into the round). Honest trainers saw honest answers at cosine -0.127 (80 of a group's 344 samples, over
# 151040 values) and -0.307 (tests/test_lying_reducer.py, in CI, at bounds 0 and -0.3) and failed their rounds; a
# flipped answer is minus an honest one: -0.65 to -0.99 in three runs (the honest ones there: 0.50 to 0.99). Where
# the honest cosine is below 0.5 a flip passes this peer's check (the norm bound still holds it), but not the check
# of groupmates whose own values correlate better.
OUTER_MIN_COSINE = -0.5


def implausible_average(average: Sequence[torch.Tensor], references: Sequence[float],
                        max_ratio: float = OUTER_MAX_RATIO, min_checked: int = OUTER_MIN_CHECKED) -> Optional[str]:
    """Why an outer round's ``average`` (one tensor per anchor tensor) is not applied, or None.

    ``references``: per tensor, the largest norm this peer knows an honest update of it to have (see
    :meth:`OuterLoop.references`). Rejected: an average that is not finite, or whose norm, over all tensors or
    over a tensor of at least ``min_checked`` values, exceeds ``max_ratio`` x its reference. An honest average of
    noisy pseudo-gradients is no larger than the largest of them; a peer that joined mid-round (a few local steps
    against the others' many) saw honest averages 5.5-7.5x its own pseudo-gradient (tests/test_diloco_faults.py),
    before it had applied an average of its own, hence the last average (or the momentum) among the references."""
    squares = 0.0
    for index, (tensor, reference) in enumerate(zip(average, references)):
        norm = float(tensor.float().norm())
        if not math.isfinite(norm):
            return f"tensor {index} of the average is not finite"
        if tensor.numel() >= min_checked and reference > 0 and norm > max_ratio * reference:
            return (f"tensor {index}: |average| is {norm / reference:.3g} x the largest honest update this peer "
                    f"knows of it (at most {max_ratio:g})")
        squares += norm ** 2
    reference = math.sqrt(sum(value ** 2 for value in references))
    if reference > 0 and math.sqrt(squares) > max_ratio * reference:
        return (f"|average| is {math.sqrt(squares) / reference:.3g} x the largest honest update this peer knows "
                f"(at most {max_ratio:g})")
    return None


class OuterLoop:
    """A peer's outer rounds: ``add_samples`` after each inner step, ``end_round(alone)`` when the swarm ends one.

    Without ``overlap``: average ``anchor - parameters`` and step (the parameters restart from the new anchor); a failed
    round changes nothing, so its progress and samples fold into the next; a peer ``alone`` steps on its own.
    With ``overlap``: send this round's progress in the background; the previous round's average is applied as soon
    as its all-reduce is over (``apply_finished``, between local steps) or now (the parameters become the new anchor
    minus this peer's own progress since); a failed background round folds its progress into the next one sent.
    Returns the group size of the round applied since the last end, else None.

    ``check_averages`` (``--aggregation centered_clip``): a group's average that :func:`implausible_average` finds
    implausible (over :meth:`references`) is not applied (an ``average_rejected`` event; the round counts as
    missed). It catches what CenteredClip and the answer check cannot: a reducer's lie to a peer that does not check
    answers (:func:`checks_answers`), or in the sparse all-reduce, and a group whose liars are the majority (3 of 16
    peers, groups of 2-4). All in-sync members of a group receive the same average and mostly the same verdict; one that
    decides otherwise is out of step with its group and downloads the state its group converges on, as after a
    split.

    ``branch_depth`` (top-k rounds, whose averages groupmates keep in their histories): keep copies of the outer
    state from before each of the last ``branch_depth`` outer steps (8 bytes per parameter of host memory each,
    beside the 8 of the outer state), so that a peer whose group converged on another branch of those rounds goes
    back to where the branches parted and replays the group's steps from a groupmate's history instead of
    downloading the whole state (:meth:`_catch_up`). Such a peer also serves its state while a round it sent is in
    flight (:attr:`settled`): a newcomer that loads it one outer step behind replays the step from its first
    group's histories. ``history_donors``: the full peers outside its group that a peer behind may also ask for a
    history (peer IDs, the likeliest first).
    """

    def __init__(self, outer: OuterNesterov, averager: PseudoGradientAverager, overlap: bool = False,
                 check_averages: bool = False, branch_depth: int = 0,
                 history_donors: Callable[[], Sequence[str]] = lambda: ()):
        self.outer, self.averager, self.overlap, self.check_averages = outer, averager, overlap, check_averages
        self.branch_depth, self.history_donors = branch_depth, history_donors
        # the outer states from before the last outer steps, the latest first: (fingerprint, state tensors)
        self._kept: List[Tuple[list, List[torch.Tensor]]] = []
        self.applied_norms: Optional[List[float]] = None  # the last applied average's norm, per tensor
        self.lock: Any = contextlib.nullcontext()  # held while the outer state changes (a peer may be serving it)
        self.samples_since_anchor = self.rounds = 0
        self.behind = False  # the group's outer states differed and ours lost: download the swarm's
        self.donors: List[str] = []  # then the peer IDs of the groupmates that hold the state the group converges on
        self.outer_steps_behind: Optional[tuple] = None  # then (this peer's outer steps, the converged state's)
        self.ahead_reach: Optional[float] = None  # then, if it is ahead of that state, how far it may lie (_applied)
        self.nothing_to_apply = False  # overlap: the last round only sent (no earlier round was in flight)
        self._pending: Optional[tuple] = None  # overlap: (control, progress sent, samples sent, tag sent)
        self._base: Optional[List[torch.Tensor]] = None  # overlap: the parameters when the last round ended
        self._settled: Optional[tuple] = None  # overlap: (group size or None,) of a round settled since the last end
        self._unsent: Optional[tuple] = None  # overlap: (progress, samples) of a failed round, to fold into the next
        self._prepared: Optional[tuple] = None  # (control, tag, time.time()): the matchmaking begun for this round
        self._released: List[Any] = []  # rounds left to their groups (_release) that may still run
        # set while no caller holds it clear (unsettled) and, unless branch_depth, no round this peer sent awaits
        # its outer step: the outer state it would serve is one a newcomer can go on from (SwarmOptimizer's serve gate)
        self.settled = threading.Event()
        self.settled.set()
        self._held = False
        self.history = OuterHistory([anchor.shape for anchor in outer.anchor])  # served to groupmates catching up
        # the last outer steps this peer took: (fingerprint before, fingerprint after, how far the anchor moved)
        self._path: Deque[Tuple[list, list, float]] = collections.deque(maxlen=self.history.rounds + 1)
        if averager is not None:
            averager.serve_history(self.history)

    def add_samples(self, samples: int) -> None:
        self.samples_since_anchor += samples

    @torch.no_grad()
    def end_round(self, alone: bool = False) -> Optional[int]:
        if self.averager.auxiliary:
            self.averager.finish(self.averager.start(None, 0))
            return None
        if not self.overlap:
            deltas = self.outer.pseudo_gradients()
            if alone:
                self._take(None)
                return self._applied(deltas, 1)
            tag = self.fingerprint()
            try:
                result = self.averager.finish(self._start_round(deltas, self.samples_since_anchor, tag))
                return None if result is None else self._applied(*result, sent_tag=tag, own=deltas)
            finally:
                self._update_settled()
        return self._end_overlapped_round(alone)

    @contextlib.contextmanager
    def unsettled(self) -> Iterator[None]:
        """Hold :attr:`settled` clear while the caller changes what a served state holds beside the outer state:
        SwarmOptimizer advances its epoch after the round's outer step. Set as soon as the step was applied, a state
        served in between paired the old epoch with the new anchor: an aux peer checkpointed epoch 8 with epoch 9's
        anchor (tests/test_diloco_swarm.py), and a newcomer that loaded such a state sent a fingerprint its group
        did not hold."""
        self._held = True
        self.settled.clear()
        try:
            yield
        finally:
            self._held = False
            self._update_settled()

    def _update_settled(self) -> None:
        """Set :attr:`settled` unless a caller holds it, a round sent awaits its step, or this peer's state lost its
        group's vote (:attr:`behind`, until the caller downloads the group's): served then, a state labelled with the
        new epoch carried the losing anchor (tests/test_diloco_swarm.py in CI: two trainers that had stepped alone
        for three rounds averaged the fourth, the loser served the aux peer during its download, and the aux
        checkpointed an anchor that no trainer kept)."""
        if not self._held and not self.behind and (self._pending is None or self.branch_depth):
            self.settled.set()

    def _start_round(self, deltas: Sequence[torch.Tensor], samples: int, tag: list) -> Any:
        """Send ``deltas`` in this round (the prepared one if it was prepared with ``tag``). Until its outer step is
        applied, the state this peer would serve waits (:attr:`settled`), unless groupmates will keep the round's
        average in their histories (``branch_depth``): a newcomer that loads the state from before the step
        catches up from them in its first round (:meth:`_catch_up`). Waiting took most of a newcomer's time to
        join with ``overlap`` on slow links, where a round is in flight most of the time: in benchmarks/internet.py
        (16 DiLoCo trainers, 240 s) joiners waited 53-55 s for the first part of a 5.8 MiB state, then took 4 s for
        all of it."""
        self._cancel_released()
        if not self.branch_depth:
            self.settled.clear()
        return self.averager.start(deltas, max(1, samples), tag, prepared=self._take(tag))

    def prepare(self, scheduled_time: float, samples_per_second: float = 0.0) -> None:
        """Begin the matchmaking of the round the swarm is expected to end at ``scheduled_time`` (DHT time), as
        hivemind pre-schedules its gradient rounds. Begun when each peer sees the end, a round split into groups
        whenever the peers saw it further apart than the matchmaking time: a slow peer notices only after its
        current local step, and each reads the swarm's samples a refresh late. benchmarks/internet.py (6 trainers,
        0.07-0.55 cores each, 5 s matchmaking): peers saw rounds end 4-6 s apart, 15 of 58 groups held 2 peers, and
        the groups' different averages sent the smaller groups' members to download the state at their next round.
        Matchmaking gathers the fingerprint this peer will send; with ``overlap`` that depends on the round in
        flight, so a peer whose round is not yet applied (:meth:`apply_finished`) prepares nothing; with
        ``samples_per_second``, it gathers the samples expected at the end (:func:`expected_samples`).
        :meth:`end_round` uses a prepared round only if the fingerprint it sends still matches (else it releases it
        and matches afresh)."""
        if self.averager.auxiliary or self._prepared is not None or self._released_running():
            return
        if self.overlap and self._pending is not None:  # the fingerprint it will send depends on that round
            return
        tag = self.fingerprint()
        self._prepared = (self.averager.prepare(scheduled_time, expected_samples(
            self.samples_since_anchor, samples_per_second, scheduled_time - get_dht_time()), tag), tag, time.time())

    def group_began(self) -> bool:
        """Whether a groupmate of the prepared round has begun its all-reduce (it has ended the round) while this
        peer has not: then the swarm's round is over, whatever this peer's view of the swarm's samples says. That
        view is a DHT lookup old, and in benchmarks/internet.py (16 DiLoCo trainers, seed 2) the members of a group
        began its all-reduce up to 28 s apart, the last one usually a peer whose lookups lagged; past 20 s its
        groupmates' reducers give it up as absent (``sparse_allreduce.ABSENT_AFTER``), failing the round for the
        whole group (a group of 10 and one of 14 in one run). A peer in client mode reduces nothing and receives no
        parts: it asks a full groupmate instead (:mod:`.group_start`). Only once the group has formed (it awaits this
        peer's trigger): a stranger's part, whatever its group ID, ends no round before the swarm's expected end, when
        the prepared group forms."""
        if self._prepared is None:
            return False
        control, _, since = self._prepared
        return (not control.done() and not control.triggered and control.stage == AveragingStage.AWAITING_TRIGGER
                and self.averager.groupmate_began_since(since))

    def _take(self, tag: Optional[list]) -> Any:
        """The prepared round's control if it was prepared with ``tag``; None (and the round released) otherwise."""
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            return None
        control, prepared_tag, _ = prepared
        if prepared_tag == tag:
            return control
        self._release(control)
        return None

    def _release(self, control: Any) -> None:
        """Leave a round to its group (:meth:`PseudoGradientAverager.release`)."""
        if not control.done():
            self.averager.release(control)
            self._released.append(control)

    def _released_running(self) -> bool:
        self._released = [control for control in self._released if not control.done()]
        return bool(self._released)

    def _cancel_released(self) -> None:
        """Before a round begins: cancel the released rounds still running. Once its all-reduce has begun a round
        holds the averager's buffers, which the new round's :meth:`PseudoGradientAverager.start` then waits for;
        before that, it would average whatever the buffers hold when it gets there (cancelled: nothing, with weight
        0, or it leaves matchmaking)."""
        for control in self._released:
            if not control.done():
                control.cancel()
        self._released = []

    def references(self, own: Sequence[torch.Tensor]) -> Tuple[List[float], float]:
        """Per anchor tensor, the largest norm of an honest update this peer knows, and how many times that an average
        may be: its own pseudo-gradient ``own`` and the last average it applied (``OUTER_MAX_RATIO``); before its
        first applied round (a newcomer, whose own progress may be a few local steps), the outer momentum instead of
        the latter (downloaded with the state: a sum of the swarm's recent averages, between one of them and
        1 / (1 - momentum) of them); with no momentum either (the swarm's first round), its own alone
        (``OUTER_FIRST_RATIO``)."""
        own_norms = [float(mine.float().norm()) for mine in own]
        earlier = self.applied_norms
        if earlier is None:
            earlier = [float(momentum.norm()) for momentum in self.outer.momenta]
            if not any(earlier):
                return own_norms, OUTER_FIRST_RATIO
        return [max(mine, last) for mine, last in zip(own_norms, earlier)], OUTER_MAX_RATIO

    def fingerprint(self) -> list:
        """[outer steps, checksum of the anchor]: peers that applied the same outer steps to the same anchor have the
        same one, bit for bit. The checksum adds the anchor's float32 bit patterns as integers, which no summation
        order changes; a float64 sum's last digit changed with the thread count (8 threads against 1-4, on 25M
        values), so peers with different core counts saw each other as out of date and re-downloaded the state."""
        checksum = sum(int(anchor.view(torch.int32).sum(dtype=torch.int64)) for anchor in self.outer.anchor)
        return [float(self.outer.steps), checksum % (1 << 62)]  # within msgpack's integers

    def _applied(self, averaged: Sequence[torch.Tensor], group_size: int, tags: Optional[Mapping[str, Any]] = None,
                 serving: Optional[Collection[str]] = None, keep: Optional[Sequence[torch.Tensor]] = None,
                 sent_tag: Optional[list] = None, own: Optional[Sequence[torch.Tensor]] = None) -> Optional[int]:
        """Apply a round's average (``own``: this peer's pseudo-gradient in it, for the check); None if rejected.
        ``serving``: the groupmates that serve their state and history (not in client mode), if known; only they
        become :attr:`donors`. Asked anyway, client-mode groupmates cost a peer behind a refused connection each
        before its replay: 30 in benchmarks/internet.py's 16 DiLoCo trainers, on the training thread."""
        if self.check_averages and own is not None:
            reason = implausible_average(averaged, *self.references(own))
            if reason is not None:
                logger.warning(f"Not applying the outer average of a group of {group_size}: {reason}")
                emit("average_rejected", group_size=group_size, reason=reason)
                return None
        tags = tags or {}
        winner = converged_state(tags) if sent_tag is not None else None
        behind = winner is not None and list(sent_tag) != winner
        self.donors = [peer for peer, tag in tags.items() if behind and fingerprint_of(tag) == winner
                       and (serving is None or peer in serving)]
        self.behind = behind and not self._catch_up(sent_tag, winner, keep)
        if self.behind:
            self.settled.clear()  # until the caller has downloaded the group's state (_update_settled)
        self.outer_steps_behind = (int(sent_tag[0]), int(winner[0])) if self.behind else None
        self._step(averaged, list(sent_tag) if sent_tag is not None and not behind else self.fingerprint(), keep)
        ahead = self.behind and int(winner[0]) < int(sent_tag[0])
        moved = self.moved_since(winner) if ahead else None
        self.ahead_reach = None if moved is None else AHEAD_REACH * moved
        self.samples_since_anchor, self.rounds = 0, self.rounds + 1
        return group_size

    def _step(self, averaged: Sequence[torch.Tensor], before: list,
              keep: Optional[Sequence[torch.Tensor]] = None) -> list:
        """Apply one outer step to the state whose fingerprint is ``before``, and keep it in the history; the
        fingerprint it led to."""
        with self.lock:
            if self.branch_depth:
                self._keep(before)
            moved = self.outer.step(averaged, keep=keep)
        after = self.fingerprint()
        self.history.record(before, averaged, after)
        self._path.append((list(before), after, moved))
        self.applied_norms = [float(tensor.float().norm()) for tensor in averaged]
        return after

    def moved_since(self, fingerprint: list) -> Optional[float]:
        """How far this peer's own outer steps moved its anchor since it held the state ``fingerprint``: the sum of
        their lengths along its path from there to its current state; None if its record of its last steps (as many
        as a history keeps, plus one) holds no such path, e.g. a download replaced its state since."""
        current, length = self.fingerprint(), 0.0
        for before, after, moved in reversed(self._path):
            if after != current:
                continue  # a step of a branch this peer left (it went back, or downloaded and came here again)
            current, length = before, length + moved
            if current == list(fingerprint):
                return length
        return None

    def _keep(self, fingerprint: list) -> None:
        """Copy the outer state (its fingerprint: ``fingerprint``) before it takes a step (``branch_depth``), into
        the buffers of the oldest kept state once ``branch_depth`` are kept."""
        state = self.outer.state_tensors()
        if len(self._kept) < self.branch_depth:
            copies = [tensor.clone() for tensor in state]
        else:
            _, copies = self._kept.pop()
            for copy, tensor in zip(copies, state):
                copy.copy_(tensor)
        self._kept.insert(0, (list(fingerprint), copies))

    def _go_back(self, depth: int, keep: Optional[Sequence[torch.Tensor]]) -> None:
        """Restore the outer state from before the last ``depth`` + 1 outer steps (the parameters restart from it,
        minus ``keep``); the states kept from after it are dropped, the older ones are still its past."""
        with self.lock:
            self.outer.load_state_tensors(self._kept[depth][1], keep)
        del self._kept[:depth + 1]

    def _catch_up(self, ours: list, winner: list, keep: Optional[Sequence[torch.Tensor]]) -> bool:
        """Bring this peer's outer state from its fingerprint ``ours`` to its group's ``winner`` without downloading
        it; whether it now holds ``winner``.

        A peer behind replays the outer steps it missed from a groupmate's history (:mod:`.outer_history`). With
        ``branch_depth``, a peer on another branch goes back to a state it kept from before its last outer steps and
        replays the group's steps from there: groups that averaged the same round apart (a split) apply different
        averages to one anchor, and when they meet the smaller ones lose the vote at the same step count. At 16
        trainers (benchmarks/internet.py), 8 of 12 such losses had the group's step count, which no replay from the
        current state reaches, and each sent a peer to download the whole state. Rounds that split twice in a row
        part the branches two steps back: with one state kept, 11 of 12 catch-ups then found no path in any history
        and downloaded (16 DiLoCo trainers, 3e04c22). The state kept from the fewest steps back that leads to the
        group's is used; a kept state that is the group's (a peer ahead: its group's round failed for the others)
        is just gone back to.

        Donors: the groupmates that hold the group's state, then up to ``HISTORY_OUTSIDERS`` other full peers
        (``history_donors``; :mod:`.outer_history` says why). A donor's history is used only if it holds the whole
        path from this peer's state (or the kept one) to the group's (:func:`path_to`); a replay that ends elsewhere
        nonetheless (a donor's lie) leaves the state to the download that follows. A peer that could not catch up
        says why (``catch_up_failed``): at 16 trainers, three peers one step behind downloaded the state and no line
        said why the replay had not helped."""
        kept = [tag for tag, _ in self._kept]
        if list(winner) in kept:
            depth = kept.index(list(winner))
            self._go_back(depth, keep)
            if self.fingerprint() != list(winner):
                return self._catch_up_failed(0, "replayed_elsewhere", "the kept state was not the one it was kept as")
            logger.info(f"Went back {depth + 1} outer step(s) to the state its group holds, instead of downloading it")
            emit("outer_caught_up", source=None, rounds=0, seconds=0.0, went_back=depth + 1, groupmate=True)
            return True
        # (fingerprint, how many steps back: 0 for the current state, or depth + 1 of a kept one)
        starts = [(list(ours), 0)] + [(tag, depth + 1) for depth, tag in enumerate(kept)]
        starts = [(start, back) for start, back in starts if int(winner[0]) > int(start[0])]
        if not starts:  # not behind, and no earlier state kept: another state at the same step, which nothing replays
            return False
        missing = min(int(winner[0]) - int(start[0]) for start, _ in starts)
        if missing > self.history.rounds:
            return self._catch_up_failed(missing, "too_far", f"histories keep {self.history.rounds} outer step(s)")
        outsiders = [peer for peer in self.history_donors() if peer not in self.donors][:HISTORY_OUTSIDERS]
        misses = []
        for donor in [*self.donors, *outsiders]:
            started = time.monotonic()
            try:
                entries = self.averager.fetch_history(donor, self.history)
            except Exception as error:  # a peer's answer, or none: the next donor, then the download
                logger.info(f"No outer history from {donor}: {error!r}")
                misses.append(f"{donor}: no history ({error!r})")
                continue
            paths = [(path_to(entries, start, winner), back) for start, back in starts]
            path, back = next(((path, back) for path, back in paths if path), (None, 0))
            if path is None:
                misses.append(f"{donor}: {len(entries)} step(s), no path from this peer's state (or the "
                              f"{len(kept)} kept) to its group's")
                continue
            if back:
                self._go_back(back - 1, keep)
            replayed = self._replay(entries, path, keep, donor)
            if self.fingerprint() == list(winner):
                seconds, groupmate = time.monotonic() - started, donor in self.donors
                logger.info(f"Caught up {replayed} outer step(s) from {donor}'s history in {seconds:.2f} s"
                            f"{f', having gone back {back} step(s)' if back else ''}"
                            f"{'' if groupmate else ' (a peer outside the group)'}, instead of downloading the state")
                emit("outer_caught_up", source=donor, rounds=replayed, seconds=seconds, went_back=back,
                     groupmate=groupmate)
                return True
            if replayed or back:  # the state moved: only a download restores it
                return self._catch_up_failed(missing, "replayed_elsewhere",
                                             f"{donor}'s history led {replayed} step(s) to another state")
            misses.append(f"{donor}: its first step was not plausible")
        return self._catch_up_failed(missing, "not_in_history" if misses else "no_donor",
                                     "; ".join(misses) or "no peer to ask")

    def _replay(self, entries: Mapping, path: Sequence, keep: Optional[Sequence[torch.Tensor]], donor: str) -> int:
        """Apply ``entries`` (a donor's history) along ``path`` (:func:`path_to`) while each step is plausible and
        leads where the entry says; the steps applied."""
        for replayed, key in enumerate(path):
            averaged = self.history.dense(entries[key])
            known = self.applied_norms or [float(momentum.norm()) for momentum in self.outer.momenta]
            reason = implausible_average(averaged, known) if self.check_averages else None
            if reason is not None:
                logger.warning(f"Not replaying {donor}'s outer history: {reason}")
                return replayed
            if history_key(self._step(averaged, list(key), keep)) != entries[key].after:
                logger.warning(f"{donor}'s outer history led to another state than it says")
                return replayed + 1
        return len(path)

    @staticmethod
    def _catch_up_failed(missing: int, kind: str, reason: str) -> bool:
        logger.info(f"Could not replay the {missing} outer step(s) this peer is behind ({reason}): downloading")
        emit("catch_up_failed", rounds=missing, kind=kind, reason=reason)
        return False

    def seconds_in_flight(self) -> Optional[float]:
        """Overlap: the seconds until the deadline of the round sent in the background, if it is still running and
        its deadline has not passed; None otherwise."""
        if not self.overlap or self._pending is None or self._pending[0].done():
            return None
        left = self._pending[0].deadline - get_dht_time()
        return left if left > 0 else None

    def finished_in_background(self) -> bool:
        """Overlap: whether the background round is over and :meth:`apply_finished` would settle it."""
        return self.overlap and self._pending is not None and self._pending[0].done()

    def apply_finished(self) -> None:
        """Overlap: settle the background round once it is over (:meth:`finished_in_background`), between two local
        steps: apply its outer step (the parameters become the new anchor minus this peer's progress since the round
        was sent), or keep what it sent to fold into the next round. Applied only when the next round ended, the
        step left every state that a peer served meanwhile one outer step behind its own: a newcomer that downloaded
        it applied nothing at that end (it had no round in flight), sent an outdated fingerprint with its first
        round, lost its group's vote and downloaded again, round after round (benchmarks/internet.py, 6 DiLoCo
        trainers, 120 s: 9 of the 15 downloads on a lost vote came one outer step behind, in chains that began with
        a download; tests/test_diloco.py). With dense rounds, a state asked for while the all-reduce runs waits for
        the step (:attr:`settled`; SwarmOptimizer waits at most the round's time)."""
        samples = self.samples_since_anchor  # this round's, which _applied would reset
        self._settle_pending()
        self.samples_since_anchor = samples

    def _progress(self) -> List[torch.Tensor]:
        """Overlap: this peer's progress since the last round was sent (or since its step was applied)."""
        base = self._base if self._base is not None else self.outer.anchor
        return [b - host_float32(p, copy=False) for b, p in zip(base, self.outer.parameters)]

    def _settle_pending(self) -> List[torch.Tensor]:
        """Wait for the background round, apply it or keep what it sent to fold (``_unsent``); returns this peer's
        progress since it was sent, which the parameters keep on top of the new anchor."""
        (control, sent, sent_samples, sent_tag), self._pending = self._pending, None
        progress = self._progress()
        result = self.averager.finish(control)
        group_size = None if result is None else self._applied(*result, keep=progress, sent_tag=sent_tag, own=sent)
        if group_size is None:
            self._unsent = (sent, sent_samples)
        else:
            self._base = [anchor.clone() for anchor in self.outer.anchor]  # the parameters: this anchor - progress
        self._settled = (group_size,)
        self._update_settled()
        return progress

    def _end_overlapped_round(self, alone: bool) -> Optional[int]:
        samples = self.samples_since_anchor
        progress = self._settle_pending() if self._pending is not None else self._progress()
        settled, self._settled = self._settled, None
        self.nothing_to_apply = settled is None  # no round was in flight since the last end (a first round)
        group_size = None if settled is None else settled[0]
        if self._unsent is not None:  # fold the unapplied progress into this round's
            (sent, sent_samples), self._unsent = self._unsent, None
            progress = [p + s for p, s in zip(progress, sent)]
            samples += sent_samples
        if alone:
            self._pending, self._base = None, None  # the parameters restart from the new anchor
            self._take(None)
            self.samples_since_anchor = samples
            return self._applied(progress, 1)
        tag = self.fingerprint()
        self._pending = (self._start_round(progress, samples, tag), progress, samples, tag)
        self.samples_since_anchor = 0
        self._base = [host_float32(p) for p in self.outer.parameters]
        return group_size

    def forget_pending(self) -> None:
        """Stop waiting for the background round and the prepared one (the parameters were replaced, e.g. by a
        downloaded state), leaving them to their groups (:meth:`PseudoGradientAverager.release`)."""
        if self._pending is not None:
            self._release(self._pending[0])
        self._take(None)
        self._pending, self._base, self._settled, self._unsent = None, None, None, None
        self._kept.clear()  # another lineage's: nothing goes back to them
        self.samples_since_anchor = 0
        self._update_settled()

    def leave(self, grace: float) -> int:
        """This peer leaves the swarm: give up its rounds that have no group yet, serve those whose group has formed
        (with weight 0 where it sent nothing) and wait up to ``grace`` s for them to end, before the caller shuts the
        averager down; returns how many it served. A formed group needs every member: each reduces a part of the
        others' tensors, and a member whose averager stopped mid-round (hivemind cancels its running groups) answered
        its part with nothing or not at all, failing the round for the whole group. benchmarks/internet.py, 16 DiLoCo
        trainers on 0.7 cores: a trainer stopped by SIGTERM while its group waited for its trigger failed the round
        of its 6 groupmates, who missed it and retried until the round's timeout (tests/test_diloco.py)."""
        self.forget_pending()  # every round left to its group, with weight 0 where nothing was sent
        rounds, self._released = self._released, []
        served = []
        for control in rounds:
            if control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
                give_up(control)
            elif not control.done():
                served.append(control)
        deadline = time.monotonic() + grace
        for control in served:
            with contextlib.suppress(CancelledError, Exception):  # its groupmates' outcome, not this peer's
                control.result(max(0.0, deadline - time.monotonic()))
        return len(served)


def wire_bytes_per_parameter(shapes: Sequence[torch.Size], compression: Optional[CompressionBase],
                             topk_fraction: float = 0.01, group_size: int = 2) -> float:
    """Bytes one peer sends plus receives per parameter in one outer round, from the serialized size of random
    pseudo-gradients, with equal shares of the vector per reducer: with a hivemind codec (``compression``) a peer
    sends (n-1)/n of the vector and receives as much back; with top-k (``compression=None``) it sends (n-1)/n of its
    top-k entries and receives (n-1)/n of the union of the group's (6 bytes an entry: int32 index, float16 value)."""
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=generator) for shape in shapes]
    total = sum(tensor.numel() for tensor in tensors)
    share = (group_size - 1) / group_size
    if compression is None:
        chosen = [TopKErrorFeedback(shapes, topk_fraction).compress(
            [torch.randn(shape, generator=generator) for shape in shapes])[0] for _ in range(group_size)]
        union = torch.unique(torch.cat(chosen))
        return share * 6 * (len(chosen[0]) + len(union)) / total
    infos = [CompressionInfo.from_tensor(tensor, key=index) for index, tensor in enumerate(tensors)]
    sent = sum(len(compression.compress(tensor, info).SerializeToString()) for tensor, info in zip(tensors, infos))
    return 2 * share * sent / total
