"""The matchmaking fix of lean_transformer.swarm.averagers, against hivemind's own GradientAverager.

Each variant runs as a script in its own process (hivemind objects install signal handlers): two peers on
127.0.0.1, each a DHT and a gradient averager. Peer A pre-schedules a round and cancels it while it looks for a group,
as hivemind.Optimizer does when it finds itself alone. To make the race of the bug certain rather than lucky, A's DHT
process is paused (SIGSTOP) across the cancellation, so that the clean-up of the cancelled round waits on a DHT
store, and a garbage collection runs in A's averager process meanwhile. Then both peers average one round.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.swarm
REPO = Path(__file__).resolve().parent.parent
DESTROYED = "Task was destroyed but it is pending"


def run_variant(variant: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, __file__, variant], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def test_a_round_cancelled_while_matchmaking_leaves_hivemind_stuck_and_ours_averaging(report):
    processes = {variant: run_variant(variant) for variant in ("hivemind", "lean_transformer")}
    results = {}
    for variant, process in processes.items():
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 0 and stdout.strip(), f"{variant}:\n{stderr[-3000:]}"
        results[variant] = dict(json.loads(stdout.strip().splitlines()[-1]), destroyed=DESTROYED in stderr)

    hivemind_result, ours = results["hivemind"], results["lean_transformer"]
    # the control: the race happened, and hivemind's averager is out of every later round
    assert hivemind_result["destroyed"], "the cancelled round's tasks should have been garbage-collected"
    assert hivemind_result["group_size"] is None, hivemind_result
    # the fix: nothing destroyed, both peers averaged together, exactly
    assert not ours["destroyed"]
    assert ours["group_size"] == 2 and ours["averaged"] == [0.5, 0.5], ours
    report(f"a round cancelled in matchmaking, then a GC in the averager: hivemind's averager destroyed its pending "
           f"tasks and missed the next round ({hivemind_result['error']}); ours averaged the next round with 2 peers")


# ---------------------------------------------------------------- one variant, as a script


def main(variant: str) -> None:
    import hivemind
    import torch
    from hivemind.optim import grad_averager
    from hivemind.utils.mpfuture import MPFuture

    from lean_transformer.swarm import averagers

    parent = averagers.GradientAverager if variant == "lean_transformer" else grad_averager.GradientAverager

    class Averager(parent):
        async def _collect_garbage(self, future: MPFuture) -> None:
            future.set_result(gc.collect())

    def collect_garbage(averager: Averager) -> int:
        future = MPFuture()
        averager._outer_pipe.send(("_collect_garbage", [], dict(future=future)))
        return future.result(30)

    maddrs = ["/ip4/127.0.0.1/tcp/0"]
    dhts = [hivemind.DHT(start=True, host_maddrs=maddrs)]
    dhts.append(hivemind.DHT(start=True, host_maddrs=maddrs, initial_peers=dhts[0].get_visible_maddrs()))
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in dhts]
    peers = [Averager([param], dht=dht, prefix="fix", target_group_size=2, min_matchmaking_time=2.0,
                      request_timeout=1.0, start=True) for param, dht in zip(params, dhts)]
    a, b = peers

    control = a.schedule_step(timeout=10)
    time.sleep(1.0)  # A has declared itself and waits for its scheduled time
    os.kill(dhts[0].pid, signal.SIGSTOP)
    try:
        control.cancel()
        time.sleep(1.0)  # the clean-up now awaits A's DHT
        collect_garbage(a)
    finally:
        os.kill(dhts[0].pid, signal.SIGCONT)
    time.sleep(1.0)

    for param, value in zip(params, (1.0, 0.0)):
        param.grad = torch.full_like(param, value)
    for peer in peers:
        peer.accumulate_grads_(batch_size=1)
    steps = [peer.step(timeout=8, wait=False) for peer in peers]
    result = dict(group_size=None, error=None, averaged=None)
    try:
        result["group_size"] = len(steps[0].result())
        with a.use_averaged_gradients():
            result["averaged"] = params[0].grad.tolist()
    except Exception as e:
        result["error"] = repr(e)[:100]
    for step in steps[1:]:
        step.exception()  # wait for it either way
    for each in (*peers, *dhts):
        each.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
