"""Checking a reducer's answers (issue 24, reducers that lie): each peer averages one share of every all-reduce and
answers every sender with it, and a reducer that answers with a wrong average (scaled, sign-flipped, noise, another
part, zeros) would move every peer of the group on its share. CenteredClip (:mod:`.robust`) bounds what a sender
can do; nothing in hivemind checks what a reducer answers, hence this check, done by each receiver on the answers of
each reducer.

The rule (:func:`share_problem`): with ``x`` the receiver's own contribution to a reducer's share (all its parts,
concatenated) and ``v = x + delta`` the average the reducer claims, accept iff

- ``||delta|| <= MAX_RATIO x max(||x||, r)``: an honest average of noisy updates is no farther from one of them than a
  few times its size (``||v - x||`` is about ``||x||`` when noise dominates, less when the updates agree). ``r`` is
  the norm the same values had in the receiver's last accepted average (each tensor's RMS, kept by the averager):
  in DiLoCo a peer that took 1 local step while the others took 10 sends a pseudo-gradient ~10x smaller than the
  average (``tests/test_robust_swarm.py`` saw honest answers 6.7x and 8.2x an own pseudo-gradient, rejected before
  ``r``). A lie x1000 is still 1000x last round's average, unless the honest average grew by 250x in a round;
- ``<x, v> > 0``: an honest average correlates positively with each honest input, ``<x, mean> = (||x||^2 + sum_j
  <x, x_j>) / n``, and over many coordinates the cross terms are either positive (a shared signal: gradients of one
  model on one distribution, DiLoCo's pseudo-gradients) or of the order of ``||x||^2 sqrt(n / size)`` (noise);
- and each part of at least :data:`PART_MIN_CHECKED` values alone: ``||delta_part|| <= PART_MAX_RATIO x
  max(||x_part||, r_part)`` (a lie confined to a few small parts, e.g. a norm's scale x1000, is small in the share's
  norm).

Why the share and not each part (the first design): per part, on the tiny LeanGPT's real gradients with 16 peers of
8 samples each, honest answers failed the inner-product test in 0.7% of parts (a 128-value bias of one noisy batch
has cosine down to -0.94 with the average) and the norm test up to 4.6x (``benchmarks/answer_check.py``); over a
share the inner products concentrate (shares of 256 values still failed in 0.3%, hence :data:`MIN_CHECKED`). The
answers of a reducer are therefore held until its whole share has arrived (hivemind's container then takes them as
it would have; the all-reduce ends with its last answer either way).

A share smaller than :data:`MIN_CHECKED` values, or where ``x`` is zero or not finite, is not checked (nothing to
compare with, no concentration). On a failure the receiver keeps its own values for the whole share (delta 0: the
reducer moves it by nothing, as a reducer that fails), emits ``answer_rejected`` (``source``: the reducer's peer ID,
``reason``, ``size``) and counts a strike against the reducer (:mod:`.exclusion`). An excluded reducer's answers
are replaced the same way, unchecked; so are the answers held from a reducer that fails half-way (unchecked, they are
not used).

DiLoCo's sparse all-reduce (:mod:`.sparse_allreduce`) checks each reducer's sparse answer by the same rule
(:func:`sparse_share_problem`, over the entries sent and answered), with no reference from earlier rounds. In both
DiLoCo all-reduces the norm bound is the outer average's (10, ``diloco.OUTER_MAX_RATIO``), not 4: a newcomer, and
a peer that had just downloaded a state, saw honest answers 4.1-4.6x their own values (tests/test_diloco_faults.py);
the direction test is what catches a flipped or swapped answer there (zeros: the gross check), and a scaled one
stays bounded. Its bound there is a cosine of -0.5, not 0 (``diloco.OUTER_MIN_COSINE``: honest pseudo-gradients
in step with their group anticorrelated with an honest answer at -0.127 and -0.307; flipped ones: -0.65 to -0.99).

In DiLoCo's same-result all-reduce a share replaced by the own values would leave this peer's anchor apart from its
group's. There a rejected share fails the round for this peer, without a retry (``diloco._Averager``; the others of
the group decide for themselves: a lie told to all of them fails it for all the honest ones, which keep one anchor),
and an excluded reducer's answers are checked, not replaced (``ChecksAnswers``). Only a peer whose pseudo-gradient
weighs at least a fifth of the group's median, in step with its group, checks (``diloco.checks_answers`` and
``diloco._Averager._answer_checks``: peers that joined mid-round or were a round behind found honest averages
uncorrelated or anticorrelated with their own, and struck honest reducers until they excluded them).

The other members of a DiLoCo group, and every checking peer first, hold each answer to :func:`gross_problem`: an
average :data:`GROSS_RATIO` (100) times larger or smaller than the own values (more for a peer of little weight,
``diloco.gross_ratio``) is a gross lie. The check needs own values of the right order of magnitude only, so every
member judges a reducer that answers the whole group zeros, or noise or a scale x1000, alike. When only the
checking peers rejected such an answer, the others applied it and the group's anchors parted, and the honest
trainers downloaded states round after round (3 liars of 16 answering zeros, benchmarks/byzantine.py). A gross
lie excludes its reducer at once, not after 3 strikes: no honest average comes within 4x of the bound. And since
every member judges it alike, a DiLoCo peer takes the share as zeros and applies the round (``drop_gross``): with
the round failed instead, each honest trainer lost one round per liar it met before excluding it (3 liars of 16:
60-78 rounds averaged of ~100 by the 13 honest trainers, against 102 without liars).

Measured (``benchmarks/answer_check.py``: the tiny LeanGPT's real gradients and DiLoCo pseudo-gradients, honest
CenteredClip answers, 30 rounds): 4 peers, 0 of 480 shares rejected in either mode; 16 peers of 8 samples each, 5 of
4320 checked shares in gradient averaging (0.12%; cosines down to -0.09, ``||v - x||`` up to 4.7x ``||x||`` on shares
of a few thousand values of heavy-tailed gradients) and 1 in DiLoCo. In the gradient-averaging swarm tests (3 honest
trainers and a liar), no honest answer rejected. One false rejection costs one receiver one share's average for one
round, and one strike: an honest reducer is excluded only after 3 within 10 rounds. x1000, noise x1000 and zeros:
caught on every share; sign flips on all but 0.1% (16 peers, gradients: the shares whose honest average
anticorrelates with the own values, where the flipped one correlates; bounded by the norm test). Peers out of step:
see :class:`~.robust.Aggregated`.

What it does not catch: an answer within the honest spread, e.g. the true average plus a bias of the size of one
input's noise, another honest input, the average of a subset of the senders, or an unrelated vector of the honest
size (``reducer_swap``: caught only where it anti-correlates, 0.2-8% of the shares in the benchmark). These pass:
their influence is bounded, not removed, at most ``MAX_RATIO x max(||x||, r)`` per share and round. A threshold
above 0 for the cosine would catch more of them (an honest one is about ``1 / sqrt(senders)`` in pure noise), but
the measured honest minimum is already near 0 for 16 small-batch peers. Nor are shares below :data:`MIN_CHECKED`
values checked, except for the part norms. Cost: four float32 inner products over each received part (0.15 ms
per 512 KiB part, one core, with the sum v = x + d: 0.1 s a round for 100M parameters; no extra bytes), and the
answers of a reducer wait for its last part.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Hashable, List, Optional, Sequence

import torch
from hivemind.averaging.partition import TensorPartContainer

from lean_transformer.swarm.averaging.exclusion import Exclusions
from lean_transformer.swarm.monitoring.events import emit

MAX_RATIO = 4.0
PART_MAX_RATIO = 25.0
MIN_CHECKED = 1024  # shares of fewer values are not checked
PART_MIN_CHECKED = 64  # nor the norms of parts of fewer values
# an average this many times larger or smaller than the own values is a lie, whoever checks: the largest honest
# ratio seen is 23x (DiLoCo, a peer with 1 local step against the others' 8 or more); see benchmarks/answer_check.py
GROSS_RATIO = 100.0


@torch.no_grad()
def inner_products(own: torch.Tensor, delta: torch.Tensor) -> tuple[float, float, float]:
    """``<x, x>, <d, d>, <x, d>`` of ``own`` and ``delta``: float32 dot products (25x faster than float64 ones), again
    in float64 where float32 overflows."""
    x, d = own.reshape(-1).float(), delta.reshape(-1).float()
    sums = (float(torch.dot(x, x)), float(torch.dot(d, d)), float(torch.dot(x, d)))
    if not all(map(math.isfinite, sums)):
        x, d = x.double(), d.double()
        sums = (float(x @ x), float(d @ d), float(x @ d))
    return sums


def verdict(xx: float, dd: float, xd: float, size: int, reference: float = 0.0, max_ratio: float = MAX_RATIO,
            min_cosine: float = 0.0) -> Optional[str]:
    """The rule on the inner products ``<x, x>, <d, d>, <x, d>`` of a share of ``size`` values (see the module
    docstring); ``reference``: the norm the share's accepted average had in the previous round (0: none);
    ``min_cosine`` (at most 0): an average whose cosine with the own values is not above it fails (0: the rule's
    ``<x, v> > 0``)."""
    if size < MIN_CHECKED or not 0 < xx < math.inf:
        return None
    if not math.isfinite(dd) or not math.isfinite(xd):
        return "not finite"
    x_norm, d_norm = math.sqrt(xx), math.sqrt(dd)
    scale = max(x_norm, reference if math.isfinite(reference) else 0.0)
    if d_norm > max_ratio * scale:
        return (f"|average - own values| is {d_norm / x_norm:.3g} x |own values|, {d_norm / scale:.3g} x the larger "
                f"of it and the last average's (at most {max_ratio:g})")
    if xx + xd <= 0:
        cosine = (xx + xd) / (x_norm * max(math.sqrt(max(xx + 2 * xd + dd, 0.0)), 1e-300))
        if cosine <= min_cosine:
            return f"the average does not correlate with the own values (cosine {cosine:.3g})"
    return None


def gross_problem(xx: float, vv: float, size: int, max_ratio: float = GROSS_RATIO) -> Optional[str]:
    """Why an average of squared norm ``vv`` cannot be an average that the receiver's own values (squared norm
    ``xx``, ``size`` of them) took part in, or None: not finite, or ``max_ratio`` times larger or smaller. Unlike
    :func:`verdict`, this needs no representative own values, only ones of the right order of magnitude: every
    member of a group can apply it, so all of them judge a reducer that answers them zeros or noise x1000 alike
    (see :class:`ChecksAnswers`)."""
    if size < MIN_CHECKED or not 0 < xx < math.inf:
        return None
    if not math.isfinite(vv):
        return "not finite"
    ratio = math.sqrt(max(vv, 0.0) / xx)
    if not 1 / max_ratio <= ratio <= max_ratio:
        return f"|average| is {ratio:.3g} x |own values| (a plausible one: within {max_ratio:g}x either way)"
    return None


@torch.no_grad()
def sparse_sums(own: tuple[torch.Tensor, torch.Tensor], answer: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[float, float, float, int]:
    """``<x, x>, <v, v>, <x, v>`` and the size of one reducer's share of DiLoCo's sparse all-reduce: ``own`` and
    ``answer`` are (sorted indices, values) in its range, this peer's top-k entries ``x`` and the sparse average
    ``v`` the reducer claims. The inner products run over the entries only (float64); the share's size is the count
    of own entries."""
    own_indices, own_values = own[0].long(), own[1].double()
    answer_indices, answer_values = answer[0].long(), answer[1].double()
    xx, vv = float(own_values @ own_values), float(answer_values @ answer_values)
    xv = 0.0
    if len(answer_indices) and len(own_indices):
        positions = torch.searchsorted(answer_indices, own_indices).clamp(max=len(answer_indices) - 1)
        matched = answer_indices[positions] == own_indices
        xv = float(own_values[matched] @ answer_values[positions[matched]])
    return xx, vv, xv, len(own_indices)


def sparse_share_problem(own: tuple[torch.Tensor, torch.Tensor], answer: tuple[torch.Tensor, torch.Tensor],
                         max_ratio: float = MAX_RATIO, sums: Optional[tuple[float, float, float, int]] = None,
                         min_cosine: float = 0.0) -> Optional[str]:
    """The rule (:func:`verdict`) for one reducer's share of DiLoCo's sparse all-reduce (see :func:`sparse_sums`;
    ``sums``: theirs, where already computed)."""
    xx, vv, xv, size = sparse_sums(own, answer) if sums is None else sums
    return verdict(xx, max(vv - 2 * xv + xx, 0.0), xv - xx, size, max_ratio=max_ratio, min_cosine=min_cosine)


def share_sums(owns: Sequence[torch.Tensor], deltas: Sequence[torch.Tensor]) -> List[tuple[float, float, float]]:
    """:func:`inner_products` of each part of a share."""
    return [inner_products(own, delta) for own, delta in zip(owns, deltas)]


def share_problem(owns: Sequence[torch.Tensor], deltas: Sequence[torch.Tensor],
                  references: Optional[Sequence[float]] = None, max_ratio: float = MAX_RATIO,
                  sums: Optional[Sequence[tuple[float, float, float]]] = None, min_cosine: float = 0.0
                  ) -> Optional[str]:
    """Why the answers ``owns[i] + deltas[i]`` for one reducer's share (its parts, in order) are not a plausible
    average, or None: the rule on the whole share, and each part's norm within ``PART_MAX_RATIO``.
    ``references``: each part's norm in the previous round's accepted average (0: unknown); ``sums``: the parts'
    :func:`share_sums`, where already computed."""
    if not owns:
        return None
    references = [0.0] * len(owns) if references is None else references
    sums = share_sums(owns, deltas) if sums is None else sums
    reason = verdict(*(sum(part[index] for part in sums) for index in range(3)), sum(own.numel() for own in owns),
                     reference=math.sqrt(sum(reference ** 2 for reference in references)), max_ratio=max_ratio,
                     min_cosine=min_cosine)
    if reason is not None:
        return reason
    for index, ((xx, dd, _), own, reference) in enumerate(zip(sums, owns, references)):
        scale = max(math.sqrt(xx), reference)
        if own.numel() >= PART_MIN_CHECKED and 0 < xx < math.inf and not math.sqrt(dd) <= PART_MAX_RATIO * scale:
            return f"part {index}: |average - own values| is {math.sqrt(dd) / scale:.3g} x the larger of |own " \
                   f"values| and the last average's (at most {PART_MAX_RATIO:g} for a part)"
    return None


class CheckedParts(TensorPartContainer):
    """hivemind's container of a runner's parts, holding each groupmate's answers until its whole share has arrived,
    then checking them (:func:`share_problem`) before hivemind's code takes
    them. Made from the runner's container by :class:`ChecksAnswers` (``own_index``: the receiver's own index,
    whose own parts are not checked; ``on_rejected(peer_index, reason)``; ``is_excluded(peer_index)``)."""

    own_index: int
    held: Dict[int, List[torch.Tensor]]
    reference: Dict[Hashable, float]  # per tensor (its key): the RMS of its last accepted average, before this round
    learned: Dict[Hashable, float]  # the same, updated with this round's accepted values (kept by the averager)
    sums: Dict[Hashable, List[float]]  # this round's sums of squares and counts per tensor
    unchecked: bool = False
    replace_excluded: bool = True  # an excluded reducer's answers: replaced unchecked (else checked as any other)
    max_ratio: float = MAX_RATIO  # the norm bound of the rule
    min_cosine: float = 0.0  # and its direction bound
    gross_only: bool = False  # only the gross check (gross_problem), as every DiLoCo peer that does not check does
    gross_ratio: float = GROSS_RATIO
    drop_gross: bool = False  # a share that fails the gross check: zeros, and the round goes on (DiLoCo)
    weightless: bool = False  # this peer only serves the round (weight 0): it checks nothing and learns nothing

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor) -> None:
        if self.weightless:
            return super().register_processed_part(peer_index, part_index, part)
        if peer_index == self.own_index:
            self._learn(peer_index, part_index, part)
        if peer_index == self.own_index or self.unchecked:
            return super().register_processed_part(peer_index, part_index, part)
        held = self.held.setdefault(peer_index, [])
        held.append(part)
        if len(held) == self.num_parts_by_peer[peer_index]:
            self._release(peer_index)

    def register_failed_reducer(self, peer_index: int) -> None:
        self._replace_held(peer_index)  # half an answer, unchecked, is not used
        self.unchecked = True
        try:
            super().register_failed_reducer(peer_index)
        finally:
            self.unchecked = False

    def _release(self, peer_index: int) -> None:
        if self.replace_excluded and self.is_excluded(peer_index):
            return self._replace_held(peer_index)
        answers = self.held[peer_index]
        owns = [part for part, _ in self._input_parts_by_peer[peer_index]]
        if len(owns) != len(answers):  # finalized meanwhile: hivemind's own checks end the round
            return
        deltas = answers if self.return_deltas else [answer - own for answer, own in zip(answers, owns)]
        sums = share_sums(owns, deltas)
        xx, dd, xd = (sum(part[index] for part in sums) for index in range(3))
        reason = gross_problem(xx, xx + 2 * xd + dd, sum(own.numel() for own in owns), self.gross_ratio)
        gross = reason is not None
        if not gross and not self.gross_only:
            infos = [info for _, info in self._input_parts_by_peer[peer_index]]
            references = [self.reference.get(info.key, 0.0) * own.numel() ** 0.5 for own, info in zip(owns, infos)]
            reason = share_problem(owns, deltas, references, max_ratio=self.max_ratio, sums=sums,
                                   min_cosine=self.min_cosine)
        if reason is not None:
            self.on_rejected(peer_index, reason, gross)
            return self._replace_held(peer_index, zeros=gross and self.drop_gross)
        del self.held[peer_index]
        for part_index, answer in enumerate(answers):
            self._learn(peer_index, part_index, answer)
            super().register_processed_part(peer_index, part_index, answer)

    def _learn(self, peer_index: int, part_index: int, answer: torch.Tensor) -> None:
        """Fold an accepted answer into its tensor's RMS (the next round's reference)."""
        own, info = self._input_parts_by_peer[peer_index][part_index]
        average = own + answer if self.return_deltas else answer
        sums = self.sums.setdefault(info.key, [0.0, 0])
        sums[0] += inner_products(average, average)[0]
        sums[1] += average.numel()
        if sums[1] and math.isfinite(sums[0]):
            self.learned[info.key] = math.sqrt(sums[0] / sums[1])

    def _replace_held(self, peer_index: int, zeros: bool = False) -> None:
        """Own values for the answers held from ``peer_index`` (all of its share when all have arrived), counted as
        not averaged; ``zeros``: an average of zeros instead, which every member of the group takes alike
        (``drop_gross``), counted as averaged."""
        for part_index, _ in enumerate(self.held.pop(peer_index, [])):
            own = self._input_parts_by_peer[peer_index][part_index][0]
            if zeros:
                super().register_processed_part(peer_index, part_index,
                                                -own if self.return_deltas else torch.zeros_like(own))
                continue
            super().register_processed_part(peer_index, part_index,
                                            torch.zeros_like(own) if self.return_deltas else own.clone())
            self.failed_size += own.numel()  # counted as hivemind counts a failed reducer's values


class ChecksAnswers:
    """Mixed in front of hivemind's ``AllReduceRunner`` class (gradient averaging) whose
    ``self.exclusions`` (:class:`~.exclusion.Exclusions` or None) and ``self.in_step`` (False: reject, strike only
    gross lies) are set by the classes after it (:class:`~.robust.CenteredClipReduction`): every groupmate's
    answers are checked (:class:`CheckedParts`) before hivemind's container takes them. ``answer_norms``: the
    averager's dict of each tensor's last accepted RMS (read as this round's reference, updated with its answers).
    ``replace_excluded=False`` (DiLoCo): an excluded reducer's answers are checked as any other's, not replaced: a
    peer excluded in the middle of a round (its last strike) would otherwise fail the round for the peers that
    excluded it before its answers arrived and not for the others, and their anchors would part (seen in
    tests/test_robust_swarm.py's DiLoCo swarm: the parted peer's pseudo-gradients then ended far out, and the
    others excluded it). ``max_ratio``: the rule's norm bound (DiLoCo: the outer average's, 10).
    ``gross_only``: only :func:`gross_problem` (a DiLoCo peer whose own values are not representative), with the
    bound ``gross_ratio``. A gross lie excludes its reducer at once (a strike counts 1 of 3 otherwise): no honest
    average comes near, and every honest member of the group sees it, so they all leave the liar out of their next
    groups together instead of over 3 rounds. ``drop_gross`` (DiLoCo): such a share is taken as zeros, and the round
    goes on: every member takes the same zeros, so their anchors stay one, and the other shares' averages count.

    ``judges_weightless`` (class attribute): whether a peer whose own weight in the round is 0 checks too. Not in
    gradient averaging (:class:`~.robust.CenteredClipAllReduceRunner`): such a peer only serves a round it left (a
    cancelled round, :mod:`..hivemind_fixes.averagers`) and keeps its own values, and the average owes nothing to
    them. A 2-trainer run ended with both trainers' last rounds cancelled as they left, the reducers answering the
    zeros of a group without weight, and one trainer excluding the other as a gross liar
    (``tests/test_exclusion.py``, variant ``weightless``)."""

    judges_weightless = True

    def __init__(self, *args: Any, answer_norms: Optional[Dict[Hashable, float]] = None,
                 replace_excluded: bool = True, max_ratio: float = MAX_RATIO, min_cosine: float = 0.0,
                 gross_only: bool = False, gross_ratio: float = GROSS_RATIO, drop_gross: bool = False,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        container = self.tensor_part_container
        container.__class__ = CheckedParts
        container.replace_excluded, container.max_ratio, container.min_cosine = replace_excluded, max_ratio, min_cosine
        container.gross_only, container.gross_ratio, container.drop_gross = gross_only, gross_ratio, drop_gross
        container.own_index, container.held = self.ordered_peer_ids.index(self.peer_id), {}
        container.weightless = self.weight == 0 and not self.judges_weightless
        learned = {} if answer_norms is None else answer_norms
        container.reference, container.learned, container.sums = dict(learned), learned, {}
        container.on_rejected, container.is_excluded = self._rejected, self._excluded

    def _reducer(self, peer_index: int) -> str:
        return self.ordered_peer_ids[peer_index].to_base58()

    def _excluded(self, peer_index: int) -> bool:
        return self.exclusions is not None and self.exclusions.is_excluded(self._reducer(peer_index))

    rejected = False  # an answer failed the check in this round

    def _rejected(self, peer_index: int, reason: str, gross: bool = False) -> None:
        self.rejected = True
        size = sum(part.numel() for part, _ in self.tensor_part_container._input_parts_by_peer[peer_index])
        reject_answer(self.exclusions, self._reducer(peer_index), reason, size, gross, strikes=self.in_step)


def reject_answer(exclusions: Optional[Exclusions], reducer: str, reason: str, size: int, gross: bool,
                  strikes: bool = True) -> None:
    """Emit ``answer_rejected`` for ``reducer``'s answer to a share of ``size`` values, and strike it (exclude it at
    once if the lie is ``gross``: see :class:`ChecksAnswers`); ``strikes=False`` (a group out of step, see
    :class:`~.robust.Aggregated`): only a gross lie is held against it."""
    struck = strikes or gross
    emit("answer_rejected", source=reducer, reason=reason, size=size, gross=gross, struck=struck)
    if exclusions is not None and struck:
        why = f"its answers as a reducer: {reason}"
        exclusions.exclude(reducer, why) if gross else exclusions.strike(reducer, why)
