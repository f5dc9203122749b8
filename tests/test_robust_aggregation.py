"""CenteredClip (lean_transformer.swarm.averaging.robust) against a float64 reference written here, and its reducer
driven as hivemind's all-reduce drives one (senders' parts arriving concurrently, a sender failing half-way)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from lean_transformer.swarm.averaging.exclusion import FAR_OUT
from lean_transformer.swarm.averaging.robust import (TAU_FACTOR, WEIGHT_CAP, CenteredClipReducer, centered_clip,
                                                     clip_and_distances)

RTOL, ATOL = 1e-4, 1e-5
SIZE = 4096


def clip_once(parts: list, weights: list) -> tuple[np.ndarray, float]:
    """One CenteredClip pass in float64, iterated to convergence: (result, tau)."""
    kept = [(np.asarray(p, np.float64).ravel(), w) for p, w in zip(parts, weights) if w > 0]
    x, w = np.stack([p for p, _ in kept]), np.array([w for _, w in kept], np.float64)
    v = np.median(x, axis=0)  # one vote per sender
    from_start = np.linalg.norm(x - v, axis=1)
    tau = TAU_FACTOR * np.median(from_start)
    # no sender counts more than 2x the median sender, nor more than it when it starts beyond tau
    w = np.minimum(w, np.where(from_start > tau, 1.0, WEIGHT_CAP) * np.median(w))
    for _ in range(10_000):
        d = x - v
        factor = np.minimum(1.0, tau / np.maximum(np.linalg.norm(d, axis=1), 1e-300))
        step = (w * factor) @ d / w.sum()
        v = v + step
        if np.linalg.norm(step) < 1e-13 * tau:
            break
    return v, tau


def reference(parts: list, weights: list) -> tuple[np.ndarray, float]:
    """CenteredClip in float64: (result, tau); parts that end over FAR_OUT x tau out are left out in a second pass
    (while fewer than half of the parts are)."""
    v, tau = clip_once(parts, weights)
    far = [w > 0 and np.linalg.norm(np.asarray(p, np.float64).ravel() - v) > FAR_OUT * tau
           for p, w in zip(parts, weights)]
    if any(far) and 2 * sum(far) < sum(w > 0 for w in weights):
        return clip_once(parts, [0.0 if out else w for w, out in zip(weights, far)])
    return v, tau


def honest(count: int, seed: int = 0) -> list[torch.Tensor]:
    """Gradients of one model on different batches: a common direction plus each sender's own noise."""
    generator = torch.Generator().manual_seed(seed)
    common = torch.randn(SIZE, generator=generator)
    return [common + 0.5 * torch.randn(SIZE, generator=generator) for _ in range(count)]


def assert_matches_reference(result: torch.Tensor, parts: list, weights: list) -> tuple[np.ndarray, float]:
    expected, tau = reference(parts, weights)
    assert result.dtype == torch.float32
    torch.testing.assert_close(result.double(), torch.from_numpy(expected), rtol=RTOL, atol=ATOL)
    return expected, tau


def weighted_mean(parts: list, weights: list) -> torch.Tensor:
    return sum(w * p.double() for p, w in zip(parts, weights)) / sum(weights)


@pytest.mark.parametrize("weights", [[1, 1, 1, 1], [1, 2, 3, 10], [64, 8, 8, 8, 8, 8, 8, 16]])
def test_honest_inputs_give_their_weighted_mean(weights):
    """... with every weight capped at WEIGHT_CAP x the median weight (64 counts as 16 among 8s)."""
    parts = honest(len(weights))
    result = centered_clip(parts, weights)
    assert_matches_reference(result, parts, weights)
    capped = [min(weight, WEIGHT_CAP * float(np.median(weights))) for weight in weights]
    torch.testing.assert_close(result.double(), weighted_mean(parts, capped), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("senders, attackers, attacker_weight", [(4, 1, 1.0), (16, 3, 1.0), (16, 7, 1.0), (4, 1, 2.0)])
@pytest.mark.parametrize("attack", ["sign_flip", "random_direction"])
def test_attackers_far_out_are_left_out(senders, attackers, attacker_weight, attack):
    """BTARD's attacks, at x1000: the mean goes with the attackers; under CenteredClip they end far out (over
    FAR_OUT x tau), and the second pass leaves them out: the result is the honest senders' weighted mean."""
    parts = honest(senders, seed=senders + attackers)
    generator = torch.Generator().manual_seed(7)
    direction = torch.randn(SIZE, generator=generator)
    for index in range(attackers):
        parts[index] = (-1000 * parts[index] if attack == "sign_flip"
                        else 1000 * parts[index].norm() * direction / direction.norm())
    weights = [attacker_weight] * attackers + [1.0 + index % 3 for index in range(senders - attackers)]
    result, distances = clip_and_distances(parts, weights)
    assert_matches_reference(result, parts, weights)
    assert all(distance > FAR_OUT for distance in distances[:attackers])
    assert all(distance < 1 for distance in distances[attackers:])
    honest_weights = weights[attackers:]
    capped = [min(weight, WEIGHT_CAP * float(np.median(honest_weights))) for weight in honest_weights]
    torch.testing.assert_close(result.double(), weighted_mean(parts[attackers:], capped), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("senders, attackers", [(4, 1), (16, 3), (16, 7)])
def test_attackers_inside_far_out_move_the_result_at_most_their_share_of_tau(senders, attackers):
    """Attackers that stay inside FAR_OUT x tau (here 5 x the honest noise from the honest mean, in one direction)
    are clipped, not left out: they move the result at most a / (1 - a) x tau from the honest mean (a: their share
    of the weight with each capped at 2x the median, at least what the steps give them)."""
    parts = honest(senders, seed=senders + attackers)
    generator = torch.Generator().manual_seed(7)
    direction = torch.randn(SIZE, generator=generator)
    noise = float((parts[-1] - torch.stack(parts[attackers:]).mean(0)).norm())
    for index in range(attackers):
        parts[index] = torch.stack(parts[attackers:]).mean(0) + 5 * noise * direction / direction.norm()
    weights = [1.0] * attackers + [1.0 + index % 3 for index in range(senders - attackers)]
    result, distances = clip_and_distances(parts, weights)
    _, tau = assert_matches_reference(result, parts, weights)
    assert all(1 < distance <= FAR_OUT for distance in distances[:attackers])
    weights = [min(weight, WEIGHT_CAP * float(np.median(weights))) for weight in weights]  # as the steps count them
    honest_mean = weighted_mean(parts[attackers:], weights[attackers:])
    share = sum(weights[:attackers]) / sum(weights)
    error = float((result.double() - honest_mean).norm())
    assert error <= share / (1 - share) * tau * (1 + 1e-4)


def test_a_sender_cannot_inflate_its_weight():
    """A liar that claims 1000x the samples of the others weighs as much as one that claims the cap (2x), exactly;
    its pull stays within share / (1 - share) x tau of the honest mean (share 2/5), where with its claim believed
    (share 1000/1003) CenteredClip would walk all the way to it."""
    parts = honest(3) + [-1000 * honest(1, seed=1)[0]]
    inflated, capped = centered_clip(parts, [1, 1, 1, 1000]), centered_clip(parts, [1, 1, 1, WEIGHT_CAP])
    assert torch.equal(inflated, capped)
    _, tau = assert_matches_reference(inflated, parts, [1, 1, 1, 1000])
    share = WEIGHT_CAP / (WEIGHT_CAP + 3)
    assert float((inflated - torch.stack(parts[:3]).mean(0)).norm()) <= share / (1 - share) * tau * (1 + 1e-4)


def test_liars_below_half_of_the_senders_stay_below_half_of_the_weight():
    """2 liars among 5 that flip their honest parts (x -1: norms like the honest ones') and claim 10x the samples:
    they start beyond tau, so each counts as the median sender (share 2/5) and the result stays within
    2/3 x tau of the honest mean. Capped at 2x the median alone they held 4/7 of the weight, and the result pointed
    away from the honest mean (cosine -0.45)."""
    parts = honest(5, seed=3)
    parts[0], parts[1] = -parts[0], -parts[1]
    weights = [10.0, 10.0, 1.0, 1.0, 1.0]
    result = centered_clip(parts, weights)
    _, tau = assert_matches_reference(result, parts, weights)
    honest_mean = weighted_mean(parts[2:], weights[2:])
    assert float((result.double() - honest_mean).norm()) <= (2 / 5) / (3 / 5) * tau * (1 + 1e-4)
    assert float(torch.cosine_similarity(result.double(), honest_mean, dim=0)) > 0.8


def test_degenerate_cases_are_exact():
    parts = honest(3, seed=2)
    assert torch.equal(centered_clip(parts[:1], [5.0]), parts[0])
    assert torch.equal(centered_clip([parts[0]] * 4, [1.0, 2.0, 3.0, 4.0]), parts[0])
    # weight 0 (a cancelled round) and non-finite parts or weights count for nothing
    assert torch.equal(centered_clip(parts, [0.0, 2.0, 0.0]), parts[1])
    poisoned = parts[0].clone()
    poisoned[5] = float("nan")
    assert torch.equal(centered_clip([poisoned, parts[1], parts[2]], [1.0, 1.0, 1.0]),
                       centered_clip(parts[1:], [1.0, 1.0]))
    assert torch.equal(centered_clip(parts, [float("inf"), 1.0, 1.0]), centered_clip(parts[1:], [1.0, 1.0]))
    assert torch.equal(centered_clip(parts, [0.0, 0.0, 0.0]), torch.zeros(SIZE))
    # two senders: the median is their midpoint, both are within tau, the result is their weighted mean
    torch.testing.assert_close(centered_clip(parts[:2], [1.0, 3.0]).double(),
                               weighted_mean(parts[:2], [1.0, 3.0]), rtol=RTOL, atol=ATOL)
    # most senders on one value (one vote each, whatever their weights): the others are clipped to radius 0
    assert torch.equal(centered_clip([parts[0], parts[0], parts[1]], [1.0, 1.0, 10.0]), parts[0])


def test_the_reducer_clips_each_part_and_leaves_out_a_sender_that_failed():
    """Four senders, three parts arriving concurrently; sender 3 fails after its first part (as hivemind's runner
    reports a sender that stopped sending): parts 1 and 2 are aggregated from the other three."""
    shapes = [torch.Size([1000]), torch.Size([1000]), torch.Size([24])]
    senders = [honest(3, seed=part) for part in range(3)]
    for part in senders:
        part.append(-1000 * part[0])
    weights = [1.0, 2.0, 3.0, 4.0]

    async def run() -> list:
        reducer = CenteredClipReducer(shapes, num_senders=4)

        async def send(sender: int) -> list:
            results = []
            for index, shape in enumerate(shapes):
                if sender == 3 and index == 1:
                    reducer.on_sender_failed(sender)
                    return results
                results.append(await reducer.accumulate_part(sender, index, senders[index][sender][:shape[0]],
                                                             weight=weights[sender]))
            return results

        results = await asyncio.wait_for(asyncio.gather(*(send(sender) for sender in range(4))), 10)
        assert reducer.finished.is_set()
        return results

    results = asyncio.run(run())
    for sender in range(3):
        for index, shape in enumerate(shapes):
            arrived = 4 if index == 0 else 3
            expected = centered_clip([senders[index][s][:shape[0]] for s in range(arrived)], weights[:arrived])
            torch.testing.assert_close(results[sender][index], expected, rtol=RTOL, atol=ATOL)  # in arrival order
    assert len(results[3]) == 1 and torch.equal(results[3][0], results[0][0])
    assert_matches_reference(results[0][0], [senders[0][s][:1000] for s in range(4)], weights)


def test_a_part_that_arrives_after_the_round_was_finalized_is_cancelled_like_the_waiting_ones():
    """hivemind finalizes a reducer when its round ends (a timeout, a failed group) while senders may still stream:
    a part that arrives then ends cancelled, as the parts already waiting do, not with an error nobody reads."""
    async def run() -> tuple:
        reducer = CenteredClipReducer([torch.Size([4])], num_senders=2)
        waiting = asyncio.create_task(reducer.accumulate_part(0, 0, torch.ones(4)))
        await asyncio.sleep(0)
        reducer.finalize()
        late = asyncio.create_task(reducer.accumulate_part(1, 0, torch.ones(4)))
        await asyncio.wait({waiting, late}, timeout=5)
        return waiting.cancelled(), late.cancelled()

    assert asyncio.run(run()) == (True, True)


def test_a_waiting_sender_that_is_cancelled_leaves_the_part_to_the_others():
    """Sender 0's wait for part 0 is cancelled (its stream ended: it left); sender 1's part still completes the
    part, and sender 1 gets the aggregate of both."""
    parts = [torch.zeros(4), torch.ones(4)]

    async def run() -> torch.Tensor:
        reducer = CenteredClipReducer([torch.Size([4])], num_senders=2)
        waiting = asyncio.create_task(reducer.accumulate_part(0, 0, parts[0]))
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.wait({waiting}, timeout=5)
        return await asyncio.wait_for(reducer.accumulate_part(1, 0, parts[1]), 5)

    torch.testing.assert_close(asyncio.run(run()), centered_clip(parts, [1.0, 1.0]), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("magnitude", [1e-38, 1e-30, 1.0, 1e30, 3e38])
def test_any_finite_input_gives_a_finite_result(magnitude):
    """Inputs near float32's largest values (whose distances' squares overflow) or tiny ones (whose squares underflow
    to 0) give a finite result wherever one liar sits (at float32's largest values), and the weighted mean when all
    are honest (compared relative to their magnitude)."""
    parts = honest(4, seed=3)
    largest = float(torch.stack(parts).abs().max())
    parts = [(part.double() * (magnitude / largest)).float() for part in parts]  # |values| up to magnitude
    liar = torch.full((SIZE,), torch.finfo(torch.float32).max)
    for inputs in (parts, parts[:3] + [liar], parts[:3] + [-liar]):
        result = centered_clip(inputs, [1.0, 1.0, 1.0, 1.0])
        assert bool(torch.isfinite(result).all())
    honest_only = centered_clip(parts, [1.0, 2.0, 1.0, 2.0])
    torch.testing.assert_close(honest_only.double() / magnitude, weighted_mean(parts, [1.0, 2.0, 1.0, 2.0]) / magnitude,
                               rtol=RTOL, atol=ATOL)


def test_all_equal_contributions_give_exactly_that_contribution():
    part = honest(1, seed=4)[0]
    for weights in ([1.0] * 4, [1.0, 5.0, 2.0, 100.0], [3.0] * 16):
        assert torch.equal(centered_clip([part.clone() for _ in weights], weights), part)


def test_one_arbitrary_contribution_moves_the_result_a_bounded_distance():
    """However far one of 4 senders (equal weights) sits, and in whichever direction, the result stays within
    share / (1 - share) x tau = tau / 3 of the honest mean, tau measured on the honest senders and the liar together
    (the median ignores how far the liar is)."""
    parts = honest(4, seed=5)
    honest_mean = weighted_mean(parts[1:], [1.0, 1.0, 1.0])
    generator = torch.Generator().manual_seed(9)
    for scale in (1.0, 10.0, 1e3, 1e6, 1e30):
        liar = scale * torch.randn(SIZE, generator=generator)
        result = centered_clip([liar, *parts[1:]], [1.0] * 4)
        _, tau = reference([liar, *parts[1:]], [1.0] * 4)
        assert float((result.double() - honest_mean).norm()) <= tau / 3 * (1 + 1e-4), scale


def test_the_sparse_rule_is_centered_clip_of_the_zero_filled_parts():
    """The sparse top-k all-reduce's CenteredClip (on the union of the sent indices) equals CenteredClip of the senders'
    dense vectors with 0 where they sent nothing, is the weighted mean for honest top-k parts, and holds a part
    scaled x1000 to within its share of tau."""
    from lean_transformer.swarm.averaging.sparse_allreduce import sparse_centered_clip

    size, k = 4096, 200
    dense = honest(4, seed=6)
    weights = [8.0, 8.0, 9.0, 10.0]

    def topk(vector: torch.Tensor) -> tuple:
        indices = vector.abs().topk(k).indices.sort().values
        return indices, vector[indices]

    def run(senders: list) -> tuple:
        parts = [(weight, *topk(vector)) for weight, vector in zip(weights, senders)]
        union = torch.unique(torch.cat([indices for _, indices, _ in parts]))
        result = torch.zeros(size)
        result[union] = sparse_centered_clip(parts, union, size)[0]
        filled = []
        for _, indices, values in parts:
            row = torch.zeros(size)
            row[indices] = values
            filled.append(row)
        return result, filled

    result, filled = run(dense)
    torch.testing.assert_close(result, centered_clip(filled, weights), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(result.double(), weighted_mean(filled, weights), rtol=RTOL, atol=ATOL)
    attacked, filled = run([-1000 * dense[0], *dense[1:]])
    torch.testing.assert_close(attacked, centered_clip(filled, weights), rtol=RTOL, atol=ATOL)
    _, tau = reference(filled, weights)
    share = weights[0] / sum(weights)
    honest_mean = weighted_mean(filled[1:], weights[1:])
    assert float((attacked.double() - honest_mean).norm()) <= share / (1 - share) * tau * (1 + 1e-4)
    assert float((weighted_mean(filled, weights) - honest_mean).norm()) > 100 * tau


@pytest.mark.parametrize("attack", ["sign_flip", "random_direction", "alie", "stale", "nan", "inflate"])
def test_each_attack_of_the_lying_peer_stays_within_its_share_of_tau(attack):
    """tests/lying_peer.py's own attack code (what the swarm tests and benchmarks/byzantine.py run) applied to one
    sender's gradients over 30 rounds of a drifting common direction: in each of the last 8 (the stale attack sends
    gradients 20 rounds old from round 21 on), CenteredClip of the liar and 3
    honest senders stays within share / (1 - share) x tau of the honest mean (a NaN sender is left out: exactly the
    honest mean), the liar's claimed weight capped as the steps cap it (inflate claims 10x its samples)."""
    from lying_peer import INFLATE, STALE_STEPS, Lies

    lies, generator = Lies(attack, 1000.0, STALE_STEPS), torch.Generator().manual_seed(11)
    common = torch.randn(SIZE, generator=generator)
    for round_index in range(30):
        common += 0.1 * torch.randn(SIZE, generator=generator)  # training moves on: stale gradients drift away
        parts = [common + 0.5 * torch.randn(SIZE, generator=generator) for _ in range(4)]
        lies(parts[:1])
        if round_index < 22:
            continue
        weights = [INFLATE if attack == "inflate" else 1.0, 1.0, 1.0, 1.0]
        result = centered_clip(parts, weights)
        honest_mean = weighted_mean(parts[1:], weights[1:])
        if attack == "nan":
            torch.testing.assert_close(result.double(), honest_mean, rtol=RTOL, atol=ATOL)
            continue
        _, tau = assert_matches_reference(result, parts, weights)
        capped = [min(weight, WEIGHT_CAP * float(np.median(weights))) for weight in weights]
        share = capped[0] / sum(capped)
        assert float((result.double() - honest_mean).norm()) <= share / (1 - share) * tau * (1 + 1e-4)


def test_a_label_flipping_peer_stays_within_its_share_of_tau(gpt_config):
    """label_flip (tests/lying_peer.py: every label shifted by one token id) lies through honest computation: its
    gradients of a real tiny LeanGPT point elsewhere (cosine to the honest mean well below the honest senders'), and
    CenteredClip of it and 3 honest senders stays within share / (1 - share) x tau of the honest mean."""
    from lean_transformer import LeanGPTForCausalLM

    config = gpt_config()
    model = LeanGPTForCausalLM(config)
    generator = torch.Generator().manual_seed(12)
    text = torch.arange(64).remainder(config.vocab_size)  # a learnable sequence: each token predicts the next

    def gradient(flip: bool) -> torch.Tensor:
        starts = torch.randint(0, 48, (8,), generator=generator)
        input_ids = torch.stack([text[start:start + 16] for start in starts])
        labels = (input_ids + 1) % config.vocab_size if flip else input_ids
        model.zero_grad()
        model(input_ids=input_ids, labels=labels).loss.backward()
        return torch.cat([param.grad.reshape(-1) for param in model.parameters()])

    parts = [gradient(flip=True)] + [gradient(flip=False) for _ in range(3)]
    honest_mean = weighted_mean(parts[1:], [1.0] * 3)

    def cosine(vector: torch.Tensor) -> float:
        return float(torch.nn.functional.cosine_similarity(vector.double(), honest_mean, dim=0))
    assert cosine(parts[0]) < min(map(cosine, parts[1:])) - 0.1, [cosine(part) for part in parts]
    result = centered_clip(parts, [1.0] * 4)
    _, tau = assert_matches_reference(result, parts, [1.0] * 4)
    assert float((result.double() - honest_mean).norm()) <= tau / 3 * (1 + 1e-4)
