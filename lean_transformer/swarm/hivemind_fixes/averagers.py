"""Fixes of hivemind's averagers: five bugs of a cancelled or abandoned averaging round and a socket file left behind
(:class:`CancelSafe`), a gradient download nobody uses (:class:`NoGradientDownload`), and a leaver that waits for a
group (:class:`LeavesUngrouped`).
The averagers the swarm runs combine them with the other fixes in :mod:`lean_transformer.swarm.averaging.averagers`.

hivemind.Optimizer cancels a pre-scheduled gradient-averaging round whenever it then finds itself alone, so rounds
are cancelled all the time while a swarm forms or shrinks. In hivemind 1.1.12 that can go wrong in two ways:

- **A peer stops matchmaking for good.** The averager cancels the round's matchmaking task without keeping a
  reference to it. asyncio's loop holds tasks weakly, so the cancelled task, which still awaits a DHT store in its
  clean-up, can be garbage-collected half-way ("Task was destroyed but it is pending!"); its matchmaking locks are
  never released, and every later round of that peer ends in "could not find a group" while the swarm averages
  without it. Seen in the fault suite on a 2-core CI machine. Here every task of the averager's event loop stays
  referenced until it is done.
- **A cancelled round averages anyway.** ``StepControl.cancel`` cancels the round's trigger and signals the averager
  before it marks the round itself cancelled; an averager that looks in between takes the cancelled trigger for a
  go-ahead, retries matchmaking and runs the all-reduce, with the default weight 1 and whatever its buffers hold. Its
  group's result is then wrong, and so are its own buffers. Seen as inexact averages in the averaging tests, and, on a
  loaded machine, as a cancelled round that took the partner of the peer's next round. Here the averager marks the
  round cancelled as soon as the signal arrives, so it stops looking for a group at once; and a round that is
  cancelled by the time its all-reduce begins serves its group with weight 0, on copies of its tensors.

- **A peer that leaves during an all-reduce logs a traceback.** hivemind's averager shutdown calls ``finalize`` on
  the futures that hold the running groups' runners (AttributeError). Seen at the end of the local demo
  (``tests/test_local_swarm.py``, CI), where every trainer now leaves with a round pre-scheduled. Here the
  shutdown skips them; they end with the averager's process. Present in hivemind's master (checked 2026-11-28).
- **A timed-out round logs a traceback.** An all-reduce cut short by the averager's ``allreduce_timeout`` (a
  groupmate that answers late) ends in ``AllReduceRunner.run``, which stores the ``CancelledError`` in the runner's
  own future (``finalize(exception=...)``, not ``finalize(cancel=True)``). Nobody awaits that future, so
  asyncio reports "Future exception was never retrieved" with a traceback as an ERROR once it is collected. Seen in
  the 8-trainer swarm (``tests/test_large_swarm.py``), for a trainer whose groupmates had gone on without it. Here
  the averager reads that outcome when the group's rounds end. Can go once hivemind's runner finalizes a cancelled
  run as cancelled (master not checked).
- **A groupmate that gives up fails the round of the peer it was sending to.** A reducer's handler of a part that
  arrives before the round's all-reduce begins awaits the future that will hold the round's runner; if the sender
  gives up meanwhile (its stream closes), the handler is cancelled and asyncio cancels that awaited future with it.
  The all-reduce then fails at ``set_result`` ("InvalidStateError: invalid state"), for this peer and the members
  waiting for its parts. Seen once each in two 16-trainer runs of ``benchmarks/internet.py``. Here the handlers
  await that future through a shield (:class:`_RunnerFuture`). Can go once hivemind shields it (master not checked).
- **Every averager leaves a socket file in /tmp.** An averager's process talks to its peer's p2p daemon through a
  replica of the DHT's P2P, which listens on a Unix socket ``/tmp/hivemind-p2pclient-*.sock``; hivemind never shuts
  that replica down, so each averager that ends leaves its file behind (a trainer two per run, the test suite
  hundreds). Here the averager's shutdown closes it. Can go once hivemind's averager shuts its replica down (not in
  1.1.12).

:class:`CancelSafe` fixes all six; ``tests/test_averagers.py`` reproduces the first three, the fifth and the sixth
against hivemind's own classes, ``tests/test_swarm_optimizer.py`` the fourth.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from concurrent.futures import InvalidStateError
from contextvars import ContextVar
from typing import Any, Coroutine, Iterator, List, Optional, Sequence, Set

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.utils.mpfuture import MPFuture

_live_tasks: Set[asyncio.Task] = set()
_current_step: ContextVar[Optional[StepControl]] = ContextVar("current_step", default=None)  # one per _step task


def _task_factory(loop: asyncio.AbstractEventLoop, coro: Coroutine, **kwargs: Any) -> asyncio.Task:
    """asyncio's default task, plus a strong reference to it until it is done."""
    task = asyncio.Task(coro, loop=loop, **kwargs)
    _live_tasks.add(task)
    task.add_done_callback(_live_tasks.discard)
    return task


async def _cancelled_once_signalled(step: StepControl) -> None:
    """``StepControl.wait_for_cancel`` that also marks the round cancelled (in this process at once, and for its
    owner) when the signal arrives, before hivemind's loop can take a cancelled trigger for a go-ahead."""
    await StepControl.wait_for_cancel(step)
    MPFuture.cancel(step)


def serving_only(tensors: Sequence[torch.Tensor], kwargs: dict, released_too: bool = False
                 ) -> Sequence[torch.Tensor]:
    """In the averager's process, as an all-reduce begins: for a round cancelled meanwhile (``released_too``: or given
    weight 0, see ``diloco.PseudoGradientAverager.release``), copies of ``tensors`` to average, and ``kwargs``'
    weight set to 0: the round serves its group without counting and without changing this peer's buffers, which its
    owner may already be filling for its next round. Else ``tensors`` as they are. (Not every weight 0 in gradient
    averaging: hivemind may average a peer's gradients with weight 0 and still use the result.)"""
    step = _current_step.get()
    if step is not None and (step.cancelled() or (released_too and step.weight == 0)):
        kwargs["weight"] = 0.0
        return [tensor.clone() for tensor in tensors]
    return tensors


def end_step_without_retry() -> None:
    """In the averager's process, inside an all-reduce: hivemind's ``_step`` will not retry the current step when
    this round fails (it retries a failed round until the step's deadline). For a round whose failure a retry
    cannot mend (see ``diloco._Averager``). hivemind 1.1.12 offers no public way: this sets the step's private
    ``_allow_retries``, which its retry loop reads through ``StepControl.allow_retries``."""
    step = _current_step.get()
    if step is not None:
        step._allow_retries = False


class CancelSafe:
    """Mixed in front of a hivemind averager (its methods below run in the averager's process): from its first
    round on, the tasks of its event loop stay referenced until they finish, and a round cancelled before its
    all-reduce takes part in it with weight 0 and without changing this peer's tensors."""

    # hivemind caches the RPC table and stub per class: rebuild them for the subclass (same names, same wire format)
    _rpc_handlers = None
    _stub_type = None

    async def _step(self, *, step: StepControl, **kwargs: Any) -> None:
        loop = asyncio.get_running_loop()
        if loop.get_task_factory() is not _task_factory:
            loop.set_task_factory(_task_factory)
        _current_step.set(step)
        step.wait_for_cancel = functools.partial(_cancelled_once_signalled, step)  # shadows the method
        try:
            await super()._step(step=step, **kwargs)
        except InvalidStateError:
            if not step.cancelled():
                raise  # else: the result of a round cancelled meanwhile, which nobody waits for

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      *args: Any, **kwargs: Any) -> None:
        tensors = serving_only(tensors, kwargs)
        await super()._run_allreduce_inplace_(tensors, group_info, *args, **kwargs)

    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info: GroupInfo) -> Iterator[None]:
        with super()._register_allreduce_group(group_info):
            self._running_groups[group_info.group_id] = _RunnerFuture()  # before any handler could await hivemind's
            try:
                yield
            finally:
                _read_runner_outcome(self._running_groups.get(group_info.group_id))

    async def _shutdown(self, timeout: Optional[float]) -> None:
        """hivemind's, without its crash on an all-reduce still running: it calls ``finalize`` on each entry of
        ``_running_groups`` and gathers what that returns, but the entries are futures of the runners, and
        ``finalize`` returns None (an AttributeError traceback from the averager's thread). Such an all-reduce ends
        with the averager's process, as when a peer is killed: cancelling its runner here makes the round retry
        matchmaking while the process stops, and the DHT request of a closing process logs a traceback in the
        DHT's."""
        self._running_groups.clear()  # each round's own clean-up pops its entry with a default
        await super()._shutdown(timeout)
        await self._p2p.shutdown()  # the module's sixth bug: it removes this process's socket file


class _RunnerFuture(asyncio.Future):
    """The future of a group's all-reduce runner, awaited through a shield: a handler cancelled while it waits leaves
    the future pending for the round (see the module's fifth bug)."""

    def __await__(self) -> Any:
        return super().__await__() if self.done() else asyncio.shield(self).__await__()


def _read_runner_outcome(registered: Optional[asyncio.Future]) -> None:
    """Mark the exception of a finished all-reduce runner's own future as read (see the module's third bug)."""
    if registered is None or not registered.done() or registered.cancelled() or registered.exception() is not None:
        return
    outcome = getattr(registered.result(), "_future", None)  # hivemind's AllReduceRunner and its subclasses
    if isinstance(outcome, asyncio.Future) and outcome.done() and not outcome.cancelled():
        outcome.exception()


class NoGradientDownload:
    """Mixed in front of hivemind's GradientAverager: it shares and downloads no state.

    hivemind 1.1.12's ``Optimizer.load_state_from_peers`` also calls the gradient averager's, which downloads a
    donor's averaged gradients (float32, uncompressed: 4 bytes per parameter, 5.2 GB for the 1.3B model, half an hour
    over a 20 Mbit/s link) and then discards them (``reset_accumulated_grads_``). hivemind's master no longer calls it
    (checked at 00ff07d); this can go with a release that has that. Reproduced by ``tests/test_trainer_swarm.py``'s
    late peer: it downloads no second state after the swarm's."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **{**kwargs, "allow_state_sharing": False})

    def load_state_from_peers(self, wait: bool = True, timeout: Optional[float] = None, **_unused: Any) -> None:
        return None


class LeavesUngrouped(DecentralizedAverager):
    """Put after hivemind's ``TrainingStateAverager`` in the bases, so that the rounds its own code begins
    (``schedule_step``, and the delayed step's ``_do``) pass through :meth:`step`: :meth:`leave` gives up every round
    that has found no group yet, and every round begun after it, at once.

    hivemind's ``Optimizer.shutdown`` waits for its delayed state-averaging step, whose parameter round looks for a
    group until its timeout: a trainer whose partner had just left took 20 s to exit (CI). Cancelling the round that
    was handed to the delayed step is not enough: if the cancel lands before ``_do`` takes the round, ``_do`` discards
    it as failed and begins a new one, which looks for a group as long (CI: cancelled, still 8 s). Reproduced for both
    orders by ``tests/test_swarm_optimizer.py`` (the leaver). Drop when hivemind's shutdown stops its delayed step."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._rounds_lock = threading.Lock()
        self._rounds: List[StepControl] = []
        self._leaving = False
        super().__init__(*args, **kwargs)

    def step(self, *args: Any, wait: bool = True, **kwargs: Any) -> Any:
        if wait:
            return super().step(*args, wait=True, **kwargs)
        control = super().step(*args, wait=False, **kwargs)
        with self._rounds_lock:
            self._rounds = [each for each in self._rounds if not each.done()] + [control]
            leaving = self._leaving
        if leaving:
            give_up(control)
        return control

    def leave(self) -> int:
        """Give up the rounds without a group now and those begun from now on; returns how many were given up."""
        with self._rounds_lock:
            self._leaving = True
            rounds = list(self._rounds)
        return sum(give_up(control) for control in rounds)


def give_up(control: StepControl) -> bool:
    """Cancel a round that has found no group yet (one that finds its group meanwhile serves it with weight 0: see
    :class:`CancelSafe`)."""
    if control.done() or control.stage not in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
        return False
    with contextlib.suppress(InvalidStateError):  # cancelled meanwhile by another thread (a shutdown watchdog)
        control.cancel()
    return True
