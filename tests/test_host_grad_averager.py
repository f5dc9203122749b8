"""HostGradientAverager: hivemind averaging and stepping from host gradients that left the model during backward.

Each case runs as a script in its own process (hivemind objects install signal handlers), with real DHTs and
averagers on 127.0.0.1:

- ``allreduce``: two peers, each with two micro-batches of known gradients, average through hivemind's all-reduce
  (peer 1 sums on the device, ``device_accumulation=3``: its sums leave the device only when the round loads them);
- ``optimizer``: one peer, ``hivemind.Optimizer(offload_optimizer=True)`` with CPULAMB8Bit, trains a tiny LeanGPT
  for 3 epochs of 2 local steps, once with hivemind's own averager (accumulators beside the ``.grad`` buffers,
  ``zero_grad`` after each step) and once with host gradients: the same weights, bit for bit. (One micro-batch per
  local step: with two, hivemind sums (a + b) + (c + d) and the host buffers ((a + b) + c) + d, equal only up to
  rounding; the ``allreduce`` case and tests/test_optim_offload.py cover micro-batches.)
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

import pytest

import preloaded

pytestmark = pytest.mark.swarm
REPO = Path(__file__).resolve().parent.parent


def run_case(case: str) -> dict:
    done = preloaded.run([sys.executable, __file__, case], 180, dict(os.environ, **preloaded.PEER_ENV))
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines and lines[-1].startswith("{"), done.stderr[-3000:]
    return json.loads(lines[-1])


def test_two_peers_average_their_host_gradients():
    result = run_case("allreduce")
    assert result["group_size"] == 2, result
    # peer 0's micro-batches give gradients 1 and 3 (mean 2), peer 1's give 5 and 7 (mean 6): the average is 4
    assert result["averaged"] == [[4.0] * 3] * 2, result
    assert result["device_grads"] == [None, None]  # nothing stayed in .grad
    assert result["reload_keeps"] and result["non_finite"] == [False, True, False], result


def test_hivemind_optimizer_steps_from_host_gradients_exactly_like_hivemind_accumulators():
    result = run_case("optimizer")
    assert result["host"]["epoch"] == result["hivemind"]["epoch"] == 3
    assert result["host"]["losses"] == result["hivemind"]["losses"]
    assert result["same_weights"] and result["weights_changed"], result
    assert result["host"]["grads_on_model"] == 0


# ---------------------------------------------------------------- one case, as a script


def allreduce_case() -> dict:
    import hivemind
    import torch

    from lean_transformer.swarm.averaging.host_grad_averager import HostGradientAverager

    maddrs = ["/ip4/127.0.0.1/tcp/0"]
    dhts = [hivemind.DHT(start=True, host_maddrs=maddrs)]
    dhts.append(hivemind.DHT(start=True, host_maddrs=maddrs, initial_peers=dhts[0].get_visible_maddrs()))
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in dhts]
    peers = [HostGradientAverager([param], dht=dht, prefix="host", target_group_size=2, min_matchmaking_time=2.0,
                                  request_timeout=1.0, allreduce_timeout=10, start=True, device_accumulation=1 + 2 * index)
             for index, (param, dht) in enumerate(zip(params, dhts))]
    non_finite = []
    for index, (peer, param) in enumerate(zip(peers, params)):
        for micro_batch in range(2):
            (param * (4.0 * index + 2.0 * micro_batch + 1.0)).sum().backward()
            peer.accumulate_grads_(batch_size=1)
        non_finite.append(peer.host_grads.non_finite())
    steps = [peer.step(timeout=10, wait=False) for peer in peers]
    result = dict(group_size=len(steps[0].result()), device_grads=[param.grad for param in params])
    for step in steps:
        step.exception()
    averaged = []
    for peer in peers:
        with peer.get_tensors() as (tensor,):
            averaged.append(tensor.tolist())
    result["averaged"] = averaged
    # hivemind's fallback loads again after a failed round: nothing new arrived, so the buffers keep their content
    peers[0].load_accumulators_into_averager_()
    result["reload_keeps"] = peers[0].host_grads.buffers[0].tolist() == averaged[0]
    (params[0] * float("nan")).sum().backward()
    non_finite.append(peers[0].host_grads.non_finite())
    peers[0].reset_accumulated_grads_()
    non_finite.append(peers[0].host_grads.non_finite())
    result["non_finite"] = non_finite[1:]  # peer 1, then peer 0 after a NaN, then after the reset
    for each in (*peers, *dhts):
        each.shutdown()
    return result


def optimizer_case() -> dict:
    import hivemind
    import torch

    from lean_transformer import LeanGPTConfig, LeanGPTForCausalLM
    from lean_transformer.optim import CPULAMB8Bit
    from lean_transformer.swarm.averaging.host_grad_averager import HostGradientAverager

    config = LeanGPTConfig(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=48, max_position_embeddings=32, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    initial = LeanGPTForCausalLM(config)
    data = [torch.randint(61, (4, 16)) for _ in range(6)]

    def train(host: bool) -> tuple[dict, LeanGPTForCausalLM]:
        model = LeanGPTForCausalLM(config)
        model.load_state_dict(initial.state_dict())
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        optimizer = hivemind.Optimizer(
            dht=dht, run_id=f"host_{host}", params=model.parameters(),
            optimizer=functools.partial(CPULAMB8Bit, lr=0.01, min_8bit_size=512), target_batch_size=8,
            batch_size_per_step=4, offload_optimizer=True, matchmaking_time=0.5, averaging_timeout=5.0,
            reuse_grad_buffers=False, grad_averager_factory=HostGradientAverager if host else None)
        losses = []
        for batch in data:
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            losses.append(loss.item())
            optimizer.step()
            if not host:
                optimizer.zero_grad()
        summary = dict(epoch=optimizer.local_epoch, losses=losses,
                       grads_on_model=sum(param.grad is not None for param in model.parameters()))
        optimizer.shutdown()
        dht.shutdown()
        return summary, model

    hivemind_summary, hivemind_model = train(host=False)
    host_summary, host_model = train(host=True)
    pairs = list(zip(hivemind_model.parameters(), host_model.parameters(), initial.parameters()))
    return dict(hivemind=hivemind_summary, host=host_summary,
                same_weights=all(torch.equal(a, b) for a, b, _ in pairs),
                weights_changed=all(not torch.equal(a, c) for a, _, c in pairs))


if __name__ == "__main__":
    started = time.monotonic()
    summary = dict(allreduce=allreduce_case, optimizer=optimizer_case)[sys.argv[1]]()
    print(json.dumps(dict(summary, seconds=round(time.monotonic() - started, 1))))
