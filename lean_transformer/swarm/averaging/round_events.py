"""Averaging rounds as peer events (:mod:`lean_transformer.swarm.monitoring.events`): ``round_started`` when an
averager begins a round (it looks for a group), then ``averaged`` or ``round_missed``, emitted from the averager's own
(forked) process, which inherits the peer's event stream.

A round cancelled, or only served with weight 0, because its peer is leaving (:meth:`ReportsRounds.mark_leaving`)
is missed for the reason ``leaving``: it is no round the peer missed while it trained. Reported as ``cancelled``,
every DiLoCo trainer stopped at the end of benchmarks/internet.py counted one missed round in 4-6, which alone held
every one of them under the 90% of rounds averaged that issue 23 asks for."""
from __future__ import annotations

import multiprocessing as mp
from typing import Any, Optional

from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.control import StepControl

from lean_transformer.swarm.monitoring.events import emit

# the averager's prefix ends with one of these (hivemind.Optimizer's two averagers, DiLoCo's outer averager)
_KINDS = {"_grad_averager": "gradients", "_state_averager": "parameters", "_outer": "outer"}


class ReportsRounds:
    """Mixed in front of a hivemind averager class: each round of its ``_step`` becomes events."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._peer_leaving = mp.Event()  # before hivemind forks the averager's process, which reads it
        super().__init__(*args, **kwargs)

    def mark_leaving(self) -> None:
        """Called in the host process before it cancels this averager's rounds because the peer is leaving."""
        self._peer_leaving.set()

    async def _step(self, *, step: StepControl, **kwargs: Any) -> None:
        kind = next((kind for suffix, kind in _KINDS.items() if self.prefix.endswith(suffix)), self.prefix)
        epoch = self._round_epoch(step)
        emit("round_started", kind=kind, epoch=epoch)
        try:
            await super()._step(step=step, **kwargs)
        finally:
            served_only = step.done() and step.weight == 0 and self.mode != AveragingMode.AUX
            if self._peer_leaving.is_set() and (step.cancelled() or not step.done() or served_only):
                emit("round_missed", kind=kind, epoch=epoch, reason="leaving")
            elif step.cancelled() or not step.done():
                emit("round_missed", kind=kind, epoch=epoch, reason="cancelled")
            elif step.exception() is not None:
                error = step.exception()
                emit("round_missed", kind=kind, epoch=epoch, reason=f"{type(error).__name__}: {error}")
            elif served_only:  # e.g. diloco.PseudoGradientAverager.release, or a pre-scheduled round at shutdown
                emit("round_missed", kind=kind, epoch=epoch, reason="served its group with weight 0")
            else:
                emit("averaged", kind=kind, epoch=epoch, group_size=len(step.result() or ()), bytes=None)

    def _round_epoch(self, step: StepControl) -> Optional[int]:
        """The epoch that hivemind.Optimizer gathers with a state-averaging round (and SwarmOptimizer with a gradient
        round); the other rounds carry none."""
        return gathered_epoch(self.serializer, step.data_for_gather)


def gathered_data(serializer: Any, data_for_gather: bytes) -> Any:
    """What a member gathered, from its ``data_for_gather`` (the layout hivemind's ``DecentralizedAverager.step``
    writes: its serializer's [bandwidth, mode, gathered]); None if it is not that layout (a peer's message:
    anything)."""
    try:
        return serializer.loads(serializer.loads(data_for_gather)[2])
    except Exception:
        return None


def gathered_epoch(serializer: Any, data_for_gather: bytes) -> Optional[int]:
    """The epoch label in a member's ``data_for_gather`` (:func:`gathered_data`), or None: none or not an int."""
    gathered = gathered_data(serializer, data_for_gather)
    return gathered if isinstance(gathered, int) and not isinstance(gathered, bool) else None
