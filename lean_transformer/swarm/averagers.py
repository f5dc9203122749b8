"""hivemind's averagers with a fix for a peer that stops matchmaking for good, and the ``hivemind.Optimizer``
(sub)classes that run them.

The bug (hivemind 1.1.12): when an averaging round is cancelled while it looks for a group (hivemind.Optimizer
does so whenever it pre-scheduled a round and then finds itself alone), the averager cancels its matchmaking task
without keeping a reference to it. asyncio's loop holds tasks weakly, so the cancelled task, which still awaits a
DHT store in its clean-up, can be garbage-collected half-way ("Task was destroyed but it is pending!"). Its
matchmaking locks are never released: every later round of that peer ends in "could not find a group", while the
rest of the swarm averages without it. Seen in the fault suite on a 2-core CI machine; ``tests/test_averagers.py``
reproduces it deterministically. :class:`KeepsTasksAlive` holds every task of the averager's event loop until it
is done, so a cancelled round cleans up completely.

Both averagers also take the run's ``averager_opts`` (hivemind passes them to the state averager only).
"""
from __future__ import annotations

import asyncio
import functools
from typing import Any, Coroutine, Set

import hivemind
from hivemind.optim import grad_averager, state_averager

_live_tasks: Set[asyncio.Task] = set()


def _task_factory(loop: asyncio.AbstractEventLoop, coro: Coroutine, **kwargs: Any) -> asyncio.Task:
    task = asyncio.Task(coro, loop=loop, **kwargs)
    _live_tasks.add(task)
    task.add_done_callback(_live_tasks.discard)
    return task


class KeepsTasksAlive:
    """Mixed in front of a hivemind averager: from its first averaging round on, the tasks of its event loop (in
    the averager's process) stay referenced until they finish."""

    # hivemind caches the RPC table and stub per class: rebuild them for the subclass (same names, same wire format)
    _rpc_handlers = None
    _stub_type = None

    async def _step(self, **kwargs: Any) -> None:
        loop = asyncio.get_running_loop()
        if loop.get_task_factory() is not _task_factory:
            loop.set_task_factory(_task_factory)
        await super()._step(**kwargs)


class GradientAverager(KeepsTasksAlive, grad_averager.GradientAverager):
    """hivemind's GradientAverager (same RPC names), whose cancelled rounds clean up."""


class TrainingStateAverager(KeepsTasksAlive, state_averager.TrainingStateAverager):
    """hivemind's TrainingStateAverager (same RPC names), whose cancelled rounds clean up."""


class _OwnAveragers:
    """Mixed in front of a ``hivemind.Optimizer`` class: it builds its averagers from the class attributes below,
    each with the optimizer's ``averager_opts``."""

    gradient_averager_class: type[grad_averager.GradientAverager] = GradientAverager
    state_averager_class: type[state_averager.TrainingStateAverager] = TrainingStateAverager

    def __init__(self, *args: Any, averager_opts: dict | None = None, **kwargs: Any):
        factory = functools.partial(self.gradient_averager_class, **averager_opts or {})
        super().__init__(*args, grad_averager_factory=factory, averager_opts=averager_opts, **kwargs)

    def _make_state_averager(self, **kwargs: Any) -> state_averager.TrainingStateAverager:
        # hivemind 1.1.12's own arguments (pinned in pyproject.toml): it offers no factory for this averager
        return self.state_averager_class(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )


@functools.cache
def with_averagers(optimizer_class: type[hivemind.Optimizer],
                   gradient_averager_class: type[grad_averager.GradientAverager] = GradientAverager,
                   state_averager_class: type[state_averager.TrainingStateAverager] = TrainingStateAverager,
                   ) -> type[hivemind.Optimizer]:
    """``optimizer_class`` (``hivemind.Optimizer`` or a subclass) running the given averager classes; both receive
    its ``averager_opts``."""
    return type(optimizer_class.__name__, (_OwnAveragers, optimizer_class),
                dict(gradient_averager_class=gradient_averager_class, state_averager_class=state_averager_class))
