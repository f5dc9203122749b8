"""The averagers the swarm runs: hivemind's, with our fixes (:mod:`lean_transformer.swarm.hivemind_fixes`) and
their rounds reported as peer events (:mod:`.round_events`). Their class names are on the wire (hivemind names RPCs
after them, see :mod:`~lean_transformer.swarm.hivemind_fixes.rpc_names`): keep them."""
from __future__ import annotations

from typing import Any, Optional

from hivemind.averaging.control import StepControl
from hivemind.optim import grad_averager, state_averager

from lean_transformer.swarm.averaging.robust import Aggregated
from lean_transformer.swarm.averaging.round_events import ReportsRounds
from lean_transformer.swarm.hivemind_fixes.averagers import CancelSafe, LeavesUngrouped, NoGradientDownload
from lean_transformer.swarm.hivemind_fixes.rpc_names import NamedRPCs
from lean_transformer.swarm.hivemind_fixes.state_download import ValidatedStateSharing
from lean_transformer.swarm.hivemind_fixes.stream_answers import AnswersDelivered


class GradientAverager(ReportsRounds, NamedRPCs, NoGradientDownload, CancelSafe, Aggregated, AnswersDelivered,
                       grad_averager.GradientAverager):
    """hivemind's GradientAverager (same RPC names, for its subclasses too), safe to cancel, its answers delivered,
    with no state to share or download. ``aggregation="centered_clip"`` reduces with CenteredClip instead of the mean
    (:mod:`.robust`)."""

    rpc_class_name = "GradientAverager"

    # the epoch label this peer's rounds gather from now on (set by the optimizer; hivemind's gradient rounds gather
    # nothing): groupmates learn each other's labels, so a peer whose label lags can take the group's (see
    # SwarmOptimizer._align_epoch_with_group)
    epoch_for_gather: Optional[int] = None

    def schedule_step(self, scheduled_time: Optional[float] = None, **kwargs: Any) -> StepControl:
        kwargs.setdefault("gather", self.epoch_for_gather)
        return super().schedule_step(scheduled_time, **kwargs)


class TrainingStateAverager(ReportsRounds, CancelSafe, AnswersDelivered, ValidatedStateSharing,
                            state_averager.TrainingStateAverager, LeavesUngrouped):
    """hivemind's TrainingStateAverager (same RPC names), safe to cancel, its answers delivered, sharing consistent
    states and loading only states that fit; a leaver gives up its rounds without a group (``leave``)."""
