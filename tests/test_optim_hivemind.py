"""CPULAMB8Bit inside hivemind: as the optimizer factory of ``hivemind.Optimizer(offload_optimizer=True)``, and
through the state dump/load that peers use to download state from each other.

The swarm test runs this file as a script: one peer with its own DHT (on 127.0.0.1) in a subprocess, printing a
JSON summary as its last stdout line.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import pytest
import torch

import preloaded
from lean_transformer.optim import CPULAMB8Bit

EPOCHS = 3


def run_single_peer() -> dict:
    import hivemind

    torch.manual_seed(0)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1)
    )  # 8192 weights: 8-bit
    initial = [param.detach().clone() for param in model.parameters()]
    optimizer = hivemind.Optimizer(
        dht=dht,
        run_id="lamb8bit_test",
        params=model.parameters(),
        optimizer=functools.partial(CPULAMB8Bit, lr=0.01),
        target_batch_size=16,
        batch_size_per_step=8,
        offload_optimizer=True,
        matchmaking_time=0.5,
        averaging_timeout=5.0,
    )
    x = torch.randn(8, 64)
    y = 2 * x[:, :1]
    losses, deadline = [], time.monotonic() + 60
    while optimizer.local_epoch < EPOCHS and time.monotonic() < deadline:
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    inner = optimizer.state_averager.optimizer
    states = [inner.state[param] for group in inner.param_groups for param in group["params"]]
    summary = dict(
        epoch=optimizer.local_epoch,
        optimizer=type(inner).__name__,
        moment_dtypes=[str(state["exp_avg"].dtype) for state in states],
        inner_steps=[state["step"] for state in states],
        first_loss=losses[0],
        last_loss=losses[-1],
        params_changed=[not torch.equal(a, b) for a, b in zip(initial, model.parameters())],
    )
    optimizer.shutdown()
    dht.shutdown()
    return summary


@pytest.mark.swarm
def test_single_peer_hivemind_optimizer_steps_with_cpulamb8bit():
    done = preloaded.run([sys.executable, __file__], 150, dict(os.environ, **preloaded.PEER_ENV))
    lines = done.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), done.stderr[-3000:]
    summary = json.loads(lines[-1])
    assert summary["epoch"] == EPOCHS and summary["optimizer"] == "CPULAMB8Bit"
    assert summary["moment_dtypes"][0] == "torch.uint8"  # the 64x128 matrix; biases and the 128x1 head stay float32
    assert summary["inner_steps"] == [EPOCHS + 1] * 4  # hivemind's zero-gradient initialization step + one per epoch
    assert all(summary["params_changed"]) and summary["last_loss"] < summary["first_loss"]


def test_state_survives_hivemind_dump_and_load():
    """What a joining peer does: dump_optimizer_state on one side, load_optimizer_state into a fresh optimizer."""
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    from hivemind.optim.state_averager import dump_optimizer_state, load_optimizer_state
    from test_optim_lamb import same_state

    def make():
        torch.manual_seed(0)
        params = [torch.randn(5000, requires_grad=True), torch.randn(10, requires_grad=True)]
        return params, CPULAMB8Bit(params, lr=0.01)

    params, optimizer = make()
    for _ in range(3):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
    fresh_params, fresh = make()
    for param in fresh_params:  # hivemind initializes the receiver's state with a zero-gradient step first
        param.grad = torch.zeros_like(param)
    fresh.step()
    metadata, tensors = dump_optimizer_state(optimizer)
    received = [deserialize_torch_tensor(serialize_torch_tensor(tensor)) for tensor in tensors]  # as sent over the wire
    load_optimizer_state(fresh, metadata, received)
    for param, fresh_param in zip(params, fresh_params):
        assert same_state(optimizer.state[param], fresh.state[fresh_param])


if __name__ == "__main__":
    print(json.dumps(run_single_peer()), flush=True)
