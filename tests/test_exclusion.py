"""lean_transformer.swarm.averaging.exclusion: a peer that A excludes is in none of the groups A forms; and a peer
that only serves a round (weight 0) judges none of its reducers.

Run as a script, this file is one variant, in its own process: two peers on 127.0.0.1, A and B, each a DHT and the
swarm's gradient averager under CenteredClip, average twice: first with B leading (B's round is scheduled before
A's: hivemind's followers ask the leaders that declared an earlier time), then with A leading. Variant ``excluded``:
A has excluded B (three strikes) before its averager starts. Variant ``control``: A has not. Variant
``weightless``: A's values are 1 and B's -1; A averages with weight 0 and B with weight 1 (A's share is answered
with B's values alone), then both with weight 0 (the reducers answer zeros, honestly). Variant ``out_of_step``: B's
values are -3 x A's (the gradients of a peer whose parameters lag, measured to anticorrelate with the others'), so
A rejects every answer of B's; the first three rounds gather epoch labels 5 (A) and 4 (B), the fourth 5 and 5.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import preloaded

pytestmark = pytest.mark.swarm
REPO = Path(__file__).resolve().parent.parent
LEAD_GAP = 1.5  # seconds between the leader's scheduled time and the follower's


def test_an_excluded_peer_is_in_none_of_its_excluders_groups(report):
    env = dict(os.environ, **preloaded.PEER_ENV)
    processes = {variant: preloaded.popen([sys.executable, __file__, variant], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env)
                 for variant in ("control", "excluded", "weightless", "out_of_step")}
    results = {}
    for variant, process in processes.items():
        try:
            stdout, stderr = process.communicate(timeout=120)
        finally:
            process.kill()
        assert process.returncode == 0 and stdout.strip(), f"{variant}:\n{stderr[-6000:]}"
        results[variant] = json.loads(stdout.strip().splitlines()[-1])
    control, excluded = results["control"], results["excluded"]
    # the control: B's group and A's group both form, A and B averaged (1.0 and 0.0: 0.5)
    assert control == {"b_leads": [2, 0.5], "a_leads": [2, 0.5]}, control
    # excluded: no group in either order; A's values stay its own (1.0). Refusing B's requests alone is not enough:
    # a leader that found no follower looks for a leader itself (seen here: A joined B in both rounds)
    assert excluded == {"b_leads": [None, 1.0], "a_leads": [None, 1.0]}, excluded
    # weightless: both rounds average the pair, and nobody is judged (before the fix: the zeros of the second round
    # were rejected as a gross lie, "|average| is 0 x |own values|", which excludes the reducer at once)
    assert results["weightless"] == {"group_sizes": [2, 2], "b_group_sizes": [2, 2], "answers_rejected": [],
                                     "struck": [], "excluded": False}, results["weightless"]
    # out of step: A rejects B's answer in each round (it keeps its own values) but strikes B only in the round whose
    # labels agree, so B stays in A's groups (before the fix: B excluded after the third round, no fourth group)
    out_of_step = results["out_of_step"]
    assert (out_of_step["group_sizes"], out_of_step["b_group_sizes"]) == ([2, 2, 2, 2], [2, 2, 2, 2]), out_of_step
    assert (out_of_step["struck"], out_of_step["excluded"]) == ([False, False, False, True], False), out_of_step
    assert len(set(out_of_step["answers_rejected"])) == 1 and "does not correlate" in out_of_step["answers_rejected"][0]
    report("A excludes B: no group formed, whether B's round was scheduled first (B leads) or A's (A leads, then "
           "looks for a leader itself); control without exclusion: both rounds averaged A and B")


def two_dhts() -> tuple:
    """A's DHT and B's, which joins through A's."""
    import hivemind

    maddrs = ["/ip4/127.0.0.1/tcp/0"]
    dht_a = hivemind.DHT(start=True, host_maddrs=maddrs)
    return dht_a, hivemind.DHT(start=True, host_maddrs=maddrs, initial_peers=dht_a.get_visible_maddrs())


def start_averagers(dhts: tuple, prefix: str, exclusions_of_a=None, a_is_client: bool = False) -> tuple:
    """A's and B's parameters (2048 zeros each: over answer_check's MIN_CHECKED) and their gradient averagers under
    CenteredClip, started and known to each other's DHTs; ``exclusions_of_a``: A's exclusions; ``a_is_client``: A
    averages in client mode (B reduces every part, so A checks all of them)."""
    import torch

    from lean_transformer.swarm.averaging.averagers import GradientAverager

    params = [torch.nn.Parameter(torch.zeros(2048)) for _ in dhts]
    averagers = tuple(GradientAverager([param], dht=dht, prefix=prefix, target_group_size=2, min_matchmaking_time=2.0,
                                       request_timeout=1.0, allreduce_timeout=10, aggregation="centered_clip",
                                       exclusions=exclusions_of_a if index == 0 else None,
                                       client_mode=a_is_client and index == 0, start=True)
                      for index, (param, dht) in enumerate(zip(params, dhts)))
    time.sleep(1.0)  # the DHTs know each other
    return params, averagers


def main(variant: str) -> None:
    if variant in ("weightless", "out_of_step"):
        return main_judged(variant)
    import torch
    from hivemind.utils import get_dht_time

    from lean_transformer.swarm.averaging.exclusion import Exclusions

    dht_a, dht_b = two_dhts()
    exclusions = Exclusions(strikes=3, window=10)
    if variant == "excluded":
        for _ in range(3):
            exclusions.begin_round()
            exclusions.strike(dht_b.peer_id.to_base58(), "a test's strike")
    params, (a, b) = start_averagers((dht_a, dht_b), "exclusion", exclusions)
    result = {}
    for name, leader, follower in (("b_leads", b, a), ("a_leads", a, b)):
        for peer, param, value in ((a, params[0], 1.0), (b, params[1], 0.0)):
            param.grad = torch.full_like(param, value)
            peer.accumulate_grads_(batch_size=1)  # the step then resets the accumulators
        start = get_dht_time() + 2.0
        steps = [leader.step(scheduled_time=start, timeout=10, wait=False),
                 follower.step(scheduled_time=start + LEAD_GAP, timeout=10, wait=False)]
        group_size = None
        try:
            group_size = len(steps[1 if follower is a else 0].result(timeout=30))
        except Exception:  # hivemind: "could not find a group"
            pass
        for step in steps:
            step.exception(timeout=30)
        with a.get_tensors() as (tensor,):
            values = set(tensor.tolist())
        result[name] = [group_size, values.pop() if len(values) == 1 else sorted(values)[:4]]
    print(json.dumps(result), flush=True)
    for each in (a, b, dht_a, dht_b):
        each.shutdown()


def main_judged(variant: str) -> None:
    """Variants ``weightless`` and ``out_of_step`` (see the module docstring): A and B average rounds of fixed values,
    each with its epoch labels and weights; prints both peers' group sizes and what A judged."""
    import tempfile

    import torch
    from hivemind.utils import get_dht_time

    from lean_transformer.swarm.averaging.exclusion import Exclusions
    from lean_transformer.swarm.monitoring.events import open_events, read_events

    if variant == "out_of_step":
        own = torch.randn(2048, generator=torch.Generator().manual_seed(0))
        values, rounds = (own, -3 * own), [((5, 4), (1.0, 1.0))] * 3 + [((5, 5), (1.0, 1.0))]
    else:
        values, rounds = (torch.ones(2048), -torch.ones(2048)), [((None, None), (0.0, 1.0)), ((None, None), (0.0, 0.0))]
    events = Path(tempfile.mkdtemp()) / "events.jsonl"
    open_events(events, "trainer")  # before the averagers' processes start: they write here too
    dht_a, dht_b = two_dhts()
    params, (a, b) = start_averagers((dht_a, dht_b), variant, Exclusions(strikes=3, window=10),
                                     a_is_client=variant == "out_of_step")
    group_sizes = {"a": [], "b": []}
    for labels, weights in rounds:
        for peer, param, value, label in zip((a, b), params, values, labels):
            param.grad = value.clone()
            peer.accumulate_grads_(batch_size=1)
            peer.epoch_for_gather = label
        start = get_dht_time() + 2.0
        steps = {"b": b.step(weight=weights[1], scheduled_time=start, timeout=10, wait=False),
                 "a": a.step(weight=weights[0], scheduled_time=start + LEAD_GAP, timeout=10, wait=False)}
        for name, step in steps.items():
            try:
                group_sizes[name].append(len(step.result(timeout=30)))
            except Exception:  # hivemind: "could not find a group" (out of step, before the fix: B excluded)
                group_sizes[name].append(None)
    for each in (a, b, dht_a, dht_b):
        each.shutdown()
    rejected = read_events(events, "answer_rejected")
    print(json.dumps({"group_sizes": group_sizes["a"], "b_group_sizes": group_sizes["b"],
                      "answers_rejected": [event["reason"] for event in rejected],
                      "struck": [event["struck"] for event in rejected],
                      "excluded": bool(read_events(events, "peer_excluded"))}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
