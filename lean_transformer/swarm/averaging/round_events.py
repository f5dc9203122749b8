"""Averaging rounds as peer events (:mod:`lean_transformer.swarm.monitoring.events`): ``round_started``, ``averaged``
and ``round_missed``, emitted from the averager's own (forked) process, which inherits the peer's event stream."""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Iterator, Optional

from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo

from lean_transformer.swarm.monitoring.events import emit

# the averager's prefix ends with one of these (hivemind.Optimizer's two averagers, DiLoCo's outer averager)
_KINDS = {"_grad_averager": "gradients", "_state_averager": "parameters", "_outer": "outer"}
_round: ContextVar[Optional[StepControl]] = ContextVar("round", default=None)  # one per _step task


class ReportsRounds:
    """Mixed in front of a hivemind averager class: each round of its ``_step`` becomes events."""

    @property
    def _round_kind(self) -> str:
        return next((kind for suffix, kind in _KINDS.items() if self.prefix.endswith(suffix)), self.prefix)

    def _round_epoch(self, step: StepControl) -> Optional[int]:
        """The epoch that hivemind.Optimizer gathers with a state-averaging round; the other rounds carry none."""
        try:
            gathered = self.serializer.loads(self.serializer.loads(step.data_for_gather)[2])
        except Exception:  # not the layout that hivemind's DecentralizedAverager.step writes
            return None
        return gathered if isinstance(gathered, int) and not isinstance(gathered, bool) else None

    async def _step(self, *, step: StepControl, **kwargs: Any) -> None:
        _round.set(step)
        try:
            await super()._step(step=step, **kwargs)
        finally:
            if step.done() and not step.cancelled():
                kind, epoch = self._round_kind, self._round_epoch(step)
                error = step.exception()
                if error is None:
                    group = step.result()
                    emit("averaged", kind=kind, epoch=epoch, group_size=len(group) if group else None, bytes=None)
                else:
                    emit("round_missed", kind=kind, epoch=epoch, reason=f"{type(error).__name__}: {error}")

    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info: GroupInfo) -> Iterator[None]:
        step = _round.get()  # hivemind registers the group right before the round's all-reduce
        emit("round_started", kind=self._round_kind, epoch=None if step is None else self._round_epoch(step),
             group_size=len(group_info.peer_ids))
        with super()._register_allreduce_group(group_info):
            yield
