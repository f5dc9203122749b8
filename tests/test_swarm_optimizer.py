"""SwarmOptimizer's own interface, on a lone peer in each mode: what a checkpoint holds besides hivemind's state, and
restarting from the anchor (after a download or a checkpoint) in DiLoCo mode, a no-op in gradient-averaging mode."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_lone_peers() -> dict:
    import functools

    import hivemind
    import torch

    from lean_transformer.swarm.averaging.diloco import DiLoCoSettings
    from lean_transformer.swarm.averaging.optimizer import SwarmOptimizer

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    result = {}
    for mode, diloco in ("gradients", None), ("diloco", DiLoCoSettings(local_steps=2)):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        initial = [param.detach().clone() for param in model.parameters()]
        optimizer = SwarmOptimizer(dht=dht, run_id=f"swarm_optimizer_{mode}", target_batch_size=8,
                                   batch_size_per_step=4, params=[dict(params=list(model.parameters()))],
                                   optimizer=functools.partial(torch.optim.SGD, lr=0.1), offload_optimizer=True,
                                   matchmaking_time=0.5, averaging_timeout=5.0, diloco=diloco)
        state = optimizer.checkpoint_state()
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)  # this peer's drift
        optimizer.restart_from_anchor()
        restarted = all(torch.equal(param, start) for param, start in zip(model.parameters(), initial))
        loaded = dict(outer=[tensor + 2.0 for tensor in state["outer"]]) if state else {}
        optimizer.load_checkpoint_state(loaded)  # anchor and momentum + 2, outer step count 2
        checkpoint_params = [param.detach().clone() for param in model.parameters()]
        optimizer.cancel_rounds_in_flight()  # no round in flight: nothing to cancel
        result[mode] = dict(
            no_host_grads=optimizer.host_grads is None,
            state_keys=sorted(state),
            state_tensors=len(state.get("outer", [])),
            restarted_to_initial=restarted,
            shift_after_checkpoint=[round(float((param - start).mean()), 4) for param, start in
                                    zip(checkpoint_params, initial)],
            outer_steps=float(optimizer.outer_loop.outer.steps) if optimizer.outer_loop is not None else None,
            no_rounds_in_flight=optimizer.scheduled_grads is None and optimizer.scheduled_state is None)
        optimizer.shutdown()
    dht.shutdown()
    return result


@pytest.mark.swarm
def test_checkpoint_state_and_restart_from_anchor_in_both_modes():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=120, env=env)
    lines = done.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), done.stderr[-3000:]
    result = json.loads(lines[-1])
    # gradient averaging: no state of its own, the drifted parameters stay (hivemind's own state is all there is)
    assert result["gradients"] == dict(no_host_grads=True, state_keys=[], state_tensors=0,
                                       restarted_to_initial=False, shift_after_checkpoint=[1.0, 1.0], outer_steps=None,
                                       no_rounds_in_flight=True)
    # DiLoCo: anchor (2 tensors), momentum (2) and the step count; the parameters restart from the anchor, then
    # from the checkpoint's (anchor + 2)
    assert result["diloco"] == dict(no_host_grads=True, state_keys=["outer"], state_tensors=5,
                                    restarted_to_initial=True, shift_after_checkpoint=[2.0, 2.0], outer_steps=2.0,
                                    no_rounds_in_flight=True)


if __name__ == "__main__":
    print(json.dumps(run_lone_peers()), flush=True)
