"""Robust aggregation for the all-reduce: CenteredClip (Karimireddy et al. 2021; run inside each reducer's part of
the all-reduce as in BTARD, Gorbunov et al., ICML 2022) instead of hivemind's weighted mean.

With the mean, one peer that sends a huge, finite, wrong update moves every peer (issue 24: a gradient sign-flipped
x1000 took the honest trainers' loss from 3.91 to 6.35). CenteredClip pulls each input at most ``tau`` towards a
running centre, so a sender at any distance moves the result by at most its share of the weight times ``tau``
(``benchmarks/byzantine.py``: 3 honest trainers and one liar x -1000, loss 4.75 without it, 6.57 with it under the
mean, 4.72 under CenteredClip). It is the swarm's default (``--aggregation``); the classes here default to the mean,
hivemind's behaviour, for library users who build averagers themselves.

hivemind 1.1.12 has no robust aggregation (its CenteredClip, PR #379, was never merged), hence our own:

- :func:`centered_clip`: the aggregation of one part's inputs (below);
- :class:`CenteredClipReducer`: hivemind's ``TensorPartReducer`` that keeps every sender's copy of the current part
  and answers with :func:`centered_clip` once all have arrived (or the senders that failed are known);
- :class:`CenteredClipReduction`: mixed in front of an ``AllReduceRunner`` (hivemind's, DiLoCo's same-result one),
  it reduces with that reducer. Messages, codecs and weights on the wire are hivemind's: the honest case sends
  exactly the bytes the mean does, and only the reducers compute differently;
- :class:`Aggregated`: mixed in front of a hivemind averager, its ``aggregation`` option picks the runner.

Under "centered_clip" the runners also check what the other reducers answer (:mod:`.answer_check`: a reducer that
lies; in DiLoCo's dense all-reduce, see ``diloco.checks_answers``), and in both
modes a sender whose part ends over ``FAR_OUT`` (10) x tau from the result earns a strike, as does a reducer
whose answers fail the check; peers caught repeatedly are excluded for a while (:mod:`.exclusion`). An honest part
ends within about one tau (no honest sender earned a strike in the swarm tests' rounds); x -1000 ends 25-40 tau out.

Choices of :func:`centered_clip` (all peers of a swarm must agree on ``--aggregation``):

- **start**: the coordinate-wise median of the senders' parts. It lies inside the honest inputs' range in every
  coordinate while the honest senders are more than half of the senders, however far the others are; the mean would
  start next to an attacker, and the first clipping radius would be measured from there.
- **tau** = ``TAU_FACTOR`` (2) x the median of the senders' distances to the start. Scale-free: it follows the size
  of the honest updates (gradients shrink during training; pseudo-gradients are larger), and the median ignores how
  far a minority is. Honest inputs are all about equally far from their centre (many coordinates of independent
  noise: the distances concentrate), so with a factor of 2 none is clipped and the result is the weighted mean,
  exactly (the first step lands on it). Not so for an honest sender whose noise is over twice the others' (e.g. a
  far smaller batch): it is clipped, and the result leans towards the better estimates. The price of the factor:
  a minority of weight share ``a`` can shift the result by up to ``a / (1 - a) x tau`` (the fixed point balances
  its clipped pull against the honest ones), i.e. of the order of one honest input's own noise, not 1000x it.
- **far out, left out**: a part that ends over ``FAR_OUT`` (10) x tau from the result is dropped and the rest
  clipped again (:func:`clip_and_distances`): the bound above then holds only for a minority that stays within
  10 tau, and a blatant one (x1000) moves the result not at all. In DiLoCo's groups of 2-8 that pull was what
  hurt: noise-dominated pseudo-gradients of 2 local steps, shifted by about one honest spread towards the liars.
- **one vote per sender** for the start and tau, the weights only in the steps: a sender's weight (its samples) is
  its own claim, and a weighted median would sit on any sender holding more than half of the weight (tau 0: its
  part alone). So the median's breakdown counts liars, not what they claim.
- **weights that cannot be inflated**: in the steps a sender's weight counts up to ``WEIGHT_CAP`` (2) x the median
  of the senders' weights, and up to the median itself for a sender that starts over tau from the start (one vote
  each decided both): a liar that claims 1000x the samples it computed weighs as much as the median sender, and
  liars below half of the senders stay below half of the weight, beyond which CenteredClip walks to them (with a
  share ``a`` >= 1/2 no fixed point near the honest ones exists). With the 2x cap alone, 2 liars among 5 that
  sign-flip their pseudo-gradients (x -1, a norm like the honest ones') and claim 10x held 4/7 of the weight: the
  result pointed against the honest mean (cosine -0.45), and 13 honest DiLoCo trainers with 3 such liars ended at
  loss 3.5-4.6 against 2.0-2.1 (``benchmarks/byzantine.py``). The price: an honest peer more than 2x faster than
  the median (a big GPU among small ones) counts as 2x in this mode (the mean keeps every peer's samples as they
  are); honest parts start well within tau (distances concentrate about the median one: half of tau), so they
  keep that.
- **iterations**: ``v <- v + sum_i w_i clip_tau(x_i - v) / sum_i w_i`` until a step is shorter than
  ``TOLERANCE x tau`` or after ``ITERATIONS`` steps (BTARD uses ~20). Each step shrinks the distance to the fixed
  point by about the clipped share of the weight (below 1/2), so 50 steps reach float32 resolution; the honest case
  stops after two.
- **weights** are the senders' (samples): a sender with weight 0 (e.g. a cancelled round, see
  :mod:`..hivemind_fixes.averagers`), or whose weight or part is not finite, is left out; with no weight at all the
  result is zeros (as the sparse all-reduce's, :mod:`.sparse_allreduce`).

Memory: the mean adds each arriving part into one buffer; here the reducer holds every sender's part of the current
part index until the last one arrives (``senders x part_size``: parts are hivemind's ``part_size_bytes`` on the wire,
512 KiB by default, float32 once decoded, e.g. 16 senders x 1 MiB under float16 codecs), and the computation needs
about four times that again (sorting for the median, the differences). Time: O(senders x part x iterations) per part,
in the averager's event loop.
"""
from __future__ import annotations

import asyncio
import math
from typing import Any, List, Optional, Sequence, Tuple

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter, azip

from lean_transformer.swarm.averaging.answer_check import ChecksAnswers
from lean_transformer.swarm.averaging.exclusion import FAR_OUT, Exclusions, RefusesExcluded
from lean_transformer.swarm.averaging.round_events import gathered_epoch
from lean_transformer.swarm.monitoring.events import emit

AGGREGATIONS = ("mean", "centered_clip")
TAU_FACTOR = 2.0
WEIGHT_CAP = 2.0  # a sender's weight counts up to this many times the senders' median weight
ITERATIONS = 50
TOLERANCE = 1e-6


def robust_exclusions(aggregation: str, exclusions: Optional[Exclusions] = None) -> Optional[Exclusions]:
    """The exclusions an averager keeps: ``exclusions``, or under "centered_clip" the defaults; none for the mean."""
    if aggregation == "mean":
        return None
    return Exclusions() if exclusions is None else exclusions


def check_aggregation(aggregation: str) -> str:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation (--aggregation) must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")
    return aggregation


NETWORK_SENDERS = 32  # up to this many senders, the median sorts with a network of element-wise min/max


def median(values: torch.Tensor) -> torch.Tensor:
    """Median of ``values`` (senders x coordinates) along dim 0; with an even count, the midpoint of the middle two.

    ``sort(dim=0)`` sorts each coordinate's few values with a strided general sort: 5 ms for 4 senders of a 512 KiB
    part, 51 ms for 16 (one core), most of a reducer's time. For few senders, an odd-even transposition network
    (n rounds of element-wise ``minimum``/``maximum`` of neighbouring rows, vectorized along the coordinates) gives
    the same values in 0.3 and 5 ms; its n^2 / 2 steps lose to the sort beyond a few dozen senders."""
    if len(values) > NETWORK_SENDERS:
        ordered = list(values.sort(dim=0).values)
    else:
        ordered = list(values)
        for round_index in range(len(ordered)):
            for index in range(round_index % 2, len(ordered) - 1, 2):
                low, high = ordered[index], ordered[index + 1]
                ordered[index], ordered[index + 1] = torch.minimum(low, high), torch.maximum(low, high)
    return (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2


def scaled(values: torch.Tensor, exponent: int) -> torch.Tensor:
    """``values`` x 2 ** ``exponent``, exact, in two factors: 2 ** 128 itself is beyond float32 (``torch.ldexp`` does
    the same, 10x slower)."""
    return values * 2.0 ** (exponent // 2) * 2.0 ** (exponent - exponent // 2)


@torch.no_grad()
def centered_clip(parts: Sequence[torch.Tensor], weights: Sequence[float], *, tau_factor: float = TAU_FACTOR,
                  iterations: int = ITERATIONS, tolerance: float = TOLERANCE) -> torch.Tensor:
    """CenteredClip of ``parts`` (same shape; one per sender) weighted by ``weights``, in float32; the module docstring
    says why the start, tau and the stopping rule are what they are."""
    return clip_and_distances(parts, weights, tau_factor=tau_factor, iterations=iterations, tolerance=tolerance)[0]


@torch.no_grad()
def clip_and_distances(parts: Sequence[torch.Tensor], weights: Sequence[float], *, tau_factor: float = TAU_FACTOR,
                       iterations: int = ITERATIONS, tolerance: float = TOLERANCE
                       ) -> Tuple[torch.Tensor, List[Optional[float]]]:
    """:func:`centered_clip`, and each part's distance from the result in units of tau (the clipping radius):
    ``inf`` for a part that is not finite, None where there is no radius (fewer than two parts kept, or tau 0).
    Honest parts end within about one tau; :mod:`.exclusion` counts a strike against a sender far beyond it.

    A part that ends over ``FAR_OUT`` x tau from the result is then left out of this result too (weight 0, one
    second pass, while fewer than half of the kept parts are that far): clipped, it would still pull the result by
    up to its share / (1 - share) x tau, of the order of the honest parts' own spread, in its direction (13 honest
    DiLoCo trainers and 3 sign-flipping x1000 in groups of 2-8, ``benchmarks/byzantine.py``: the honest trainers'
    loss 3.18, 4 of them at 4.3-7.2, against the honest swarm's 2.04; with the second pass 2.10). The distances
    are then the second pass's."""
    result, distances = _clip_once(parts, weights, tau_factor=tau_factor, iterations=iterations,
                                   tolerance=tolerance)
    usable = [math.isfinite(float(weight)) and weight > 0 and distance != math.inf
              for weight, distance in zip(weights, distances)]
    far = [ok and distance is not None and distance > FAR_OUT for ok, distance in zip(usable, distances)]
    if not any(far) or 2 * sum(far) >= sum(usable):
        return result, distances
    weights = [0.0 if out else weight for weight, out in zip(weights, far)]
    return _clip_once(parts, weights, tau_factor=tau_factor, iterations=iterations, tolerance=tolerance)


def _clip_once(parts: Sequence[torch.Tensor], weights: Sequence[float], *, tau_factor: float, iterations: int,
               tolerance: float) -> Tuple[torch.Tensor, List[Optional[float]]]:
    """One pass of :func:`clip_and_distances`."""
    if len(parts) != len(weights) or not parts:
        raise ValueError(f"centered_clip: {len(parts)} parts for {len(weights)} weights")
    shape = parts[0].shape
    finite = [bool(torch.isfinite(part).all()) for part in parts]
    kept = [(part.reshape(-1).float(), float(weight)) for part, weight, ok in zip(parts, weights, finite)
            if math.isfinite(weight) and weight > 0 and ok]
    if len(kept) < 2:
        result = kept[0][0].clone().view(shape) if kept else torch.zeros(shape)
        return result, [None if ok else math.inf for ok in finite]
    inputs = torch.stack([part for part, _ in kept])
    # scaled by a power of two (exact) to a largest magnitude in [0.5, 1): the norms' squares of finite inputs near
    # float32's largest values would overflow (NaN results), those of tiny ones underflow to 0 (tau 0: the median)
    exponent = int(torch.frexp(inputs.abs().max()).exponent)
    inputs = scaled(inputs, -exponent)
    weights64 = torch.tensor([weight for _, weight in kept], dtype=torch.float64)
    median_weight = float(median(weights64[:, None]))
    centre = median(inputs)
    from_start = (inputs - centre).norm(dim=1)
    tau = tau_factor * float(median(from_start[:, None]))
    if tau == 0:  # most senders sit exactly on the start, and clipping to radius 0 never moves it
        return scaled(centre, exponent).view(shape), [None if ok else math.inf for ok in finite]
    # up to WEIGHT_CAP x the median weight; up to the median itself beyond the radius from the start
    caps = torch.where(from_start > tau, 1.0, WEIGHT_CAP).double() * median_weight
    weights64 = torch.minimum(weights64, caps)
    shares = (weights64 / weights64.sum()).float()
    for _ in range(iterations):
        differences = inputs - centre
        pulls = shares * (tau / differences.norm(dim=1)).clamp(max=1.0)  # a distance of 0 pulls with factor 1
        step = pulls @ differences
        centre += step
        if float(step.norm()) <= tolerance * tau:
            break
    result = scaled(centre, exponent)
    tau_unscaled = float(scaled(torch.tensor(tau, dtype=torch.float64), exponent))
    distances = [float((part.reshape(-1).double() - result.double()).norm()) / tau_unscaled if ok else math.inf
                 for part, ok in zip(parts, finite)]
    return result.view(shape), distances


class _SendersParts:
    """Stands in for hivemind's accumulator tensor: keeps each sender's copy of the current part (and its index)
    instead of summing them."""

    def __init__(self):
        self.parts: List[torch.Tensor] = []
        self.weights: List[float] = []
        self.senders: List[int] = []


class CenteredClipReducer(TensorPartReducer):
    """hivemind's reducer (same ordering, waits and failure handling), answering each part with
    :func:`centered_clip` of the senders' copies rather than their weighted mean. With ``exclusions``
    (:mod:`.exclusion`) and the senders' peer IDs (``sender_ids``, in sender index order; "" for this peer, which
    never strikes itself), an excluded sender's parts weigh 0 and a sender whose part ends over ``FAR_OUT`` x tau
    from the result (or is not finite) earns a strike (``strikes=False``: only the ``sender_clipped`` event, except
    for a part that is not finite)."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, sender_ids: Sequence[str] = (),
                 exclusions: Optional[Exclusions] = None, strikes: bool = True):
        self.sender_ids, self.exclusions, self.strikes = list(sender_ids), exclusions, strikes
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _SendersParts()

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        """hivemind 1.1.12's ``TensorPartReducer.accumulate_part``, keeping the sender's index with its part."""
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # wait for the previous parts
            await asyncio.wait({self.current_part_future, asyncio.create_task(self.finished.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        # A part that comes after the round was finalized ends cancelled like the parts already waiting (hivemind's
        # own reducer raises on its deleted accumulator, in a task that nobody reads: "Task exception was never
        # retrieved", seen in benchmarks/internet.py under churn). And a waiting sender that is cancelled (it left)
        # must not cancel the part's shared future for the others (hivemind awaits it unshielded; the next part then
        # raised InvalidStateError, in that same unread task).
        if part_index < self.sender_failed_after[sender_index] and not current_part_future.done():
            arrived = self.accumulator
            arrived.parts.append(tensor_part)
            arrived.weights.append(0.0 if self._excluded(sender_index) else weight)
            arrived.senders.append(sender_index)
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await asyncio.shield(current_part_future)

    def _excluded(self, sender_index: int) -> bool:
        return (self.exclusions is not None and sender_index < len(self.sender_ids)
                and self.exclusions.is_excluded(self.sender_ids[sender_index]))

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            arrived, shape = self.accumulator, self.part_shapes[self.current_part_index]
            if arrived.parts:
                result, distances = clip_and_distances(arrived.parts, arrived.weights)
                self._strike_far_out(arrived, distances)
            else:
                result = torch.zeros(shape)
            self.current_part_future.set_result(result.view(shape))
            self.reset_accumulators()

    def _strike_far_out(self, arrived: _SendersParts, distances: Sequence[Optional[float]]) -> None:
        senders = [self.sender_ids[index] if index < len(self.sender_ids) else "" for index in arrived.senders]
        strike_far_out(self.exclusions, senders, arrived.weights, distances, arrived.parts[0].numel(), self.strikes)


def strike_far_out(exclusions: Optional[Exclusions], senders: Sequence[str], weights: Sequence[float],
                   distances: Sequence[Optional[float]], size: int, strikes: bool = True) -> None:
    """A strike (and a ``sender_clipped`` event) against each sender whose part of ``size`` values ended over
    ``FAR_OUT`` x tau from the result (:func:`clip_and_distances`' ``distances``), or was not finite. ``senders``:
    peer IDs, "" for this peer (never struck); parts of weight 0 (excluded senders) count only when not finite.
    ``strikes=False`` (a group out of step, see :class:`Aggregated`): the events only, a part that is not finite
    still struck."""
    if exclusions is None:
        return
    for sender, weight, distance in zip(senders, weights, distances):
        if (distance is not None and distance > FAR_OUT and (weight > 0 or math.isinf(distance)) and sender
                and not exclusions.is_excluded(sender)):
            reason = f"its part ended {distance:.3g} x tau from the result (at most {FAR_OUT:g})"
            struck = strikes or math.isinf(distance)
            emit("sender_clipped", source=sender, reason=reason, size=size, struck=struck)
            if struck:
                exclusions.strike(sender, f"a part it sent: {reason}")


class CenteredClipReduction:
    """Mixed in front of an ``AllReduceRunner`` class: its reducer is a :class:`CenteredClipReducer`, which keeps
    ``exclusions`` (:mod:`.exclusion`; None: none) of its senders; each ``exclusions`` round is one runner.
    ``in_step=False``: the group's members are not in step (see :class:`Aggregated`), so outliers and implausible
    answers earn no strikes in this round (the runner still clips them and rejects them)."""

    def __init__(self, *args: Any, exclusions: Optional[Exclusions] = None, in_step: bool = True, **kwargs: Any):
        self.exclusions, self.in_step = exclusions, in_step
        if exclusions is not None:
            exclusions.begin_round()
        super().__init__(*args, **kwargs)
        unused = self.tensor_part_reducer
        unused.finished.set()  # never used: no "received 0% of input tensors" warning when it is collected
        self.tensor_part_reducer = CenteredClipReducer(
            unused.part_shapes, unused.num_senders,
            ["" if peer_id == self.peer_id else peer_id.to_base58() for peer_id in self.sender_peer_ids], exclusions,
            strikes=in_step)


class CenteredClipAllReduceRunner(ChecksAnswers, CenteredClipReduction, AllReduceRunner):
    """hivemind's all-reduce with CenteredClip reducers and checked answers (:mod:`.answer_check`; not by a peer
    that only serves the round with weight 0)."""

    judges_weightless = False


def group_in_step(serializer: Any, gathered: Sequence[bytes]) -> bool:
    """Whether the members of a group that send values (not aux peers: their parameters play no part) all gathered
    one epoch label (see :class:`Aggregated`); ``gathered``: hivemind's ``GroupInfo.gathered``."""
    labels = set()
    for data in gathered:
        try:
            aux = serializer.loads(data)[1] == AveragingMode.AUX.value
        except Exception:  # not the layout hivemind writes: counts as its own label
            aux = False
        if not aux:
            labels.add(gathered_epoch(serializer, data))
    return len(labels) <= 1


class Aggregated(RefusesExcluded):
    """Mixed in front of a hivemind averager that runs hivemind's ``_run_allreduce_inplace_``: ``aggregation``
    ("mean": hivemind's, or "centered_clip") chooses how its reducers combine the senders' parts. Under
    "centered_clip" the answers of the reducers are checked too, and peers caught repeatedly are excluded
    (``exclusions``, by default :class:`~.exclusion.Exclusions`' defaults; :mod:`.exclusion`).

    Strikes need a group in step: one whose members all gathered the same epoch label (SwarmOptimizer's gradient
    rounds gather it; hivemind's gather none, which counts as one label too; aux peers send no values and do not
    count: :func:`group_in_step`). In a group whose labels differ, an answer that fails the check is still rejected
    and a far-out part still clipped, but nobody is struck for it (only a gross lie, or a part that is not finite,
    is). Why: honest gradients taken at parameters a few epochs apart anticorrelate (the tiny LeanGPT with the
    demo's LAMB, 2 peers of 64 samples: the average of an up-to-date peer's gradient and one taken 1-4 epochs earlier
    failed the direction check in 9 of 886 shares, cosines down to -0.37; 0 of 900 with both up to date, also 8
    samples against 120: benchmarks/answer_check.py), so honest groupmates were struck: in ``make demo`` one
    trainer excluded the other within 2.5 s (3 rejected answers, cosines -0.29 to -0.06; the other had been out of
    sync 4 times) and trained alone to the end. A liar that gathers a false label escapes exclusion this way, not
    the check: every answer of its that fails is still replaced by the receiver's own values
    (``tests/test_exclusion.py``, variant ``out_of_step``)."""

    def __init__(self, *args: Any, aggregation: str = "mean", exclusions: Optional[Exclusions] = None, **kwargs: Any):
        self.aggregation = check_aggregation(aggregation)  # before hivemind starts the averager's process
        self.answer_norms = {}  # the answer check's reference: each tensor's last accepted RMS (answer_check)
        super().__init__(*args, exclusions=robust_exclusions(aggregation, exclusions), **kwargs)

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: Optional[bytes] = None, **kwargs: Any) -> None:
        if self.aggregation == "mean":
            return await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
        # hivemind 1.1.12's DecentralizedAverager._run_allreduce_inplace_, with the runner class replaced
        group_id = group_info.group_id if group_id is None else group_id
        runner = CenteredClipAllReduceRunner(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix,
                                             tensors=tensors, group_id=group_id, ordered_peer_ids=group_info.peer_ids,
                                             exclusions=self.exclusions,
                                             in_step=group_in_step(self.serializer, group_info.gathered),
                                             answer_norms=self.answer_norms, **kwargs)
        assert group_id in self._running_groups, f"Group id {group_id} was not registered"
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
            return
        async for tensor, update in azip(as_aiter(*tensors), runner):
            tensor.add_(update, alpha=self._averaging_alpha)
            self.last_updated = get_dht_time()
            self._state_updated.set()
