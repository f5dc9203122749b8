"""The swarm optimizer: a ``hivemind.Optimizer`` that averages with the run's peers in one of two modes, gradient
averaging (hivemind's) or DiLoCo's local steps and outer rounds (:mod:`lean_transformer.swarm.averaging.diloco`),
built from the collaboration arguments and a task (its param groups, LAMB factory and LR schedule) by
:meth:`SwarmOptimizer.from_settings`, for trainers and, with ``auxiliary=True``, for peers that only help averaging.
Its averagers are hivemind's with our fixes (:mod:`lean_transformer.swarm.averaging.averagers`); in an authorized swarm
they serve token holders only (:mod:`lean_transformer.swarm.auth.averaging_gate`)."""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Iterator, Mapping, Optional, Sequence,
                    Union)

import hivemind
import torch
from hivemind.averaging.control import StepControl
from hivemind.compression import (BlockwiseQuantization, CompressionBase, CompressionInfo, Float16Compression,
                                  NoCompression, Quantile8BitQuantization, ScaledFloat16Compression,
                                  SizeAdaptiveCompression, TensorRole, Uniform8BitQuantization)
from hivemind.compression.adaptive import AdaptiveCompressionBase
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.optim import state_averager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from torch import nn

from lean_transformer.optim.grad_offload import HostGradients
from lean_transformer.swarm.auth.averaging_gate import (AveragingGate, GatedGradientAverager, GatedTrainingStateAverager,
                                                        publish_access_token)
from lean_transformer.swarm.auth.keys import load_public_key
from lean_transformer.swarm.averaging.diloco import (NEVER, DiLoCoSettings, OuterLoop, OuterNesterov, RoundProgress,
                                                     PseudoGradientAverager)
from lean_transformer.swarm.averaging.early_join import EarlyJoin, can_join_early
from lean_transformer.swarm.averaging.host_grad_averager import HostGatedGradientAverager, HostGradientAverager
from lean_transformer.swarm.averaging.averagers import GradientAverager, TrainingStateAverager
from lean_transformer.swarm.averaging.state_check import IgnoresRefusedDonors, StateCheck, record_reporter
from lean_transformer.swarm.hivemind_fixes.dht_pacing import REPORT_INTERVAL, PacedFetches, PacedReports
from lean_transformer.swarm.hivemind_fixes.progress_fetch import FetchesUnlocked
from lean_transformer.swarm.hivemind_fixes.store_outcomes import ReadsStoreOutcomes
from lean_transformer.swarm.monitoring.events import emit
from lean_transformer.swarm.protocol.dht import TimedLookups

if TYPE_CHECKING:
    from lean_transformer.swarm.protocol.settings import (CollaborationSettings, NetworkSettings, TrainingSettings,
                                                          TrainingTask)

logger = logging.getLogger(__name__)
# a matchmaking declaration must outlive the store that publishes it and the lookups that find it: twice the slowest
# recent lookup (see SwarmOptimizer.matchmaking_window)
LOOKUP_MARGIN = 2.0
# a leaving DiLoCo peer serves the rounds whose group has formed for at most this long (OuterLoop.leave): within the
# trainer's --shutdown_timeout (25 s by default), of which the final backup and goodbye took up to 8 s on
# benchmarks/internet.py's starved peers
LEAVE_GRACE = 10.0
# a trainer that sees no other trainer steps alone only once this many matchmaking windows have passed since its first
# local step (SwarmOptimizer._alone); until then it waits for one to appear
STARTUP_WINDOWS = 2.0


def matchmaking_window(matchmaking_time: float, lookups: Iterable[float], cap: float) -> float:
    """``LOOKUP_MARGIN`` times the slowest of ``lookups`` (seconds), within [``matchmaking_time``, ``cap``]: the
    matchmaking time wins over the cap (``cap`` bounds only how far slow lookups stretch the window)."""
    return max(matchmaking_time, min(cap, LOOKUP_MARGIN * max(lookups, default=0.0)))


def make_compression(name: str, size_adaptive_threshold: int = 2**16) -> CompressionBase:
    """The hivemind compression for a ``--grad_compression`` / ``--state_compression`` choice."""
    simple = dict(none=NoCompression, float16=Float16Compression, scaled_float16=ScaledFloat16Compression,
                  uniform8bit=Uniform8BitQuantization, quantile8bit=Quantile8BitQuantization,
                  blockwise8bit=BlockwiseQuantization)
    if name == "size_adaptive":
        return SizeAdaptiveCompression(size_adaptive_threshold, less=Float16Compression(),
                                       greater_equal=Uniform8BitQuantization())
    if name not in simple:
        raise ValueError(f"unknown compression {name!r}, choose one of size_adaptive, {', '.join(simple)}")
    return simple[name]()


class ParametersOnly(AdaptiveCompressionBase):
    """Compresses the state's float parameters and sends everything else as it is. The optimizer statistics must
    arrive exactly: the 8-bit (uint8) LAMB codes are refused or mangled by hivemind's float16 and 8-bit codecs, and
    the float32 second moments of small tensors (~1e-8 and below) flush to zero in float16."""

    def __init__(self, compression: CompressionBase):
        self.compression = compression

    def choose_compression(self, info: CompressionInfo) -> CompressionBase:
        floats = info.descriptor.dtype in (torch.float32, torch.float16)
        return self.compression if floats and info.role == TensorRole.PARAMETER else NoCompression()


class TrustedProgress(IgnoresRefusedDonors, PacedReports, PacedFetches, ReadsStoreOutcomes, ProgressTracker):
    """hivemind's progress tracker, blind to the donors whose states this peer refused (:mod:`.state_check`), its
    reports and lookups paced and its stores' outcomes read."""


class TrustedRoundProgress(IgnoresRefusedDonors, PacedReports, PacedFetches, ReadsStoreOutcomes, FetchesUnlocked,
                           RoundProgress):
    """DiLoCo's progress tracker (:class:`.diloco.RoundProgress`), blind to the donors whose states this peer
    refused, its reports and lookups paced, its stores' outcomes read and its lookups run without its lock."""


@dataclass(frozen=True)
class EpochEnd:
    """Why a peer ended an epoch (hivemind's ``ProgressTracker.ready_to_update_epoch``): ``"swarm_ahead"`` (a full
    peer's record shows a later epoch), ``"samples"`` (the records counted reach the target batch), ``"eta"`` (the
    records, extrapolated at each peer's reported speed, should have reached it by now) or, in DiLoCo mode,
    ``"group"`` (a groupmate of the prepared round began its all-reduce first: :meth:`OuterLoop.group_began`);
    ``samples``: the swarm's samples that the records counted."""

    reason: str
    samples: int

    @classmethod
    def now(cls, tracker: ProgressTracker) -> EpochEnd:
        progress = tracker.global_progress
        reason = ("swarm_ahead" if tracker.global_epoch > tracker.local_progress.epoch else
                  "samples" if progress.samples_accumulated >= tracker.target_batch_size else
                  "group" if (get_dht_time() < progress.eta_next_epoch and isinstance(tracker, RoundProgress)
                              and tracker.group_began()) else "eta")
        return cls(reason, int(progress.samples_accumulated))


class SwarmOptimizer(hivemind.Optimizer):
    """``hivemind.Optimizer`` running this project's averagers, in gradient-averaging mode or, given ``diloco``, in
    DiLoCo mode: each ``step`` is one local inner step (and advances the inner LR schedule by one step), each of
    hivemind's epochs ends with an outer round of its :class:`~lean_transformer.swarm.averaging.diloco.OuterLoop`.

    What a peer needs of it beyond hivemind's interface is its own, so that no caller reaches into its parts:

    - ``host_grads``: with ``host_gradients`` the model's gradients leave the device during backward into host
      buffers (:class:`~lean_transformer.optim.grad_offload.HostGradients`; None without): the gradient averager's
      (:mod:`lean_transformer.swarm.averaging.host_grad_averager`), or in DiLoCo mode the offloaded optimizer's
      float32 ``.grad``; either way low-precision weights (``--model_dtype``) step through float32 master copies;
      ``device_accumulation`` > 1 sums that many gradients on the device first (``HostGradients``);
    - ``waiting``: a context manager around outer rounds and state downloads, time that is not compute;
    - ``last_gradient_round``: the gradient round that ended the last epoch (hivemind's ``StepControl``; its result
      names the group), as ``scheduled_grads`` may already hold the next epoch's (gradient mode);
    - ``last_epoch_end``: why this peer last ended an epoch with a step of its own, and the swarm's samples it
      counted then (:class:`EpochEnd`; None until it does);
    - :meth:`cancel_rounds_in_flight`, for a peer that leaves; :meth:`restart_from_anchor`, after its parameters were
      replaced; :meth:`checkpoint_state` / :meth:`load_checkpoint_state`, what a checkpoint holds besides hivemind's.

    ``gate``: averagers that serve token holders only (authorized swarms). ``aggregation``: how the gradient (or
    pseudo-gradient) all-reduce combines the peers' parts, "mean" or "centered_clip"
    (:mod:`lean_transformer.swarm.averaging.robust`); parameter averaging stays a mean. ``averager_opts`` go to every
    averager (hivemind passes its own to the state averager only). Other arguments are ``hivemind.Optimizer``'s.
    """

    def __init__(self, *, params: list[dict], averager_opts: Optional[dict] = None,
                 gate: Optional[AveragingGate] = None, host_gradients: bool = False, device_accumulation: int = 1,
                 diloco: Optional[DiLoCoSettings] = None, aggregation: str = "mean",
                 waiting: Callable[[], ContextManager] = contextlib.nullcontext, **kwargs: Any):
        averager_opts = dict(averager_opts or {}, **({} if gate is None else dict(gate=gate)))
        self.waiting = waiting
        self.host_grads: Optional[HostGradients] = None
        self.device_accumulation = device_accumulation
        self.outer_loop: Optional[OuterLoop] = None
        self._diloco = diloco is not None
        self._downloaded: Optional[tuple[Optional[str], int]] = None  # DiLoCo: (donor, rounds) at the last download
        self._excluded: dict[str, float] = {}  # the peers this peer's averagers excluded -> Unix time it ends
        self._group_epochs: Optional[list[int]] = None  # the epochs gathered by the last gradient round
        self._group_epoch: Optional[int] = None  # the epoch that round's groupmates moved to, one ahead of ours
        self._group_majority = False  # whether most of that round's group gathered the label ahead of ours
        self._step_samples = 0  # the samples of the last step (a micro-batch)
        self.last_gradient_round: Optional[StepControl] = None  # the epoch's round (scheduled_grads: the next one's)
        self.last_epoch_end: Optional[EpochEnd] = None
        self._early_join: Optional[EarlyJoin] = None  # gradient mode: joins rounds during long micro-batches
        self._joined_early: Optional[StepControl] = None  # the round it joined, until this epoch's step takes it
        self._waiting_epoch: Optional[int] = None  # DiLoCo: the last epoch whose end waited for a round in flight
        self._first_step: Optional[float] = None  # time.monotonic() at this peer's first local step
        self._leaving = threading.Event()  # set once this peer leaves: it waits for no partner then
        self._state_averager_class = GatedTrainingStateAverager if gate is not None else TrainingStateAverager
        self._progress_tracker_class = TrustedProgress if diloco is None else TrustedRoundProgress
        outer = None
        if diloco is None:
            averager_class = gradient_averager_class(gate is not None, host_gradients)
            host_opts = dict(device_accumulation=device_accumulation) if host_gradients else {}
            kwargs["grad_averager_factory"] = functools.partial(averager_class, aggregation=aggregation,
                                                                **host_opts, **averager_opts)
        else:
            outer = OuterNesterov([param for group in params for param in group["params"]], lr=diloco.outer_lr,
                                  momentum=diloco.outer_momentum)
            kwargs.update(use_local_updates=True, extra_tensors=outer.state_tensors(), average_state_every=NEVER)
        super().__init__(params=params, averager_opts=averager_opts, **kwargs)
        self.tracker.refused = self.state_averager.refused_donors
        if diloco is None:
            if host_gradients:
                self.host_grads = self.grad_averager.host_grads
            if not self.auxiliary and can_join_early(self.grad_averager, host_gradients, self.delay_optimizer_step):
                self._early_join = EarlyJoin(self.grad_averager, self.tracker, self._maybe_schedule_gradient_averaging,
                                             lambda: self.scheduled_grads, slack=self.matchmaking_time)
            return
        averager = PseudoGradientAverager(
            self.dht, f"{self.run_id}_outer", [anchor.shape for anchor in outer.anchor],
            matchmaking_time=self.matchmaking_time, window=self.matchmaking_window,
            allreduce_timeout=self.averaging_timeout,
            compression=diloco.compression, topk_fraction=diloco.topk_fraction, client_mode=self.client_mode,
            auxiliary=self.auxiliary, aggregation=aggregation, swarm_size=self._trainers_seen,
            known_trainers=self._full_trainers, **averager_opts)
        self.outer_loop = OuterLoop(outer, averager, overlap=diloco.overlap, check_averages=aggregation != "mean",
                                    branch_depth=diloco.branch_depth if diloco.topk_fraction is not None else 0,
                                    history_donors=self._full_trainers)
        self.local_steps, self.steps_in_round = diloco.local_steps, 0
        self.tracker.group_began = self.outer_loop.group_began  # a groupmate's all-reduce ends the round here too
        self.outer_loop.lock = self.state_averager.lock_optimizer  # newcomers download the outer state under it
        # a state served while this peer's round awaits its outer step is one step behind the swarm's. With dense
        # rounds, the newcomer that loads it loses its first vote and downloads again (OuterLoop.apply_finished),
        # so a donor waits for the step, at most the round's time (serve_wait: the matchmaking time + averaging
        # timeout); with top-k rounds the newcomer replays the step from its group's histories, and no donor waits
        self.state_averager.serve_gate = self.outer_loop.settled
        outer.bind(self._offloaded_parameters())
        if host_gradients:
            self.host_grads = self._host_gradients_into_offloaded_optimizer()
        self._label_outer_state()

    @classmethod
    def from_settings(cls, dht: hivemind.DHT, model: nn.Module, task: TrainingTask, network: NetworkSettings,
                      collaboration: CollaborationSettings, training: TrainingSettings, private_key: RSAPrivateKey,
                      *, auxiliary: bool = False, host_gradients: bool = False,
                      waiting: Callable[[], ContextManager] = contextlib.nullcontext) -> SwarmOptimizer:
        """Wrap the task's LAMB and LR schedule in an optimizer that averages with the run's peers.

        ``private_key`` owns the progress records (the same key as the metrics records). With --fp16, gradients are
        accumulated in the model's .grad buffers, because hivemind's GradScaler unscales exactly those (not with
        --block_grad_scaling, which unscales every local step: then as --reuse_grad_buffers says). With
        --auth_token_path, this peer's token is published first (its averaging partners look it up) and the
        averagers are gated. ``host_gradients`` needs ``offload_optimizer`` and no delays (see ``host_grads``).
        """
        gate = open_averaging_gate(dht, network, private_key) if network.auth_token_path is not None else None
        diloco = None
        if collaboration.local_steps > 0:
            topk = collaboration.outer_compression == "topk"
            diloco = DiLoCoSettings(
                collaboration.local_steps, collaboration.outer_lr, collaboration.outer_momentum,
                collaboration.outer_overlap,
                NoCompression() if topk else make_compression(collaboration.outer_compression,
                                                              collaboration.size_adaptive_threshold),
                collaboration.outer_topk_fraction if topk else None, collaboration.outer_branch_depth)
        state_compression = ParametersOnly(make_compression(collaboration.state_compression,
                                                            collaboration.size_adaptive_threshold))
        return cls(
            dht=dht,
            run_id=network.run_id,
            target_batch_size=collaboration.target_batch_size * max(1, collaboration.local_steps),
            batch_size_per_step=(None if auxiliary
                                 else training.per_device_batch_size * training.gradient_accumulation_steps),
            params=task.param_groups(model),
            optimizer=task.optimizer_factory(),
            scheduler=task.scheduler_factory(),
            matchmaking_time=collaboration.matchmaking_time,
            averaging_timeout=collaboration.averaging_timeout,
            next_chunk_timeout=collaboration.next_chunk_timeout,
            load_state_timeout=collaboration.load_state_timeout,
            average_state_every=collaboration.average_state_every,
            offload_optimizer=collaboration.offload_optimizer,
            delay_optimizer_step=collaboration.delay_optimizer_step,
            delay_grad_averaging=collaboration.delay_grad_averaging,
            reuse_grad_buffers=collaboration.reuse_grad_buffers or (training.fp16 and not training.block_grad_scaling),
            client_mode=network.client_mode,
            auxiliary=auxiliary,
            grad_compression=make_compression(collaboration.grad_compression, collaboration.size_adaptive_threshold),
            state_averaging_compression=state_compression,
            load_state_compression=state_compression,
            averager_opts=averager_options(network, collaboration),
            tracker_opts=dict(private_key=private_key),
            verbose=True,
            gate=gate,
            host_gradients=host_gradients,
            device_accumulation=training.device_accumulation,
            diloco=diloco,
            aggregation=collaboration.aggregation,
            waiting=waiting,
        )

    def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> ProgressTracker:
        # hivemind 1.1.12's own arguments (pinned in pyproject.toml), with the tracker of this mode. Its status
        # ("accumulated N samples for epoch #E from P peers", every refresh: up to 2 lines a second) is DEBUG: the
        # trainer's progress line says the same every --progress_every seconds
        self.dht_lookups = TimedLookups(self.dht)
        return self._progress_tracker_class(dht=self.dht_lookups, prefix=self.run_id,
                                            target_batch_size=target_batch_size, client_mode=self.client_mode,
                                            status_loglevel=logging.DEBUG, start=True, **kwargs)

    def _make_state_averager(self, **kwargs: Any) -> state_averager.TrainingStateAverager:
        # hivemind 1.1.12's own arguments (pinned in pyproject.toml): it offers no factory for this averager
        return self._state_averager_class(
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
            serve_wait=self.matchmaking_time + self.averaging_timeout if self._diloco else 0.0,
            start=True,
            **kwargs,
        )

    def _offloaded_parameters(self) -> list[torch.Tensor]:
        return [param for group in self.state_averager.optimizer.param_groups for param in group["params"]]

    def _host_gradients_into_offloaded_optimizer(self) -> HostGradients:
        """DiLoCo mode's host gradients: accumulated in the offloaded optimizer's ``.grad``."""
        if not self.offload_optimizer:
            raise ValueError("offload_optimizer: host gradients feed the offloaded optimizer, so they need it")
        masters = self._offloaded_parameters()
        buffers = [torch.zeros(master.shape, dtype=torch.float32) for master in masters]
        for master, buffer in zip(masters, buffers):
            master.grad = buffer  # hivemind's local step never zeroes the offloaded optimizer's gradients
        host_grads = HostGradients(self.state_averager.main_parameters, buffers,
                                   device_accumulation=self.device_accumulation)
        self._schema_hash = self._compute_schema_hash()  # hivemind checks that the .grad tensors stay these
        return host_grads

    def step(self, closure: Optional[Callable] = None, batch_size: Optional[int] = None,
             grad_scaler: Optional[hivemind.GradScaler] = None) -> Any:
        self._step_samples = batch_size if batch_size is not None else (self.batch_size_per_step or 0)
        if self._first_step is None:
            self._first_step = time.monotonic()
        if self.outer_loop is None:
            with self._early_join.training_step() if self._early_join is not None else contextlib.nullcontext():
                return super().step(closure, batch_size=batch_size, grad_scaler=grad_scaler)
        epoch = self.local_epoch
        if not self.auxiliary:  # before the step: the round it may end includes these samples
            self.outer_loop.add_samples(batch_size if batch_size is not None else self.batch_size_per_step)
            if self.host_grads is not None:
                self.host_grads.zero_untouched_()  # waits for the copies in flight
            elif self.offload_optimizer:  # hivemind leaves this to its gradient averager, which local updates lack
                self.state_averager._load_local_grads_into_optimizer_()
        result = super().step(closure, batch_size=batch_size, grad_scaler=grad_scaler)
        if self.host_grads is not None:
            self.host_grads.reset()  # the next local step's first gradients overwrite the buffers
        if not self.auxiliary:
            if self.local_epoch == epoch:
                self.steps_in_round += 1
                self._apply_finished_outer_round()
                self._maybe_prepare_outer_round()
            self._advance_inner_schedule()
        return result

    def _apply_finished_outer_round(self) -> None:
        """DiLoCo with --outer_overlap: apply the background round's outer step as soon as its all-reduce is over
        (:meth:`OuterLoop.apply_finished`), so that the state this peer serves is the swarm's; and download the
        state at once if its group converged on another."""
        if not self.outer_loop.finished_in_background():
            return
        with self.waiting(), self.tracker.performance_ema.pause():
            self.state_averager.step(wait_for_delayed_updates=True)
            self.outer_loop.apply_finished()
            if self.offload_optimizer:
                self.state_averager._apply_optimizer_parameters_()
            self._label_outer_state()
            self._download_if_behind()

    def _download_if_behind(self) -> None:
        """Download the outer state the last round's group converged on, if this peer's was another.

        A peer ahead of that state (more outer steps: it stepped alone, or its last round succeeded where the others'
        failed) held it itself a few steps ago, so the group's state is less trained than its own, and the loss check
        of downloads refused it: in tests/test_diloco_faults.py (CI) steady stepped alone 3 times while the two others
        downloaded its state of 1 step, lost the vote of their first round together (2 against 1), refused both
        groupmates' states as 18-22% worse on a batch, and averaged every later round from another anchor than
        theirs. Its download now also accepts a state that lies no farther from its own anchor than ``AHEAD_REACH``
        times the length of its own path since it held the group's (:meth:`OuterLoop.moved_since`): what the group's
        vote can move it by is bounded by its own last steps (``docs/security.md``)."""
        if not self.outer_loop.behind:
            return
        ours, theirs = self.outer_loop.outer_steps_behind
        reach = self.outer_loop.ahead_reach
        logger.info(f"This peer's outer state ({ours} outer steps) differs from the one {len(self.outer_loop.donors)} "
                    f"groupmate(s) hold ({theirs}): downloading theirs"
                    f"{'' if reach is None else f' (accepted within {reach:.4g} of its own anchor)'}")
        with self.outer_loop.unsettled():  # its own state is not the swarm's: served, it would pass on the lost one
            self.outer_loop.behind = False
            self.load_state_from_peers(donors=self.outer_loop.donors, trusted=self._trusted_donors(),
                                       reason="outer_state", within=reach)

    def _maybe_prepare_outer_round(self) -> None:
        """DiLoCo: begin the outer round's matchmaking once the swarm is expected to end the round within the
        matchmaking time (:meth:`OuterLoop.prepare`), as hivemind's gradient averaging pre-schedules its rounds.
        In client mode too: such a peer cannot lead a group but joins one ahead. Begun only at its own end of the
        round, a client-mode trainer came to groups that had formed without it: in benchmarks/internet.py (16 DiLoCo
        trainers, a quarter in client mode) the two least-averaging full-length trainers were both client-mode,
        at 67% of their rounds against a median of 100%."""
        if self.tracker.global_progress.num_peers <= 1:  # alone: its round forms no group
            return
        expected = self.tracker.estimated_next_update_time
        if expected - get_dht_time() <= self.matchmaking_window():
            self.outer_loop.prepare(expected, self.tracker.performance_ema.samples_per_second)

    def matchmaking_window(self) -> float:
        """How long before a round this peer declares itself for it (and, in a round begun unprepared, how long its
        declaration lives): the matchmaking time, or ``LOOKUP_MARGIN`` times the slowest of the DHT lookups of its
        last progress fetches if that is longer. hivemind's matchmaking finds groupmates by looking up their
        declarations in the DHT, and a declaration that expires before a lookup of it returns is never seen.
        benchmarks/internet.py, 16 DiLoCo trainers on 2 cores: lookups took 10-20 s, and with a 5 s window no outer
        round found a group. At most --averaging_timeout: a lookup of a minute must not hold a round for two."""
        return matchmaking_window(self.matchmaking_time, self.dht_lookups.recent, cap=self.averaging_timeout)

    def _advance_inner_schedule(self) -> None:
        """The task's schedule counts inner steps: epoch e's step s is step e * local_steps + s (s < local_steps)."""
        scheduler = self.state_averager.scheduler
        if scheduler is not None:
            target = self.local_epoch * self.local_steps + min(self.steps_in_round, self.local_steps - 1)
            while scheduler._step_count <= target:
                scheduler.step()

    def _epoch_end_waits_for_round(self) -> bool:
        """DiLoCo with --outer_overlap: whether this peer's epoch end waits, and it trains on, because the outer round
        it sent at its last epoch end is still running (until that round ends, at most until its deadline).

        Why: the epoch end first applies that round (:meth:`OuterLoop.end_round`), and blocked until its all-reduce
        was over. In benchmarks/internet.py (16 DiLoCo trainers, 2 cores, links of 20-150 ms) a group of 12 took
        35 s past a trainer's next epoch end, and waits like it were 2.6% of the swarm's wall time. The round the
        trainer sends next begins as late either way (when the last one is over, as before): meanwhile it takes local
        steps, which the next round's pseudo-gradient carries. Nor does hivemind's out-of-sync check download the
        state meanwhile (:meth:`_should_load_state_from_peers`): blocked, the peer did not check either, and the
        round's outcome decides whether it is behind (the group's vote, then a catch-up or a download)."""
        if self.outer_loop is None or self.auxiliary:
            return False
        seconds = self.outer_loop.seconds_in_flight()  # before the tracker's estimate: called at every local step
        if seconds is None or not self.tracker.ready_to_update_epoch:
            return False
        if self._waiting_epoch != self.local_epoch:
            self._waiting_epoch = self.local_epoch
            logger.info(f"Epoch {self.local_epoch} ends while this peer's last outer round is still running: "
                        f"training on until it is over (at most {seconds:.0f} s)")
        return True

    def _update_global_epoch(self, grad_scaler: Optional[hivemind.GradScaler]) -> None:
        if self._epoch_end_waits_for_round() or not self._epoch_end_stands():
            return
        self.last_epoch_end = EpochEnd.now(self.tracker)
        if self.outer_loop is None:
            epoch, self._group_epochs, self._group_epoch = self.local_epoch, None, None
            self.grad_averager.epoch_for_gather = epoch  # a round that starts now (none was pre-scheduled)
            self.last_gradient_round = None  # set again if this epoch's step averages
            with self.waiting():  # the all-reduce, and hivemind's optimizer step after it
                self._advance_epoch(grad_scaler)
            self._align_epoch_with_group(epoch)
            if not self.auxiliary:
                self.tracker.recount()  # the new epoch's ETA from the records last read: hivemind's waits a fetch
                self._maybe_schedule_gradient_averaging()  # now, not one (maybe long) micro-batch later
            return
        with self.waiting():
            with self.outer_loop.unsettled():  # a state served meanwhile would pair the new anchor with the old epoch
                self._end_outer_round()
                self._advance_epoch(grad_scaler)
            self.steps_in_round = 0
            self._download_if_behind()  # e.g. it stepped in another group of the last round (a split)

    def _epoch_end_stands(self) -> bool:
        """Gradient mode: whether this trainer's epoch end stands once it has looked for a partner (:meth:`_alone`:
        at startup it waits for one; at any time, a view that shows no other trainer is checked against the DHT).
        A view that showed no other trainer ended the epoch by hivemind's ETA from this peer's own speed: in
        benchmarks/internet.py (16 trainers) a newcomer ended epoch 0 at its first step after its download, with 12 of
        256 samples, stepped alone while 15 trainers were 14 s from the round, and averaged on from other parameters.
        If the records found meanwhile show the epoch not over, it trains on. Not for a round that :class:`.EarlyJoin`
        joined: its all-reduce has begun."""
        if self.outer_loop is not None or self.auxiliary or self._joined_early is not None:
            return True
        view = self.tracker.global_progress
        with self.waiting():
            self._alone()
        return self.tracker.global_progress is view or self.tracker.ready_to_update_epoch

    def _check_and_accumulate_gradients(self, batch_size: int, grad_scaler: Optional[hivemind.GradScaler]) -> bool:
        """hivemind's, after this epoch's step if :class:`.EarlyJoin` joined its round during the micro-batch: the
        micro-batch then counts toward the next epoch."""
        joined = self._early_join.take() if self._early_join is not None else None
        if joined is not None and joined is self.scheduled_grads:
            self._joined_early = joined
            self._update_global_epoch(grad_scaler)
        return super()._check_and_accumulate_gradients(batch_size, grad_scaler)

    def _begin_averaging_gradients(self, grad_scaler: Optional[hivemind.GradScaler]) -> bool:
        joined, self._joined_early = self._joined_early, None
        if joined is not None and joined is self.scheduled_grads:
            return True  # triggered by EarlyJoin; _average_gradients_and_load_into_optimizer waits for its result
        return super()._begin_averaging_gradients(grad_scaler)

    def _maybe_schedule_gradient_averaging(self) -> None:
        """hivemind's pre-scheduling (begin matchmaking once the round is expected within the matchmaking time),
        for peers whose micro-batches are long. hivemind checks only inside ``step``, so a peer checks again one
        micro-batch later: when that outlasts what is left of its groupmates' matchmaking, it finds their group
        formed and misses the round (a 10x slower peer did, then downloaded the state; tests/test_slow_peer.py).
        So the check also runs right after a download and right after an epoch (whose ETA hivemind leaves unknown
        until the tracker's next fetch: recounted from the records last read), and every 0.1 s while the training
        thread computes (:class:`.EarlyJoin`); without that thread (host gradients, delayed steps), the horizon is
        the matchmaking time plus this peer's own seconds per micro-batch. A round scheduled early waits for this
        peer's trigger, as hivemind's own pre-scheduled rounds do. The window is :meth:`matchmaking_window`, as for
        DiLoCo's rounds: 8 trainers on 2 cores (tests/test_large_swarm.py) saw DHT lookups of 0.3-3.9 s against a 2 s
        matchmaking time, and averaged in groups of 2-5."""
        self.grad_averager.epoch_for_gather = self.local_epoch
        control = self.scheduled_grads
        if control is not None and not (control.triggered or control.done()):
            return
        window = self.matchmaking_window()
        seconds_per_step = self.tracker.performance_ema.ema_seconds_per_sample * self._step_samples
        horizon = window + (0.0 if self._early_join is not None else seconds_per_step)
        eta = self.tracker.estimated_next_update_time - get_dht_time()
        if eta <= horizon:
            logger.log(self.status_loglevel, f"Pre-scheduling the gradient averaging round, expected in {eta:.1f} s")
            # hivemind's round: declared for the matchmaking time, then averaging_timeout in all from scheduling
            self.scheduled_grads = self.grad_averager.schedule_step(
                scheduled_time=get_dht_time() + window, timeout=window - self.matchmaking_time + self.averaging_timeout)

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control: Optional[StepControl]) -> None:
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        control = self.last_gradient_round = maybe_step_control
        if control is not None and control.done() and not control.cancelled() and control.exception() is None:
            self._group_epochs = [epoch for epoch in (control.result() or {}).values()
                                  if isinstance(epoch, int) and not isinstance(epoch, bool)]
            # on the step's own thread (not delayed: hivemind decides on its parameter round after this returns)
            if not self.delay_grad_averaging and self._group_held_state_round():
                logger.info(f"This peer's gradient group was a label ahead (epochs {sorted(set(self._group_epochs))}, "
                            f"this peer {self.local_epoch}): it held this step's parameter round already, skipped")
                self.average_state_every = NEVER  # for the rest of this step (_advance_epoch restores it)

    def _group_held_state_round(self) -> bool:
        """Gradient mode, inside the epoch's step, after its gradient round: whether that round's group had members
        a label ahead of this peer's and none at its label, so that they held the parameter round of the epoch this
        step moves to a round ago, and hivemind's round for it (which this step would begin) has no one to find.

        Seen in benchmarks/internet.py (16 trainers, gradient mode): a newcomer one label behind its group stepped to
        epoch 10 (--average_state_every 10) as the group stepped to 11; its parameter round looked for a group for
        59 s, and its next optimizer step waited for that round (hivemind runs them on one thread), so the swarm moved
        on two epochs meanwhile and it trained two labels behind for the rest of the run: its records went to the
        aux peer's rows two epochs late, after those rows had been written without it. The step skips that round; the
        peer takes the group's label at its next check (:meth:`_should_load_state_from_peers`)."""
        others = list(self._group_epochs or [])
        if self.local_epoch in others:
            others.remove(self.local_epoch)  # this peer's own
        return bool(others) and self.local_epoch not in others and max(others) > self.local_epoch

    def _align_epoch_with_group(self, epoch: int) -> None:
        """Gradient-averaging mode, after the round that ended ``epoch``: note the epoch that groupmates one label
        ahead of ours moved to. hivemind gives a peer the label ``local + 1`` after a step, while its groupmates
        (who reached the round's epoch earlier, e.g. a slow peer that joined late or stepped once alone) step from a
        label one higher with the same averaged gradients. Its parameters took the same step as theirs, but with the
        lower label hivemind's once-per-epoch check (``local_epoch != global_epoch``) finds it "out of sync" and
        downloads the whole state: a 10x slower peer did so every second epoch (tests/test_slow_peer.py). See
        :meth:`_should_load_state_from_peers`."""
        epochs, self._group_epochs = self._group_epochs or [], None
        ahead = max(epochs, default=None)
        if ahead is not None and ahead == epoch + 1 and self.local_epoch == epoch + 1:
            self._group_epoch, self._group_majority = ahead + 1, 2 * epochs.count(ahead) > len(epochs)

    def _should_load_state_from_peers(self) -> bool:
        """hivemind's check, except for a peer whose groupmates of its last round are the swarm's epoch, one label
        ahead of its own: it takes their label instead of downloading. A peer that missed a round the swarm stepped
        in (the swarm is further ahead than its last group) still downloads. Client-mode groupmates never count:
        hivemind's swarm epoch is the full peers' only. Nor does a peer whose :class:`.EarlyJoin` joined this epoch's
        round: the step that takes the round moves it to the swarm's epoch. Where most of the group gathered the label
        ahead, the peer takes it without waiting for its view of the swarm's epoch to show it: with epochs of a few
        seconds, its next round began about 0.2 s after each epoch, before a fetch could show the group's new epoch,
        and a peer that had stepped alone once more at startup kept the lower label for its whole run (CI,
        tests/test_robust_swarm.py: its groups were never in step, so no strike counted against a sign-flipping peer).

        Nor, in DiLoCo, a peer one label behind the swarm: the swarm being ahead, this very step ends its epoch, and
        its round's group decides whether its outer state is behind (a catch-up from a groupmate's history, else a
        download). hivemind's exact check runs at the first step after the tracker's first fetch of an epoch; where
        that fetch came late (slow DHT lookups), or after an epoch end that waited for the last round
        (:meth:`_epoch_end_waits_for_round`), the swarm had moved on by then, and the peer threw away the round it had
        just averaged and downloaded the state: 5 of the 5 downloads after joining in a benchmarks/internet.py run
        (16 DiLoCo trainers, seed 0), by trainers that had averaged every round."""
        if (self._early_join is not None and self._early_join.pending) or self._epoch_end_waits_for_round():
            return False
        if self.outer_loop is not None and self.local_epoch == self.tracker.global_epoch - 1:
            return False
        group_epoch = self._group_epoch
        confirmed = group_epoch is not None and (self.tracker.global_epoch == group_epoch
                                                 or self._group_majority and self.tracker.global_epoch < group_epoch)
        if confirmed and group_epoch == self.local_epoch + 1:
            logger.info(f"This peer's last group stepped from epoch {group_epoch - 1} (this peer: "
                        f"{self.local_epoch - 1}): taking the swarm's epoch {group_epoch}, no download")
            with self.tracker.pause_updates():
                self.state_averager.local_epoch = group_epoch
                self.tracker.update_epoch(new_epoch=group_epoch)
            emit("label_taken", epoch=group_epoch, previous=group_epoch - 1)
            if not self.client_mode:
                self.state_averager.state_sharing_priority = self.local_epoch
                self.grad_averager.state_sharing_priority = self.local_epoch
            self._join_group_state_round()
        if group_epoch is not None and self.local_epoch != group_epoch - 1:
            self._group_epoch = None  # taken, or moved on (the next round notes its own)
        return super()._should_load_state_from_peers()

    def _join_group_state_round(self) -> None:
        """After taking the group's epoch label: the group's step to that epoch began hivemind's parameter-averaging
        round if the epoch is one of --average_state_every's (``_update_global_epoch``). This peer took the same step
        under its lower label, so it joins that round as if it had stepped to the label itself: else its groupmates
        average without it, or not at all (seen on CI: a pair's last round found no group, and the pair ended 0.02
        apart)."""
        epoch = self.local_epoch
        if (epoch % self.average_state_every or self.tracker.global_progress.num_peers <= 1
                or self.state_averager.averaging_in_progress):
            return
        control, self.scheduled_state = self.scheduled_state, None  # pre-scheduled for this epoch (gather=epoch)
        if control is not None and (control.triggered or control.done()):
            control = None
        self.state_averager.step(averaging_round=True, delay_averaging=self.delay_state_averaging,
                                 averaging_control=control, averaging_opts=dict(timeout=self.averaging_timeout))

    def _advance_epoch(self, grad_scaler: Optional[hivemind.GradScaler]) -> None:
        """hivemind's epoch update (in DiLoCo mode after the outer round), without the parameter round that this
        peer's gradient group held a round ago (:meth:`_group_held_state_round`)."""
        average_state_every = self.average_state_every
        try:
            super()._update_global_epoch(grad_scaler)
        finally:
            self.average_state_every = average_state_every

    def _end_outer_round(self) -> None:
        with self.tracker.performance_ema.pause():  # not tracker.pause_updates: hivemind's epoch update takes it
            self.state_averager.step(wait_for_delayed_updates=True)
            alone = not self.auxiliary and self._alone()
            if not self.auxiliary and not alone:
                logger.info(f"Epoch {self.local_epoch} ends: all-reducing pseudo-gradients with the swarm")
            group_size = self.outer_loop.end_round(alone=alone)
            if self.offload_optimizer:
                self.state_averager._apply_optimizer_parameters_()
            self._label_outer_state()
            if not self.auxiliary:
                if group_size is None and self.outer_loop.nothing_to_apply:
                    logger.info("First outer round sent in the background: its step applies when the next one ends")
                elif group_size is None:
                    logger.info("Outer round missed: this peer's progress folds into the next round")
                else:
                    logger.info(f"Outer step with {group_size} peer{'s' if group_size != 1 else ''} "
                                f"(round {int(self.outer_loop.outer.steps)})")
                    emit("outer_step", epoch=self.local_epoch, group_size=group_size,
                         outer_steps=int(self.outer_loop.outer.steps))

    def _alone(self) -> bool:
        """Whether no other trainer is in the swarm, so that this peer's epoch steps with its own (pseudo-)gradient.
        A peer that sees none within ``STARTUP_WINDOWS`` matchmaking windows of its first local step waits until then
        for one to appear, looking the records up every ``REPORT_INTERVAL``: a trainer publishes its first progress
        record only after its first local step (hivemind stores none without samples), and the record then takes a
        report interval, a store and a fetch to be seen. Two trainers that started together each saw only itself
        and stepped alone on two branches: in DiLoCo mode in tests/test_diloco_swarm.py (on CI, and in both swarms
        of one run here: for their first 1-5 rounds, 0.2 s apart; in one the aux peer then refused both trainers'
        states as worse than its snapshot of the branch that lost); in gradient mode in tests/test_trainer_swarm.py
        and tests/test_robust_swarm.py (CI: the target filled in 0.7 s, one peer then downloaded or kept a lower
        epoch label). tests/test_swarm_optimizer.py reproduces both. A peer that is leaving waits no more."""
        deadline = self._first_step + STARTUP_WINDOWS * self.matchmaking_window()
        waiting = False
        while self._trainers_in_swarm() <= 1:
            left = deadline - time.monotonic()
            if left <= 0 or self._leaving.is_set():
                return True
            if not waiting:
                waiting = True
                logger.info(f"No other trainer seen yet: waiting up to {left:.0f} s for one before stepping alone")
            self._leaving.wait(min(left, REPORT_INTERVAL))
        return False

    def _trainers_in_swarm(self) -> int:
        """Peers whose progress records show training (aux peers report no samples/s), except those this peer
        excluded (:meth:`distrust`; not merely the donors whose states it refused, honest peers among them): with no
        other trainer, the round cannot form, and this peer steps with its own pseudo-gradient instead of folding it
        forever. An excluded liar counted as a partner: in tests/test_lying_reducer.py, the last honest trainer left
        with it waited out 6 rounds' matchmaking (2.3 min) for a group that its own exclusion refused.

        The records are those the tracker's background fetches last read: this runs on the training thread as the
        epoch ends, and at 16 DiLoCo trainers on 2 cores (benchmarks/internet.py) a lookup took 11.5 s median, which
        every epoch end spent idle. Only if they show no other trainer does it look the records up (they may predate a
        trainer that just joined: in tests/test_diloco_swarm.py two trainers each stepped alone for 3 short epochs);
        the tracker then counts the records found (hivemind's epoch end averages only if its view shows a partner)."""
        count = len(list(trainer_records(self.tracker.last_records(), self._excluded)))
        if count <= 1:
            entry = self.dht.get(self.tracker.training_progress_key, latest=True)
            records = entry.value if entry is not None and isinstance(entry.value, dict) else {}
            count = len(list(trainer_records(records, self._excluded)))
            if count > 1:
                self.tracker.recount(records)
        return count

    def _trainers_seen(self) -> int:
        """How many trainers this peer sees in the swarm, itself included: the progress records the tracker last read
        that show training and have not expired, except those of peers it excluded. Gathered with each outer round
        (:mod:`..averaging.group_quorum`); no lookup of its own, as it runs on the training thread."""
        now = get_dht_time()
        return max(1, sum(1 for _, record, _ in trainer_records(self.tracker.last_records(), self._excluded)
                          if getattr(record, "expiration_time", 0.0) >= now))

    def _full_trainers(self) -> list[str]:
        """The peer IDs of the other trainers that accept connections (not in client mode), by the progress records
        the tracker last read, the furthest epoch first; not those this peer excluded, nor those whose records
        expired since (they may have left: asking one would wait out a timeout)."""
        now, own = get_dht_time(), str(self.dht.peer_id)
        trainers = [(value["epoch"], peer_id) for peer_id, record, value in trainer_records(
                        self.tracker.last_records(), self._excluded)
                    if peer_id not in (None, own) and value.get("client_mode") is False
                    and getattr(record, "expiration_time", 0.0) >= now and isinstance(value.get("epoch"), int)]
        return [peer_id for _, peer_id in sorted(trainers, reverse=True)]

    def load_state_from_peers(self, reason: str = "epoch", **kwargs: Any) -> None:
        """hivemind's download, ``reason`` (for the ``state_downloaded`` event) defaulting to hivemind's own:
        this peer's epoch fell behind the swarm's. :class:`.EarlyJoin` waits meanwhile (its lock), as during a step."""
        with self.waiting(), self._early_join.lock if self._early_join is not None else contextlib.nullcontext():
            if self._early_join is not None and self._early_join.take() is not None:
                self.grad_averager.notify_used_averaged_gradients()  # the round hivemind's download tags along in
            if self.outer_loop is not None:  # its rounds go on without it, and no downloader waits for them to settle
                self.outer_loop.forget_pending()
            adopted = self.state_averager.adopted_count
            super().load_state_from_peers(reason=reason, **kwargs)
            # the swarm's epoch counted again from the records last read, with this peer's new epoch and without the
            # donors refused meanwhile. Else hivemind's once-per-epoch check compares the new epoch with a view read
            # before the download: a newcomer whose donors stepped meanwhile downloaded the same state again
            # (tests/test_swarm_optimizer.py), and one that refused a liar's higher epoch went on seeing it
            self.tracker.recount()
            if self.outer_loop is None and not self.auxiliary:
                self._maybe_schedule_gradient_averaging()  # else its micro-batch may end after the round's group formed
            if self.outer_loop is not None:
                self.restart_from_anchor()
                self.steps_in_round = 0
                if self.state_averager.adopted_count != adopted:
                    self._downloaded = (self.state_averager.adopted_from, self.outer_loop.rounds)

    def _trusted_donors(self) -> list[str]:
        """The donors whose outer state this DiLoCo peer adopts without the loss check when its group holds theirs:
        the one it last downloaded from, if it has applied at most one round since. Why: a donor that takes an
        outer step while it serves (or just after) leaves the newcomer one step behind, and its first round names
        the donor's new state. Checked, that state is scored against the donor's own previous one, which this peer
        adopted a round ago: an outer step at lr 0.7 with momentum can raise a batch's loss by more than the check's
        margin, and in ``tests/test_diloco_swarm.py`` (CI) the newcomer refused its partner's state as 10.5% worse,
        skipped it for 10 minutes and never held its group's anchor. It trusts nothing new: the same donor's state,
        which this peer's first download trusted, one round on (``docs/security.md``)."""
        if self._downloaded is None or self.outer_loop is None:
            return []
        donor, rounds = self._downloaded
        return [donor] if donor in self.outer_loop.donors and self.outer_loop.rounds <= rounds + 1 else []

    def distrust(self, excluded: Mapping[str, float]) -> None:
        """Skip the states and ignore the progress of the peers this peer's averagers excluded (``excluded``: peer ID
        -> Unix time the exclusion ends, as :class:`~lean_transformer.swarm.peers.reporting.MetricsReporter` reads
        them from the ``peer_excluded`` events) until then. Seen in benchmarks/byzantine.py: three honest DiLoCo
        trainers excluded a lying reducer, whose rounds had meanwhile gone on alone to epoch 3, then found themselves
        out of sync and downloaded its state."""
        now, before = time.time(), self.state_averager.refused_donors()
        self._excluded = dict(excluded)
        for peer_id, until in excluded.items():
            if until > now:
                self.state_averager.refuse_donor(peer_id, until - now)
        if self.state_averager.refused_donors() - before:
            self.tracker.recount()

    def check_downloads(self, model: nn.Module, batch_loss: Callable[[], Callable[[], Union[torch.Tensor, float]]]
                        ) -> None:
        """Score every state this peer downloads on a local batch before adopting it (:mod:`.state_check`): the
        state's parameters against this peer's in gradient-averaging mode, its anchor against this peer's in DiLoCo
        mode. ``batch_loss``: draws a new local batch and returns the model's loss function on it."""
        check = StateCheck(model, self.state_averager.main_parameters, batch_loss)
        count = len(check.parameters)
        offset = 0 if self.outer_loop is None else count  # the anchor is the first of the extra tensors

        def start(within: Optional[float] = None) -> Callable[[Sequence[torch.Tensor]], Optional[str]]:
            check.begin(None if self.outer_loop is None else self.outer_loop.outer.anchor, within=within)
            return lambda tensors: check.problem(tensors[offset:offset + count])

        self.state_averager.download_check = start

    def restart_from_anchor(self) -> None:
        """In DiLoCo mode, after the outer state was replaced (downloaded from the swarm, or read from a checkpoint):
        drop the round in flight and restart the parameters, the offloaded optimizer's too, from the anchor (a
        serving peer's parameters are its own drift). Nothing to do in gradient-averaging mode."""
        if self.outer_loop is None:
            return
        self.outer_loop.forget_pending()
        self.outer_loop.outer.reset_parameters()
        if self.offload_optimizer:
            self.state_averager._apply_optimizer_parameters_()
        self._label_outer_state()

    def _label_outer_state(self) -> None:
        """DiLoCo: label this peer's entry in the DHT's list of donors with its outer state's fingerprint, so that a
        peer that downloads prefers the state most donors hold (``state_download.rank_donors``): after a round split
        into groups, the one the swarm's next votes most likely settle on."""
        if self.outer_loop is not None and not self.client_mode:
            self.state_averager.state_label = self.outer_loop.fingerprint()

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint holds besides the inner optimizer, the schedule and the epoch: in DiLoCo mode ``outer``,
        the anchor, the outer momentum and the outer step count."""
        return {} if self.outer_loop is None else dict(outer=self.outer_loop.outer.state_tensors())

    @torch.no_grad()
    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Load :meth:`checkpoint_state` from ``state`` and restart from its anchor (in DiLoCo mode; a checkpoint of
        gradient-averaging mode has none, then the anchor is its weights). Raises ValueError if it does not fit."""
        if self.outer_loop is None:
            return
        outer = self.outer_loop.outer
        outer.load_state_tensors(state.get("outer") or
                                 [param.detach().float() for param in outer.parameters] +
                                 [torch.zeros_like(momentum) for momentum in outer.momenta] +
                                 [torch.zeros_like(outer.steps)])
        self.restart_from_anchor()

    def _tag_along_with_zero_weight(self, control: StepControl) -> None:
        """hivemind's (serve the round with weight 0 and wait for it to end), with one line instead of hivemind's
        ERROR traceback when the round ends without averaging: it found no group, or this peer's leave cancelled it
        (:meth:`cancel_rounds_in_flight`). Either is expected of a round pre-scheduled for an epoch that this peer
        does not finish: every trainer leaves with one (CI: tests/test_large_swarm.py, tests/test_local_swarm.py)."""
        if not control.triggered:
            control.weight = 0
            control.allow_allreduce()
        if control.done():
            return
        try:
            control.result(self.averaging_timeout)
        except (CancelledError, Exception) as error:
            logger.info(f"The round this peer served with weight 0 ended without averaging: {error!r}")
            if not control.done():
                control.cancel()

    def cancel_rounds_in_flight(self) -> None:
        """Give up the averaging rounds this peer is waiting in (a peer that is leaving should not wait for a group
        that may never assemble); hivemind then goes on with local gradients."""
        self._stop_early_join()
        self._mark_leaving()
        for attribute in ("scheduled_grads", "scheduled_state"):
            control = getattr(self, attribute)
            if control is not None and not control.done():
                logger.info("Leaving: cancelling the averaging round in flight")
                control.cancel()
                setattr(self, attribute, None)  # else hivemind's shutdown cancels it again: InvalidStateError

    def _stop_early_join(self) -> None:
        if self._early_join is not None:
            self._early_join.stop()  # a round it joined stays for the training thread's next step to take

    def _mark_leaving(self) -> None:
        """Rounds cancelled from now on end as ``leaving``, not as missed (:mod:`.round_events`)."""
        self._leaving.set()
        averagers = [self.state_averager, getattr(self, "grad_averager", None),
                     self.outer_loop.averager.averager if self.outer_loop is not None else None]
        for averager in averagers:
            if averager is not None:
                averager.mark_leaving()

    def shutdown(self) -> None:
        """Also gives up the parameter rounds that have found no group
        (:class:`~lean_transformer.swarm.hivemind_fixes.averagers.LeavesUngrouped`): hivemind's
        shutdown waits for the one its delayed step holds, up to its timeouts."""
        self._stop_early_join()
        self._mark_leaving()
        if self.state_averager.leave():
            logger.info("Leaving: gave up the parameter-averaging round that had no group yet")
        if self.scheduled_state is not None and self.scheduled_state.done():
            self.scheduled_state = None  # else hivemind's shutdown cancels it again: InvalidStateError
        if self.outer_loop is not None:
            if self.host_grads is not None:
                self.host_grads.remove_hooks()
            if served := self.outer_loop.leave(grace=min(LEAVE_GRACE, self.averaging_timeout)):
                logger.info(f"Leaving: served {served} outer round(s) whose group had formed before stopping")
            self.outer_loop.averager.shutdown()
        super().shutdown()


def trainer_records(records: Mapping, excluded: Mapping[str, float]) -> Iterator[tuple[Optional[str], Any, dict]]:
    """(reporter's peer ID or None, record, its value) of each progress record that shows training (aux peers
    report no samples/s), except those of the peers in ``excluded`` (peer ID -> Unix time the exclusion ends)."""
    now = time.time()
    for record in records.values():
        value, peer_id = getattr(record, "value", None), record_reporter(record)
        speed = value.get("samples_per_second") if isinstance(value, dict) else None
        if isinstance(speed, (int, float)) and speed > 1e-9 and not excluded.get(peer_id, 0.0) > now:
            yield peer_id, record, value


def gradient_averager_class(gated: bool, host_gradients: bool) -> type[GradientAverager]:
    """The gradient averager: serving token holders only (``gated``), accumulating on the host (``host_gradients``).
    hivemind names an averager's RPCs after its class, so each combination is a class of its own."""
    if host_gradients:
        return HostGatedGradientAverager if gated else HostGradientAverager
    return GatedGradientAverager if gated else GradientAverager


def open_averaging_gate(dht: hivemind.DHT, network: NetworkSettings, private_key: RSAPrivateKey) -> AveragingGate:
    """Publish this peer's access token under its peer ID and return the gate for its averagers. ``private_key``
    must be the DHT's signature validator key, which owns the token's record (as with the metrics records)."""
    authority_public_key = load_public_key(network.authority_public_key_path, "authority public key file")
    owner = RSASignatureValidator(private_key).local_public_key
    publish_access_token(dht, network.run_id, network.auth_token_path, owner)
    return AveragingGate(dht, network.run_id, authority_public_key)


def averager_options(network: NetworkSettings, collaboration: CollaborationSettings) -> dict:
    """Options of hivemind's averagers.

    - Matchmaking requests must time out well within the matchmaking window: with hivemind's default (3 s) at or
      above a short --matchmaking_time, two peers that both wait for the other to answer can deadlock and miss every
      gradient-averaging round (seen on loopback with matchmaking_time=3).
    - A group member waits for the others' parts for one matchmaking window more than hivemind does (sender
      timeout: next_chunk_timeout + matchmaking_time, default twice the window; the reducer's, twice that, as
      hivemind's). A pre-scheduled group assembles before the epoch ends and each member starts its all-reduce when
      its own view of the swarm shows the end, after its current micro-batch; hivemind bans a member that has not
      started within next_chunk_timeout (default: the window) of this one. Measured, 8 trainers with a 2 s window
      on 2 cores (tests/test_large_swarm.py): members started up to ~3.4 s apart, and each run applied 9-22
      partial averages ("Averaging: received 46.5% results"), or the late member's round failed (BAD_GROUP_ID) and
      it stepped alone; none with 5 s. A member that died holds its group up by one window more."""
    window = collaboration.matchmaking_time
    sender_timeout = (collaboration.next_chunk_timeout or window) + window
    options: dict = dict(request_timeout=min(3.0, window / 2), sender_timeout=sender_timeout,
                         reducer_timeout=2 * sender_timeout)
    if network.bandwidth is not None:
        options["bandwidth"] = network.bandwidth
    return options
