"""A swarm with a reducer that lies (issue 24): three honest trainers and one (tests/lying_peer.py) that trains and
sends honestly but answers every other sender of its part of each all-reduce with a wrong average: x1000 in gradient
averaging, sign-flipped (the honest magnitude, which no norm bound catches) or zeros in DiLoCo mode. Real processes
on 127.0.0.1, tiny LeanGPT on CPU (``run_swarm`` of tests/test_robust_swarm.py), the default ``--aggregation
centered_clip``: the honest trainers reject its answers (gradients: keeping their own values for its part; DiLoCo:
not applying the round), strike it, and exclude it after 3 strikes within 10 rounds, or at once for a gross lie
(x1000, zeros; lean_transformer/swarm/averaging/answer_check.py, exclusion.py); they train as an honest swarm does, and none of
them rejects an honest reducer's answer or excludes an honest peer. The mean, which checks nothing, under the same
attack: benchmarks/byzantine.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Tuple

import pytest

from lean_transformer.swarm.monitoring.events import read_events
from swarm_utils import untrained_loss
from test_robust_swarm import DILOCO_FALL, EPOCHS, HONEST, attacked_rounds, run_swarm

pytestmark = pytest.mark.swarm
DILOCO_EPOCHS = EPOCHS + 2


def honest_verdicts(root: Path, report: Callable[[str], None]) -> Tuple[str, List[Tuple[list, list, Path]]]:
    """The liar's peer ID, and per honest trainer its ``answer_rejected`` and ``peer_excluded`` events and its event
    stream (each trainer's counts reported)."""
    liar = next(event["peer"] for event in read_events(root / "liar.events.jsonl") if event.get("peer"))
    verdicts = []
    for index in range(HONEST):
        stream = root / f"honest{index}.events.jsonl"
        rejected, excluded = read_events(stream, "answer_rejected"), read_events(stream, "peer_excluded")
        report(f"honest{index}: {sum(event['source'] == liar for event in rejected)} of the liar's shares rejected, "
               f"{sum(event['source'] != liar for event in rejected)} of honest reducers'; excluded "
               f"{[event['source'][-8:] for event in excluded]}")
        verdicts.append((rejected, excluded, stream))
    return liar, verdicts


def run_diloco_swarm(root: Path, attack: str, report: Callable[[str], None]) -> Tuple[dict, str, list]:
    """A DiLoCo swarm (--local_steps 2) with a liar that joins late: the losses, the liar, :func:`honest_verdicts`."""
    losses = run_swarm(root, "centered_clip", attack, DILOCO_EPOCHS, liar_joins_late=True,
                       extra=["--local_steps", "2"])
    report(f"DiLoCo, {attack}: outer rounds of 4 peers (the liar's): {attacked_rounds(root, 'outer')}")
    return (losses, *honest_verdicts(root, report))


def assert_trained(losses: dict, attack: str, report: Callable[[str], None]) -> None:
    """Every honest trainer's loss fell as an honest DiLoCo swarm's does (by DILOCO_FALL at least)."""
    untrained = untrained_loss(losses)
    for name, by_epoch in losses.items():
        report(f"DiLoCo, {attack}, centered_clip, {name}: loss {untrained:.3f} (untrained) -> "
               f"{by_epoch[DILOCO_EPOCHS]:.3f}")
        assert by_epoch[DILOCO_EPOCHS] < untrained - DILOCO_FALL, (name, by_epoch)


def test_honest_trainers_exclude_a_reducer_that_scales_its_answers_and_train_on(tmp_path, report):
    epochs = EPOCHS + 4  # the liar takes ~4 epochs to join
    losses = run_swarm(tmp_path, "centered_clip", "reducer_scale", epochs, liar_joins_late=True)
    report(f"rounds of 4 peers (the liar's): {attacked_rounds(tmp_path)}")
    liar, verdicts = honest_verdicts(tmp_path, report)
    for index, (rejected, excluded, _) in enumerate(verdicts):
        assert [event["source"] for event in excluded] == [liar], (index, excluded)  # once, the liar only
        assert {event["source"] for event in rejected} == {liar}, (index, rejected)
        assert all("x |own values|" in event["reason"] for event in rejected), rejected
    untrained = untrained_loss(losses)
    for name, by_epoch in losses.items():
        report(f"reducer x1000, centered_clip, {name}: loss {untrained:.3f} (untrained) -> {by_epoch[epochs]:.3f}")
        assert by_epoch[epochs] < untrained - 0.6, (name, by_epoch)  # as test_robust_swarm's honest swarm trains


def test_honest_trainers_exclude_a_reducer_that_flips_its_outer_answers_in_diloco_mode(tmp_path, report):
    """DiLoCo mode (--local_steps 2): the liar answers every outer all-reduce with its part's average x -1. The
    honest trainers whose pseudo-gradient weighs at least a fifth of the group's median check the answers
    (diloco.checks_answers): a flipped share anti-correlates with their own values, so they do not apply that round
    (nor retry it: they move on to the next one), and they strike and exclude the liar. Before the check the
    benchmark's honest trainers ended 1.02-1.47x the honest swarm's loss (benchmarks/byzantine.py). Nor do they
    take its state afterwards."""
    losses, liar, verdicts = run_diloco_swarm(tmp_path, "reducer_flip", report)
    excluders = 0
    for index, (rejected, excluded, stream) in enumerate(verdicts):
        assert [event["source"] for event in excluded] in ([], [liar]), (index, excluded)  # never an honest peer
        assert {event["source"] for event in rejected} == {liar}, (index, rejected)
        assert all("does not correlate" in event["reason"] for event in rejected), rejected
        excluders += bool(excluded)
        # nor does it take the liar's state once it excluded it (SwarmOptimizer.distrust): the liar's rounds went on
        # alone meanwhile, to a higher epoch, and the honest trainers once downloaded it (benchmarks/byzantine.py)
        downloads = read_events(stream, "state_downloaded")
        assert not [event for event in downloads if event["source"] == liar and excluded
                    and event["time"] > excluded[0]["time"]], downloads
    # 3 strikes each; once some exclude it, the liar leads no group they join and joins none they lead, so a trainer
    # that missed one of its rounds may never reach its third strike (seen: 2 of 3 excluded it)
    assert excluders >= 1
    assert_trained(losses, "reducer_flip", report)


def test_every_honest_trainer_excludes_a_reducer_that_answers_zeros_in_diloco_mode_at_once(tmp_path, report):
    """DiLoCo mode: the liar answers every outer all-reduce with zeros. Each member of its group, checking or not,
    holds the answers to the gross check (answer_check.gross_problem) and judges them alike: it takes that share as
    zeros and applies the round (no round fails on the check), and the first rejection excludes the liar (no 3
    strikes). Before the gross check, the members that did not check applied the zeros that the others rejected,
    and in benchmarks/byzantine.py (3 liars of 16) the group's anchors parted and the honest trainers downloaded
    states round after round; failing the round instead, each lost a round per liar it met."""
    losses, liar, verdicts = run_diloco_swarm(tmp_path, "reducer_zeros", report)
    excluders = 0
    for index, (rejected, excluded, stream) in enumerate(verdicts):
        assert [event["source"] for event in excluded] in ([], [liar]), (index, excluded)  # never an honest peer
        assert all(event["source"] == liar and event["gross"] for event in rejected), (index, rejected)
        assert bool(rejected) == bool(excluded), (index, rejected, excluded)
        if excluded:  # at its first rejection
            assert excluded[0]["reason"] == f"its answers as a reducer: {rejected[0]['reason']}", (index, excluded)
        failed = [event for event in read_events(stream, "round_missed") if "failed the check" in event["reason"]]
        assert not failed, (index, failed)
        excluders += bool(excluded)
    assert excluders >= 1
    assert_trained(losses, "reducer_zeros", report)
