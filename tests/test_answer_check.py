"""Reducers that lie (issue 24): the receivers' check of the answers (lean_transformer.swarm.averaging.answer_check),
driven through hivemind's own part container; strikes, exclusion and its expiry (exclusion); the reducer's strikes
against far-out senders and its weight 0 for excluded ones (robust); and the exclusions in the metrics record and the
aux peer's table."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

import pytest
import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2

from lean_transformer.swarm.averaging.answer_check import (GROSS_RATIO, MAX_RATIO, MIN_CHECKED, PART_MAX_RATIO,
                                                           PART_MIN_CHECKED, CheckedParts, gross_problem,
                                                           share_problem, sparse_share_problem, sparse_sums)
from lean_transformer.swarm.averaging.diloco import OUTER_MAX_RATIO, OUTER_MIN_COSINE
from lean_transformer.swarm.averaging.exclusion import FAR_OUT, Exclusions
from lean_transformer.swarm.averaging.robust import CenteredClipReducer, centered_clip, group_in_step
from lean_transformer.swarm.hivemind_fixes.stream_answers import AnswersDelivered
from lean_transformer.swarm.monitoring.events import close_events, emit, open_events, read_events
from lean_transformer.swarm.monitoring.peer_table import PeerTable, excluded_keys, summary
from lean_transformer.swarm.peers.reporting import MetricsReporter
from lean_transformer.swarm.protocol.metrics import LocalMetrics
from lying_peer import REDUCER_ATTACKS, lying_average

SIZE = 4096


def gradients(count: int, signal: float, seed: int = 0, size: int = SIZE) -> list[torch.Tensor]:
    """One model's gradients on different batches: a common direction (``signal`` x the noise's scale) plus each
    sender's own heavy-tailed noise (Student t, 3 degrees of freedom)."""
    generator = torch.Generator().manual_seed(seed)
    common = signal * torch.randn(size, generator=generator)
    noise = torch.distributions.StudentT(3.0)
    torch.manual_seed(seed)
    return [common + noise.sample((size,)) for _ in range(count)]


@pytest.mark.parametrize("senders", [2, 4, 16, 64])
@pytest.mark.parametrize("signal", [0.0, 0.1, 1.0, 10.0])
def test_honest_answers_are_accepted(senders, signal):
    """The honest CenteredClip answer to every sender passes, from pure noise to a strong common signal, over many
    draws, with batches of different sizes (weights: the samples; the noise shrinks as 1/sqrt(samples)): one sender
    with 64x the samples of most, one with 1/4. Shares of 1024 values per sender at least (in pure noise the inner
    products' margin is about sqrt(size / senders) deviations; a real model's shares are far larger)."""
    samples = [1.0] * senders
    samples[0], samples[-1] = 0.25, 64.0
    size = max(SIZE, 1024 * senders)
    for seed in range(20 if senders < 64 else 5):
        generator = torch.Generator().manual_seed(1000 + seed)
        common = signal * torch.randn(size, generator=generator)
        parts = [common + noise / batch ** 0.5 for noise, batch in zip(gradients(senders, 0.0, seed, size), samples)]
        average = centered_clip(parts, samples)
        for part in parts:
            assert share_problem([part], [average - part]) is None, (senders, signal, seed)


@pytest.mark.parametrize("attack", REDUCER_ATTACKS)
@pytest.mark.parametrize("signal", [0.1, 1.0, 10.0])
def test_each_lie_is_caught_or_bounded(attack, signal):
    """Every lie of tests/lying_peer.py about a share of two parts (scale 1000), to each of 4 honest senders, is
    caught; but the swap (the other part's average: the right size, an unrelated direction), caught only when it
    happens to anti-correlate, moves a receiver at most MAX_RATIO x its own values."""
    first, second = gradients(4, signal, seed=1), gradients(4, signal, seed=2)
    averages = [centered_clip(first, [1.0] * 4), centered_clip(second, [1.0] * 4)]
    for sender in range(4):
        owns = [first[sender], second[sender]]
        lies = [lying_average(attack, 1000.0, averages[0], averages[1]),  # the swap: the other part's average
                lying_average(attack, 1000.0, averages[1], averages[0])]
        deltas = [lie - own for lie, own in zip(lies, owns)]
        if attack == "reducer_swap":
            if share_problem(owns, deltas) is None:
                assert torch.cat(deltas).norm() <= MAX_RATIO * torch.cat(owns).norm()
        else:
            assert share_problem(owns, deltas) is not None, (attack, sender)


def test_what_passes_moves_a_receiver_a_bounded_distance():
    """Lies inside the rule (a bias, a scaled average) pass or not; whatever passes is within MAX_RATIO x the
    receiver's own values of it; a lie on one small part alone is bounded by PART_MAX_RATIO."""
    generator = torch.Generator().manual_seed(3)
    parts = gradients(4, 1.0, seed=3)
    average = centered_clip(parts, [1.0] * 4)
    for factor in [0.5, 1.0, 2.0, 3.0, 5.0, 10.0]:
        for _ in range(20):
            lie = average + factor * parts[0].norm() * torch.randn(SIZE, generator=generator) / SIZE ** 0.5
            if share_problem([parts[0]], [lie - parts[0]]) is None:
                assert float((lie - parts[0]).norm()) <= MAX_RATIO * float(parts[0].norm())
        accepted = share_problem([parts[0]], [factor * average - parts[0]]) is None
        assert accepted == (float((factor * average - parts[0]).norm()) <= MAX_RATIO * float(parts[0].norm()))
    big, small = gradients(4, 1.0, seed=4), gradients(4, 1.0, seed=5, size=128)
    big_average, small_average = centered_clip(big, [1.0] * 4), centered_clip(small, [1.0] * 4)
    owns = [big[0], small[0]]
    honest = [big_average - big[0], small_average - small[0]]
    assert share_problem(owns, honest) is None
    for factor, caught in [(20.0, False), (1000.0, True)]:
        lie = [honest[0], factor * small_average - small[0]]
        assert (share_problem(owns, lie) is not None) == caught, factor
        if not caught:
            assert float(lie[1].norm()) <= PART_MAX_RATIO * float(small[0].norm())


def test_a_peer_with_few_samples_is_measured_against_the_last_average():
    """DiLoCo: a peer that took 1 local step while the others took 10 sends a pseudo-gradient ~10x smaller than the
    average (seen in tests/test_robust_swarm.py: 6.7x and 8.2x, honest). Against its own norm alone the honest answer
    fails; against the larger of it and the last round's accepted average it passes, and x1000 is still caught."""
    generator = torch.Generator().manual_seed(6)
    direction = torch.randn(SIZE, generator=generator)
    others = [10 * direction + torch.randn(SIZE, generator=generator) for _ in range(3)]
    small = direction + 0.1 * torch.randn(SIZE, generator=generator)
    average = centered_clip([*others, small], [10.0, 10.0, 10.0, 1.0])
    last = float((average + 0.1 * torch.randn(SIZE, generator=generator)).norm())
    assert "x |own values|" in share_problem([small], [average - small])
    assert share_problem([small], [average - small], [last]) is None
    assert share_problem([small], [1000 * average - small], [last]) is not None
    assert share_problem([small], [-average - small], [last]) is not None


def squares(own: torch.Tensor, average: torch.Tensor) -> tuple[float, float, int]:
    return float(own.double().square().sum()), float(average.double().square().sum()), own.numel()


@pytest.mark.parametrize("signal", [0.1, 1.0, 10.0])
def test_the_gross_check_catches_zeros_and_x1000_for_any_sender_and_passes_the_rest(signal):
    """The check every DiLoCo peer applies, its own values representative or not: zeros, x1000 and noise x1000 fail
    it for each of 16 senders, and so does an honest average for a sender GROSS_RATIO x off the others; the flip and
    the swap (the honest size) pass it, as does an honest average for a sender 20x smaller than the others (a peer
    that took 1 local step where they took 20)."""
    parts, others = gradients(16, signal, seed=7), gradients(16, signal, seed=8)
    average, other_average = centered_clip(parts, [1.0] * 16), centered_clip(others, [1.0] * 16)
    for sender in range(16):
        for attack in REDUCER_ATTACKS:
            lie = lying_average(attack, 1000.0, average, other_average)
            reason = gross_problem(*squares(parts[sender], lie))
            assert (reason is None) == (attack in ("reducer_flip", "reducer_swap")), (attack, sender, reason)
        assert gross_problem(*squares(parts[sender], average)) is None
        assert gross_problem(*squares(parts[sender] / 20, average)) is None
    for factor in (1.01 * GROSS_RATIO, 1 / (1.01 * GROSS_RATIO)):
        assert "x |own values|" in gross_problem(*squares(average * factor, average))
        assert gross_problem(*squares(average * factor, average), max_ratio=1.02 * GROSS_RATIO) is None
    assert gross_problem(*squares(torch.ones(MIN_CHECKED - 1), torch.zeros(MIN_CHECKED - 1))) is None  # too few
    assert gross_problem(*squares(torch.zeros(SIZE), torch.ones(SIZE))) is None  # nothing to compare with
    assert gross_problem(*squares(torch.ones(SIZE), torch.full((SIZE,), float("inf")))) == "not finite"
    own = (torch.arange(0, SIZE, 2, dtype=torch.int32), parts[0][::2])  # the sparse all-reduce's: over the entries
    answer = (torch.arange(SIZE, dtype=torch.int32), average)
    xx, vv, _, size = sparse_sums(own, answer)
    assert gross_problem(xx, vv, size) is None and gross_problem(xx, 0.0, size) is not None


def test_a_peer_that_checks_only_gross_lies_passes_a_flip_and_fails_zeros_excluding_at_once(tmp_path):
    """The container with ``gross_only`` (a DiLoCo peer whose own values are not representative): the flipped
    average passes where the full check rejects it, zeros fail both; with ``drop_gross`` (DiLoCo) the zeros are
    taken as the share's average and nothing counts as failed; through ChecksAnswers' handler a gross lie excludes
    its reducer at once (one peer_excluded event), where a failed full check is one strike of 3."""
    from lean_transformer.swarm.averaging.answer_check import reject_answer
    torch.manual_seed(2)
    tensors = [torch.randn(4000) + 1, torch.randn(3000) + 1]
    for gross_only in (False, True):
        for attack, rejected_as in (("reducer_flip", None if gross_only else False), ("reducer_zeros", True)):
            container, rejected = checked_container(tensors, return_deltas=False)
            container.gross_only = gross_only
            outputs, rejected, _ = run_group(tensors, lambda mean: lying_average(attack, 1000.0, mean, mean),
                                             return_deltas=False, container=(container, rejected))
            assert [gross for _, _, gross in rejected] == ([] if rejected_as is None else [rejected_as]), attack
    # DiLoCo (drop_gross): the zeroed share is taken as the zeros every member sees, and the round goes on
    container, rejected = checked_container(tensors, return_deltas=False)
    container.gross_only, container.drop_gross = True, True
    outputs, rejected, _ = run_group(tensors, torch.zeros_like, return_deltas=False, container=(container, rejected))
    flat_output, flat_own = torch.cat(outputs), torch.cat(tensors)
    own_share = container._input_parts_by_peer[0]
    boundary = sum(part.numel() for part, _ in own_share)  # this peer's share first, the reducer's after it
    assert [gross for _, _, gross in rejected] == [True] and container.failed_size == 0
    assert torch.equal(flat_output[boundary:], torch.zeros_like(flat_own[boundary:]))
    flat_partner = torch.cat([tensor.flip(0) for tensor in tensors])
    torch.testing.assert_close(flat_output[:boundary], (flat_own[:boundary] + flat_partner[:boundary]) / 2,
                               rtol=1e-4, atol=1e-5)
    exclusions = Exclusions(strikes=3, window=10)
    open_events(tmp_path / "events.jsonl", "trainer")
    try:
        exclusions.begin_round()
        reject_answer(exclusions, "flipper", "the average does not correlate", SIZE, gross=False)
        reject_answer(exclusions, "zeroes", "|average| is 0 x |own values|", SIZE, gross=True)
        assert exclusions.excluded() == ["zeroes"]
        exclusions.begin_round()
        reject_answer(exclusions, "zeroes", "again", SIZE, gross=True)  # already excluded: no second event
    finally:
        close_events()
    assert [event["source"] for event in read_events(tmp_path / "events.jsonl", "peer_excluded")] == ["zeroes"]
    assert [(event["source"], event["gross"]) for event in read_events(tmp_path / "events.jsonl", "answer_rejected")
            ] == [("flipper", False), ("zeroes", True), ("zeroes", True)]


def test_small_zero_and_not_finite_shares():
    assert share_problem([torch.ones(PART_MIN_CHECKED - 1)], [-1000 * torch.ones(PART_MIN_CHECKED - 1)]) is None
    assert share_problem([torch.ones(MIN_CHECKED - 1)], [-2 * torch.ones(MIN_CHECKED - 1)]) is None  # a flip
    assert "part 0" in share_problem([torch.ones(MIN_CHECKED - 1)], [-1000 * torch.ones(MIN_CHECKED - 1)])
    assert share_problem([torch.zeros(SIZE)], [1000 * torch.ones(SIZE)]) is None  # nothing to compare with
    assert share_problem([torch.ones(SIZE)], [torch.full((SIZE,), float("nan"))]) == "not finite"


def answer_at_cosine(own: torch.Tensor, cosine: float) -> torch.Tensor:
    """An answer of ``own``'s norm whose cosine with ``own`` is ``cosine`` (the rest orthogonal to it)."""
    other = torch.randn(own.shape, generator=torch.Generator().manual_seed(1))
    other -= (other @ own) / (own @ own) * own
    return cosine * own + (1 - cosine ** 2) ** 0.5 * other * own.norm() / other.norm()


def test_diloco_answers_fail_the_direction_check_only_below_the_outer_bound():
    """DiLoCo's honest pseudo-gradients can anticorrelate with their group's average (cosines -0.127 and -0.307 seen
    in step with the group); flipped answers sat at -0.65 to -0.99. The dense and the sparse rule both take the
    bound."""
    own = torch.randn(SIZE, generator=torch.Generator().manual_seed(0))
    indices = torch.arange(SIZE)
    for cosine, fails_outer in ((-0.127, False), (-0.307, False), (-0.49, False), (-0.51, True), (-0.65, True)):
        answer = answer_at_cosine(own, cosine)
        assert "does not correlate" in share_problem([own], [answer - own])  # gradient averaging: at 0
        outer = share_problem([own], [answer - own], max_ratio=OUTER_MAX_RATIO, min_cosine=OUTER_MIN_COSINE)
        sparse = sparse_share_problem((indices, own), (indices, answer), max_ratio=OUTER_MAX_RATIO,
                                      min_cosine=OUTER_MIN_COSINE)
        assert outer == sparse and (outer is not None) == fails_outer, (cosine, outer)
    assert share_problem([own], [answer_at_cosine(own, 0.05) - own], min_cosine=OUTER_MIN_COSINE) is None


def checked_container(tensors: list, return_deltas: bool, excluded: bool = False) -> tuple[CheckedParts, list]:
    """hivemind's container for a group of two (this peer at index 0, the reducer at index 1), made checking."""
    container = TensorPartContainer(tensors, peer_fractions=(1.0, 1.0), return_deltas=return_deltas,
                                    part_size_bytes=4 * 1024)
    rejected = []
    container.__class__ = CheckedParts
    container.own_index, container.held = 0, {}
    container.reference, container.learned, container.sums = {}, {}, {}
    container.on_rejected = lambda peer_index, reason, gross: rejected.append((peer_index, reason, gross))
    container.is_excluded = lambda peer_index: excluded
    return container, rejected


def run_group(tensors: list, answers_of_reducer, return_deltas: bool = True, excluded: bool = False,
              fail_after: int = None, container: tuple = None) -> tuple[list, list, CheckedParts]:
    """The own share answered honestly (the mean with a partner), the reducer's share by ``answers_of_reducer``;
    the output tensors, the rejections, the container (``container``: one made by :func:`checked_container`)."""
    container, rejected = checked_container(tensors, return_deltas, excluded) if container is None else container
    partner = [tensor.flip(0) for tensor in tensors]
    flat_partner = torch.cat([tensor.reshape(-1) for tensor in partner])

    async def run() -> list:
        offset = 0
        for peer_index in range(2):
            for part_index, (part, _) in enumerate(container._input_parts_by_peer[peer_index]):
                mean = (part + flat_partner[offset:offset + part.numel()]) / 2
                offset += part.numel()
                if peer_index == 1 and fail_after is not None and part_index == fail_after:
                    container.register_failed_reducer(1)
                    break
                answer = mean if peer_index == 0 else answers_of_reducer(mean)
                container.register_processed_part(peer_index, part_index,
                                                  answer - part if return_deltas else answer)
        return [tensor async for tensor in container.iterate_output_tensors()]

    return asyncio.run(asyncio.wait_for(run(), 10)), rejected, container


@pytest.mark.parametrize("return_deltas", [True, False])
def test_the_container_takes_honest_answers_and_replaces_a_lying_reducers_share(return_deltas):
    torch.manual_seed(0)
    tensors = [torch.randn(4000) + 1, torch.randn(3000) + 1]  # parts of 1024 values: the reducer holds ~3.5k
    means = [(tensor + tensor.flip(0)) / 2 for tensor in tensors]
    outputs, rejected, container = run_group(tensors, lambda mean: mean, return_deltas)
    assert rejected == [] and container.failed_size == 0
    for key, mean in enumerate(means):  # each tensor's RMS of the accepted average: the next round's reference
        assert container.learned[key] == pytest.approx(float(mean.square().mean().sqrt()), rel=1e-4)
    for output, tensor, mean in zip(outputs, tensors, means):
        torch.testing.assert_close(output if not return_deltas else tensor + output, mean, rtol=1e-4, atol=1e-5)

    outputs, rejected, container = run_group(tensors, lambda mean: -1000 * mean, return_deltas)
    assert [(peer, gross) for peer, _, gross in rejected] == [(1, True)] and "x |own values|" in rejected[0][1]
    assert 1 not in container.learned  # a rejected share teaches nothing
    results = [output if not return_deltas else tensor + output for output, tensor in zip(outputs, tensors)]
    flat_result, flat_mean = torch.cat(results), torch.cat(means)
    flat_own = torch.cat(tensors)
    boundary = flat_own.numel() - container.failed_size  # the reducer's share is the end of the vector
    assert 0 < container.failed_size < flat_own.numel()
    torch.testing.assert_close(flat_result[:boundary], flat_mean[:boundary], rtol=1e-4, atol=1e-5)
    assert torch.equal(flat_result[boundary:], flat_own[boundary:])  # its own values, exactly


def test_an_excluded_or_failing_reducer_leaves_own_values():
    torch.manual_seed(1)
    tensors = [torch.randn(4000) + 1, torch.randn(3000) + 1]
    for options in (dict(excluded=True), dict(fail_after=2)):
        outputs, rejected, container = run_group(tensors, lambda mean: mean, **options)
        assert rejected == []
        results, own = torch.cat([t + o for t, o in zip(tensors, outputs)]), torch.cat(tensors)
        boundary = own.numel() - container.failed_size
        assert 0 < container.failed_size < own.numel(), options
        assert torch.equal(results[boundary:], own[boundary:]), options  # half an answer is not used either


def test_strikes_exclude_a_peer_once_for_a_while(tmp_path):
    now = [1000.0]
    exclusions = Exclusions(strikes=3, window=10, duration=600.0, clock=lambda: now[0])
    open_events(tmp_path / "events.jsonl", "trainer")
    try:
        for round_index in range(12):  # a strike every 5th round: never 3 within 10
            exclusions.begin_round()
            if round_index % 5 == 0:
                assert not exclusions.strike("slow", "unlucky")
        assert not exclusions.is_excluded("slow")
        exclusions.begin_round()
        assert not exclusions.strike("liar", "x1000") and not exclusions.strike("liar", "again, same round")
        exclusions.begin_round()
        assert not exclusions.strike("liar", "x1000")
        exclusions.begin_round()
        assert exclusions.strike("liar", "x1000")
        assert exclusions.is_excluded("liar") and exclusions.excluded() == ["liar"]
        for _ in range(5):
            exclusions.begin_round()
            assert not exclusions.strike("liar", "while excluded")
        now[0] += 599.0
        assert exclusions.is_excluded("liar")
        now[0] += 1.0
        assert not exclusions.is_excluded("liar") and exclusions.excluded() == []
    finally:
        close_events()
    events = read_events(tmp_path / "events.jsonl", "peer_excluded")
    assert [(event["source"], event["until"]) for event in events] == [("liar", 1600.0)]
    with pytest.raises(ValueError):
        Exclusions(strikes=4, window=3)


def test_the_sparse_reducer_strikes_a_far_out_sender_and_weighs_an_excluded_one_zero(tmp_path):
    """DiLoCo's top-k all-reduce: the reducer of the whole range (a real P2P; the senders' parts handed to it as its
    handler does) strikes a top-k part x -1000 twice, excludes its sender, and then answers the honest senders'
    CenteredClip (float16 on the wire)."""
    from hivemind.averaging.allreduce import AveragingMode
    from hivemind.p2p import P2P, PeerID

    from lean_transformer.swarm.averaging.sparse_allreduce import SparseAllReduce

    generator = torch.Generator().manual_seed(3)
    common = torch.randn(SIZE, generator=generator)
    dense = [common + 0.5 * torch.randn(SIZE, generator=generator) for _ in range(4)]
    dense[3] = -1000 * dense[3]
    k = SIZE // 20
    parts = []
    for vector in dense:
        indices = vector.abs().topk(k).indices.sort().values
        parts.append((indices.to(torch.int32), vector[indices].to(torch.float16)))
    exclusions = Exclusions(strikes=2, window=10)

    async def rounds() -> list:
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            senders = [p2p.peer_id, *(PeerID(f"sender {index}".encode()) for index in range(3))]
            answers = []
            for _ in range(3):
                runner = SparseAllReduce(p2p=p2p, servicer_type=object, prefix=None, group_id=b"group",
                                         ordered_peer_ids=senders, modes=[AveragingMode.NODE] * 4,
                                         peer_fractions=[1.0, 0.0, 0.0, 0.0], total_size=SIZE, weight=1.0,
                                         timeout=5.0, aggregation="centered_clip", exclusions=exclusions)
                for sender, (indices, values) in zip(senders, parts):
                    runner._accumulate(sender, 1.0, indices, values)  # what its rpc_aggregate_part does
                answers.append(await asyncio.wait_for(runner._result, 5))
            return [senders[3].to_base58(), answers]
        finally:
            await p2p.shutdown()

    open_events(tmp_path / "events.jsonl", "trainer")
    try:
        liar, answers = asyncio.run(rounds())
    finally:
        close_events()
    assert exclusions.excluded() == [liar]
    clipped = read_events(tmp_path / "events.jsonl", "sender_clipped")
    assert [event["source"] for event in clipped] == [liar, liar]  # not in the third round: excluded by then
    filled = []
    for indices, values in parts[:3]:
        row = torch.zeros(SIZE)
        row[indices.long()] = values.float()
        filled.append(row)
    union, values = answers[2]
    expected = centered_clip(filled, [1.0] * 3)
    torch.testing.assert_close(values, expected[union.long()].to(torch.float16))
    first_union, first = answers[0]  # while the liar counted: clipped (under the mean it moves the result ~250x)
    assert float((first.float() - expected[first_union.long()]).norm()) < float(expected.norm())


@pytest.mark.parametrize("in_step", [True, False])
def test_the_reducer_strikes_a_far_out_sender_and_weighs_an_excluded_one_zero(tmp_path, in_step):
    """In a group out of step (``strikes=False``) the far-out part is clipped alike, with events, and no strike."""
    generator = torch.Generator().manual_seed(2)
    common = torch.randn(SIZE, generator=generator)
    senders = [common + 0.5 * torch.randn(SIZE, generator=generator) for _ in range(4)]
    senders[3] = -1000 * senders[3]
    ids = ["a", "b", "c", "liar"]
    exclusions = Exclusions(strikes=2, window=10)

    def reduce() -> torch.Tensor:
        exclusions.begin_round()

        async def run() -> list:
            reducer = CenteredClipReducer([torch.Size([SIZE])], 4, ids, exclusions, strikes=in_step)
            return await asyncio.gather(*(reducer.accumulate_part(index, 0, part) for index, part in
                                          enumerate(senders)))
        return asyncio.run(asyncio.wait_for(run(), 10))[0]

    open_events(tmp_path / "events.jsonl", "trainer")
    if not in_step:
        try:
            for _ in range(3):
                torch.testing.assert_close(reduce(), centered_clip(senders, [1.0] * 4), rtol=1e-4, atol=1e-5)
        finally:
            close_events()
        assert exclusions.excluded() == []
        clipped = read_events(tmp_path / "events.jsonl", "sender_clipped")
        assert [(event["source"], event["struck"]) for event in clipped] == [("liar", False)] * 3
        return
    try:
        first = reduce()
        torch.testing.assert_close(first, centered_clip(senders, [1.0] * 4), rtol=1e-4, atol=1e-5)
        assert not exclusions.is_excluded("liar")
        reduce()
        assert exclusions.excluded() == ["liar"]
        third = reduce()  # its part now weighs 0: the result is the others' (their mean: none is clipped)
        torch.testing.assert_close(third, centered_clip(senders[:3], [1.0] * 3), rtol=1e-4, atol=1e-5)
    finally:
        close_events()
    clipped = read_events(tmp_path / "events.jsonl", "sender_clipped")
    assert [(event["source"], event["struck"]) for event in clipped] == [("liar", True)] * 2
    assert all(float(event["reason"].split(" x tau")[0].split()[-1]) > FAR_OUT for event in clipped)


def test_a_group_is_in_step_when_its_members_that_send_values_gathered_one_label():
    """hivemind's layout of a member's gathered bytes: its serializer's [bandwidth, mode, user data]."""
    from hivemind.averaging.allreduce import AveragingMode
    from hivemind.utils import MSGPackSerializer as serializer

    def member(label, mode=AveragingMode.NODE) -> bytes:
        return serializer.dumps([100.0, mode.value, serializer.dumps(label)])

    assert group_in_step(serializer, [member(5), member(5), member(5, AveragingMode.CLIENT)])
    assert group_in_step(serializer, [member(None), member(None)])  # hivemind's rounds gather nothing
    assert group_in_step(serializer, [member(5), member(4, AveragingMode.AUX)])  # an aux peer sends no values
    assert not group_in_step(serializer, [member(5), member(4)])
    assert not group_in_step(serializer, [member(5), member(4, AveragingMode.CLIENT)])
    assert not group_in_step(serializer, [member(5), member(None)])
    assert not group_in_step(serializer, [member(5), member("5")])  # not a label: none
    assert not group_in_step(serializer, [member(5), b"\x00junk"])  # not hivemind's layout


def peer_id(name: str) -> str:
    return "12D3KooW" + name * 44


def test_records_carry_exclusions_and_the_table_marks_a_peer_most_others_exclude(tmp_path):
    streams = {name: tmp_path / f"{name}.jsonl" for name in "abcd"}
    for name, path in streams.items():
        path.touch()
    reporters = {name: MetricsReporter(peer_id(name), False, streams[name]) for name in "abcd"}
    for name in "abc":  # the honest ones exclude d; d claims to exclude a
        open_events(streams[name], "trainer")
        emit("peer_excluded", source=peer_id("d"), reason="x1000", until=4e9)
        emit("peer_excluded", source=peer_id("x"), reason="long ago", until=1.0)  # expired
        close_events()
    open_events(streams["d"], "trainer")
    emit("peer_excluded", source=peer_id("a"), reason="a lie", until=4e9)
    close_events()
    records = {name.encode(): reporter.record(1, 1.0, samples=8, loss_sum=1.0, mini_steps=1)
               for name, reporter in reporters.items()}
    assert records[b"a"].excluded == (peer_id("d"),) and records[b"d"].excluded == (peer_id("a"),)
    assert reporters["a"].excluded == {peer_id("d"): 4e9}  # what the trainer hands SwarmOptimizer.distrust
    assert LocalMetrics.model_validate(records[b"a"].model_dump()) == records[b"a"]
    older = LocalMetrics(epoch=1, samples_per_second=1.0, samples_accumulated=8, loss_sum=1.0, mini_steps=1)
    assert older.excluded is None  # records of older trainers still parse
    table = PeerTable()
    table.update(records, now=1.0)
    marked = {row.peer_id for row in table.rows() if row.excluded}
    assert marked == {peer_id("d")} and len(excluded_keys(records)) == 1
    assert summary(table.rows()).endswith(f"1 excluded (...{peer_id('d')[-8:]})")


def top_k(vector: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    indices = vector.abs().topk(k).indices.sort().values
    return indices.to(torch.int32), vector[indices].to(torch.float16)


def sparse_mean(parts: list[tuple[torch.Tensor, torch.Tensor]], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    total = torch.zeros(size)
    for indices, values in parts:
        total[indices.long()] += values.float() / len(parts)
    union = torch.unique(torch.cat([indices.long() for indices, _ in parts]))
    return union.to(torch.int32), total[union].to(torch.float16)


@pytest.mark.parametrize("senders", [4, 16])
def test_sparse_answers_honest_pass_and_lies_fail(senders):
    """DiLoCo's top-k shares: the honest sparse mean passes for every sender; a flipped, zeroed or x1000 answer
    fails for every sender, noise x1000 too; an answer without the sender's entries fails."""
    k = SIZE // 4
    parts = [top_k(vector, k) for vector in gradients(senders, signal=0.5, seed=senders)]
    union, average = sparse_mean(parts, SIZE)
    assert all(sparse_share_problem(part, (union, average)) is None for part in parts)
    generator = torch.Generator().manual_seed(0)
    noise = 1000 * average.float().norm() * torch.randn(len(average), generator=generator) / len(average) ** 0.5
    lies = {"flip": -average, "zeros": torch.zeros_like(average), "x1000": average.float() * 1000,
            "noise": (average.float() + noise)}
    for name, lie in lies.items():
        for part in parts:
            assert sparse_share_problem(part, (union, lie.to(torch.float16))) is not None, (name, senders)
    elsewhere = torch.arange(SIZE, SIZE + len(average), dtype=torch.int32)  # entries none of the senders sent
    assert "does not correlate" in sparse_share_problem(parts[0], (elsewhere, average))
    assert sparse_share_problem(top_k(gradients(1, 0.5)[0], MIN_CHECKED - 1), (union, -average)) is None  # too few


class _Reducer(ServicerBase):
    """Serves one sparse all-reduce ``runner``'s range; with ``lie``, its answers' values multiplied by it; with no
    runner (a peer counted into the group that never started its round), it holds every stream unanswered for
    ``HOLD`` seconds, as hivemind's averager waits for a group it never registers."""

    HOLD = 60.0
    runner = None
    lie = None

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if self.runner is None:
            await asyncio.sleep(self.HOLD)
            return
        index = 0
        async for answer in self.runner.rpc_aggregate_part(stream, context):
            if self.lie is not None and index == 1:  # the second message carries the values
                lie = self.lie * deserialize_torch_tensor(answer.tensor_part)
                answer = averaging_pb2.AveragingData(
                    tensor_part=serialize_torch_tensor(lie, runtime_pb2.CompressionType.NONE))
            index += 1
            yield answer


class ReducerServicer(AnswersDelivered, _Reducer):
    """The reducer, its answers delivered as DiLoCo's averager delivers them (it serves the runner through
    ``AnswersDelivered``): the caller closes first, once answered."""


def test_the_sparse_all_reduce_fails_the_round_for_a_peer_that_catches_a_lying_reducer(tmp_path):
    """Two real P2P peers run DiLoCo's sparse all-reduce, each reducing half of the vector. Honest: both get the same
    average. When the second one answers its half sign-flipped, the first (``check_answers``) rejects it: an
    ``answer_rejected`` event and a strike against it, and the round fails for the first peer only; the second
    peer's own round completes (its answers had been given). Answering zeros instead, it fails the gross check
    (``gross_ratio``, every DiLoCo peer's): the first peer takes zeros for that half, its round completes, and the
    liar is excluded at once."""
    from hivemind.averaging.allreduce import AllreduceException, AveragingMode
    from hivemind.p2p import P2P

    from lean_transformer.swarm.averaging.sparse_allreduce import SparseAllReduce

    size = 2 * SIZE
    vectors = gradients(2, signal=0.5, seed=5, size=size)
    parts = [top_k(vector, size // 2) for vector in vectors]
    exclusions = Exclusions(strikes=3, window=10)

    async def round_of_two(lie: float = None) -> list:
        first = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        peers = [first, await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                         initial_peers=await first.get_visible_maddrs())]
        try:
            servicers = [ReducerServicer(), ReducerServicer()]
            servicers[1].lie = lie
            ordered = [peer.peer_id for peer in peers]
            runners = []
            for index, (p2p, servicer) in enumerate(zip(peers, servicers)):
                await servicer.add_p2p_handlers(p2p)
                servicer.runner = SparseAllReduce(
                    p2p=p2p, servicer_type=ReducerServicer, prefix=None, group_id=b"group", ordered_peer_ids=ordered,
                    modes=[AveragingMode.NODE] * 2, peer_fractions=[1.0, 1.0], total_size=size, weight=1.0,
                    timeout=10.0, aggregation="centered_clip", exclusions=exclusions if index == 0 else None,
                    check_answers=index == 0, gross_ratio=GROSS_RATIO if index == 0 else None)
                runners.append(servicer.runner)
            return [ordered[1].to_base58(), *await asyncio.gather(
                *(runner.run(indices.long(), values) for runner, (indices, values) in zip(runners, parts)),
                return_exceptions=True)]
        finally:
            for p2p in peers:
                await p2p.shutdown()

    open_events(tmp_path / "events.jsonl", "trainer")
    try:
        _, honest, second = asyncio.run(round_of_two())
        assert isinstance(honest, torch.Tensor) and torch.equal(honest, second)
        assert read_events(tmp_path / "events.jsonl", "answer_rejected") == []
        _, zeroed, second = asyncio.run(round_of_two(lie=0.0))
        assert read_events(tmp_path / "events.jsonl", "peer_excluded") != []  # at the first rejection
        exclusions._until.clear()
        liar, first, second = asyncio.run(round_of_two(lie=-1.0))
    finally:
        close_events()
    half = size // 2
    assert torch.equal(zeroed[:half], honest[:half]) and torch.equal(zeroed[half:], torch.zeros(half))
    assert isinstance(first, AllreduceException) and "answers failed the check" in str(first), first
    assert isinstance(second, torch.Tensor)
    rejected = read_events(tmp_path / "events.jsonl", "answer_rejected")
    assert [event["gross"] for event in rejected] == [True, False] and rejected[1]["source"] == liar, rejected
    assert "x |own values|" in rejected[0]["reason"] and "does not correlate" in rejected[1]["reason"]
