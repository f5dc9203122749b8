"""The trainer peer: join the swarm, then an explicit training loop, read top to bottom.

Each iteration computes ``gradient_accumulation_steps`` micro-batches locally (with AMP if asked) and hands their
gradients to ``hivemind.Optimizer.step``, which accumulates them with the swarm's toward ``target_batch_size``; once
the swarm has enough, the peers average gradients and step LAMB together, and the epoch advances. With
``--local_steps`` (DiLoCo, :mod:`lean_transformer.swarm.averaging.diloco`) each ``step`` is a local LAMB step instead, and an
epoch is an outer round. At every new epoch the peer publishes its metrics, checks its parameters (restoring a local
backup if they turned non-finite) and backs up when it is time.
"""
from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping, Optional

import hivemind
import torch
from transformers import PreTrainedModel

from lean_transformer.optim.loss_scale import DynamicLossScale
from lean_transformer.swarm.auth.revocation import RevocationWatcher
from lean_transformer.swarm.protocol.agreement import SwarmAgreement
from lean_transformer.swarm.peers.backups import LocalBackups
from lean_transformer.swarm.averaging.block_scaling import SwarmBlockScaling
from lean_transformer.swarm.monitoring.events import EventReader, emit, peer_events
from lean_transformer.swarm.protocol.dht import derive_peer_seed, visible_maddrs
from lean_transformer.swarm.averaging.host_grad_averager import check_host_gradient_options
from lean_transformer.swarm.storage.hub import resolve_checkpoint
from lean_transformer.swarm.protocol.metrics import MetricsPublisher
from lean_transformer.swarm.averaging.optimizer import SwarmOptimizer
from lean_transformer.swarm.peers.progress import ProgressLine
from lean_transformer.swarm.peers.reporting import MetricsReporter
from lean_transformer.swarm.peers.shutdown import GracefulShutdown
from lean_transformer.swarm.peers.swarm_peer import SwarmPeer
from lean_transformer.swarm.storage.training_state import load_training_state

if TYPE_CHECKING:
    from lean_transformer.swarm.protocol.settings import (CollaborationSettings, NetworkSettings, TrainingSettings,
                                                 TrainingTask)

logger = logging.getLogger(__name__)

# this many local steps in a row with non-finite loss or gradients mean the parameters are broken even if finite
MAX_NON_FINITE_STEPS_IN_A_ROW = 20


@dataclass
class EpochWork:
    """This peer's contribution to the current epoch; becomes its metrics record when the epoch ends."""

    loss_sum: float = 0.0
    mini_steps: int = 0
    samples: int = 0
    skipped: int = 0
    skipped_blocks: int = 0  # --block_grad_scaling: blocks dropped from local steps for overflowing

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.mini_steps if self.mini_steps else math.nan


def train(task: TrainingTask, network: NetworkSettings, collaboration: CollaborationSettings,
          training: TrainingSettings, swarm_settings: Mapping[str, Any]) -> None:
    """Run a trainer peer on ``task`` until ``training.stop_epoch`` or Ctrl+C / SIGTERM, writing its events to
    ``training.events_path`` (default: events.jsonl in ``training.output_dir``).

    Bad input raises ValueError / FileNotFoundError (naming the flag) or SwarmConnectionError before any training;
    ``swarm_settings`` (what all peers of the run must agree on, named by flag) that differ from an older peer's
    raise SettingsMismatchError, at start or within a minute of training.
    """
    events_path = Path(training.events_path or Path(training.output_dir) / "events.jsonl")
    with peer_events(events_path, "trainer") as ending:
        ending.update(_train(task, network, collaboration, training, swarm_settings, events_path))


def _train(task: TrainingTask, network: NetworkSettings, collaboration: CollaborationSettings,
           training: TrainingSettings, swarm_settings: Mapping[str, Any], events_path: Path) -> dict:
    """:func:`train`; returns the ``shutdown`` event's reason and epoch."""
    shutdown = GracefulShutdown(training.shutdown_timeout)
    device = torch.device(training.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cpu" and not collaboration.offload_optimizer:
        raise ValueError("--offload_optimizer: 8-bit LAMB runs on the CPU, so training on a GPU needs it")
    host_gradients = offload_gradients(training, device)
    dtype = model_dtype(training, device, host_gradients)
    if training.block_grad_scaling:
        check_block_grad_scaling(training, dtype, host_gradients)
    if collaboration.local_steps > 0 and training.fp16 and not host_gradients:
        raise ValueError("--local_steps: --fp16 in DiLoCo mode needs --offload_gradients true (the loss scale is "
                         "unscaled on the host; neither hivemind's GradScaler nor --block_grad_scaling is built for "
                         "local steps)")
    if host_gradients:
        try:
            check_host_gradient_options(collaboration.offload_optimizer, collaboration.delay_optimizer_step,
                                        collaboration.delay_grad_averaging)
        except ValueError as e:
            raise ValueError(f"--offload_gradients: needs --offload_optimizer and neither --delay_optimizer_step nor "
                             f"--delay_grad_averaging ({e})") from None
    if training.device_accumulation > 1 and not host_gradients:
        raise ValueError(f"--device_accumulation: sums host gradients on the device, and this trainer has none "
                         f"(--offload_gradients {training.offload_gradients} on {device.type})")
    if dtype != torch.float32 and not host_gradients:
        raise ValueError(f"--model_dtype: {training.model_dtype} weights need --offload_gradients true (float32 "
                         f"host gradients for the float32 master weights)")
    checkpoint = None
    if training.resume_from is not None:
        checkpoint = resolve_checkpoint(training.resume_from, Path(training.output_dir) / "downloaded")

    with SwarmPeer(network, swarm_settings) as peer:
        peer.print_initial_peers()
        model = task.build_model().to(device, dtype)  # hivemind keeps float32 master weights on the host
        model.set_optimizations(gradient_checkpointing=training.checkpointing_option(),
                                checkpoint_attention_core=training.checkpoint_attention_core,
                                backward_chunks=training.backward_chunks, ffn_custom_grad=training.ffn_custom_grad,
                                preserve_rng_state=training.preserve_rng_state)
        block_scaling = make_block_scaling(model) if training.block_grad_scaling else None
        progress = ProgressLine(training.progress_every, device)
        optimizer = peer.start_optimizer(SwarmOptimizer, model, task, collaboration, training,
                                         host_gradients=host_gradients, waiting=progress.waiting)
        shutdown.on_overdue = optimizer.cancel_rounds_in_flight
        optimizer.check_downloads(model, local_batch_loss(task, model, optimizer, device, training,
                                                          derive_peer_seed(peer.dht.peer_id, training.seed + 1)))
        join_swarm(model, optimizer, checkpoint, peer.dht, network.client_mode, events_path)
        finished = training_loop(task, model, optimizer, peer.dht, peer.metrics, shutdown, device, network,
                                 collaboration, training, peer.agreement, progress, block_scaling, events_path,
                                 peer.revocations)
    logger.info("Shut down cleanly")
    return dict(reason="finished" if finished else "signal", epoch=optimizer.local_epoch)


def join_swarm(model: PreTrainedModel, optimizer: SwarmOptimizer, checkpoint: Optional[Path], dht: hivemind.DHT,
               client_mode: bool, events_path: Path) -> None:
    """Load the local checkpoint (if any), then the swarm's state; hivemind refuses a state older than ours, so the
    newer of the two wins."""
    if checkpoint is not None:
        epoch = load_training_state(checkpoint, model, optimizer)
        logger.info(f"Loaded local checkpoint {checkpoint} (epoch {epoch})")
    downloads = EventReader(events_path)
    list(downloads.new())  # skip what earlier runs wrote; the averager's process reports the download
    optimizer.load_state_from_peers(reason="join")
    logger.info(f"Joined the swarm at epoch {optimizer.local_epoch}")
    emit("joined", epoch=optimizer.local_epoch, client_mode=client_mode,
         initial_peers=[] if client_mode else visible_maddrs(dht), from_swarm=any(downloads.new("state_downloaded")))


def training_loop(task: TrainingTask, model: PreTrainedModel, optimizer: SwarmOptimizer, dht: hivemind.DHT,
                  metrics_publisher: MetricsPublisher, shutdown: GracefulShutdown, device: torch.device,
                  network: NetworkSettings, collaboration: CollaborationSettings, training: TrainingSettings,
                  agreement: SwarmAgreement, progress: ProgressLine, block_scaling: Optional[SwarmBlockScaling] = None,
                  events_path: Optional[Path] = None, revocations: Optional[RevocationWatcher] = None) -> bool:
    """Train until ``training.stop_epoch`` (returns True) or a stop request (returns False). ``events_path``: this
    peer's event stream, where its averagers report their rounds (counted in its metrics records). ``revocations``
    (authorized swarms): raises IdentityRevokedError once the authority revoked this peer."""
    batches = task.batches(seed=derive_peer_seed(dht.peer_id, training.seed))
    autocast = mixed_precision(training, device)
    # host gradients (see offload_gradients) are unscaled on the host, hivemind's GradScaler only unscales .grad
    host_grads = optimizer.host_grads
    float16 = training.fp16 or next(model.parameters()).dtype == torch.float16
    loss_scale = DynamicLossScale() if float16 and host_grads is not None else None
    global_scale = training.fp16 and host_grads is None and block_scaling is None
    scaler = hivemind.GradScaler(device.type) if global_scale else None
    reuse_grad_buffers = optimizer.grad_averager is not None and optimizer.grad_averager.reuse_grad_buffers
    accumulation, batch_size = training.gradient_accumulation_steps, training.per_device_batch_size
    backups = LocalBackups(Path(training.output_dir) / "backups", training.backup_every_epochs, training.keep_backups,
                           save_tokenizer=lambda directory: task.save_tokenizer(str(directory)))
    progress.start_clock()  # the optimizer's outer rounds and state downloads wait in progress.waiting()
    work, epoch, non_finite_in_a_row = EpochWork(), optimizer.local_epoch, 0
    last_epoch_loss = math.nan  # shown until the current epoch has a loss of its own
    warned_short_epochs = False
    reporter = MetricsReporter(str(dht.peer_id), network.client_mode, events_path)
    # the aux peer waits for this trainer from now on
    metrics_publisher.publish(reporter.joined(optimizer.local_epoch), collaboration.metrics_expiration)
    model.train()

    while not shutdown.requested.is_set() and optimizer.local_epoch < training.stop_epoch:
        agreement.raise_if_mismatched()
        if revocations is not None:
            revocations.raise_if_revoked()
        # forward and backward over the micro-batches of one local step
        sequence_length = task.sequence_length(optimizer.local_epoch)
        losses = []
        if block_scaling is not None:
            block_scaling.before_backward()
        for _ in range(accumulation):
            batch = {key: value.to(device) for key, value in batches.next_batch(batch_size, sequence_length).items()}
            progress.count_tokens(batch["input_ids"].numel(), samples=batch_size)
            with progress.computing():
                with autocast:  # the loss a chunk of tokens at a time: the full logits never exist
                    loss = model(**batch, return_logits=False).loss
                scaled_loss = loss / accumulation
                if loss_scale is not None:
                    host_grads.grad_scale = 1.0 / loss_scale.scale
                    scaled_loss = scaled_loss * loss_scale.scale
                if block_scaling is not None:
                    scaled_loss = block_scaling.scale_loss(scaled_loss)
                (scaler.scale(scaled_loss) if scaler is not None else scaled_loss).backward()
                losses.append(loss.item())

        # a non-finite micro-batch must not reach the swarm: drop it (and the accumulation it poisoned). With fp16, a
        # finite loss whose scaled gradients overflow is loss scaling at work: hivemind's GradScaler skips that step
        finite_loss = all(map(math.isfinite, losses))
        if block_scaling is not None:  # overflowed blocks are zeroed in .grad: the step goes on without them
            outcome = block_scaling.after_backward()
            finite, usable = finite_loss and outcome.finite, finite_loss and outcome.others_finite
            work.skipped_blocks += outcome.overflowed_blocks if usable else 0
        else:
            finite = finite_loss and gradients_are_finite(model) and (host_grads is None or not host_grads.non_finite())
            usable = finite_loss and (finite or scaler is not None)
        if loss_scale is not None:
            loss_scale.update(overflow=finite_loss and not finite)
        non_finite_in_a_row = 0 if finite else non_finite_in_a_row + 1
        if non_finite_in_a_row == MAX_NON_FINITE_STEPS_IN_A_ROW:  # diverged, on every path (fp16 included)
            discard_local_gradients(optimizer, reuse_grad_buffers)
            backups.restore(model, optimizer, reason=f"{non_finite_in_a_row} local steps in a row had non-finite "
                                                     f"loss or gradients")
            non_finite_in_a_row, epoch = 0, optimizer.local_epoch
            continue
        if not usable:
            discard_local_gradients(optimizer, reuse_grad_buffers)
            work.skipped += accumulation
            logger.warning(f"Skipped {accumulation} micro-batch(es) with non-finite loss or gradients (not counted)")
            continue

        # report the samples to the swarm; this averages and steps when the swarm has reached the target batch. In
        # DiLoCo mode it is a local inner step (compute), the outer round inside it is not (the optimizer waits in
        # progress.waiting())
        with progress.computing() if collaboration.local_steps else nullcontext():
            optimizer.step(batch_size=batch_size * accumulation, grad_scaler=scaler)  # fp16 overflow: hivemind drops it
        if scaler is not None:
            scaler.update()
        if not reuse_grad_buffers:
            optimizer.zero_grad()
        if finite or block_scaling is not None:  # a block's overflow drops that block, not the step
            work.loss_sum += sum(losses)
            progress.count_losses(losses)
            work.mini_steps += accumulation
            work.samples += batch_size * accumulation
        else:
            work.skipped += accumulation

        if optimizer.local_epoch != epoch:
            logger.info(f"Reached epoch {optimizer.local_epoch}: mean loss {work.mean_loss:.4f} over "
                        f"{work.mini_steps} mini-steps ({work.samples} samples, {work.skipped} skipped)"
                        + (f"; {work.skipped_blocks} block overflow(s), block scales "
                           f"{format_scales(block_scaling.scales)}" if block_scaling is not None else ""))
            end, optimizer.last_epoch_end = optimizer.last_epoch_end, None
            emit("epoch", epoch=optimizer.local_epoch, loss=work.mean_loss, samples=work.samples,
                 mini_steps=work.mini_steps, skipped=work.skipped, compute_seconds=progress.compute_seconds,
                 wall_seconds=progress.wall_seconds(), ended_by=end and end.reason,
                 swarm_samples=end and end.samples)
            metrics = reporter.record(optimizer.local_epoch,
                                      float(optimizer.tracker.performance_ema.samples_per_second),
                                      samples=work.samples, loss_sum=work.loss_sum, mini_steps=work.mini_steps)
            metrics_publisher.publish(metrics, collaboration.metrics_expiration)
            optimizer.distrust(reporter.excluded)
            advice = None if collaboration.local_steps else short_epoch_warning(  # DiLoCo rounds are long by design
                collaboration.target_batch_size, collaboration.matchmaking_time, metrics.samples_per_second,
                optimizer.tracker.global_progress.num_peers)
            if advice is not None and not warned_short_epochs and optimizer.local_epoch >= 5:  # rates have settled
                logger.warning(advice)
                warned_short_epochs = True
            backups.on_new_epoch(model, optimizer)
            work, epoch, last_epoch_loss = EpochWork(), optimizer.local_epoch, work.mean_loss
        progress.maybe_report(optimizer, work.mean_loss if work.mini_steps else last_epoch_loss)

    logger.info(progress.summary())
    finished = not shutdown.requested.is_set()
    logger.info(f"Stopping at epoch {optimizer.local_epoch} "
                f"({f'reached epoch {training.stop_epoch}' if finished else 'stop requested'})")
    with shutdown.critical("final backup"):
        backups.save(model, optimizer, wait_for_averaging=finished)  # the final state includes the last averaging
    return finished


def mixed_precision(training: TrainingSettings, device: torch.device) -> ContextManager:
    """The autocast of ``--fp16`` / ``--bf16`` (none without them)."""
    if not (training.fp16 or training.bf16):
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.float16 if training.fp16 else torch.bfloat16)


def local_batch_loss(task: TrainingTask, model: PreTrainedModel, optimizer: SwarmOptimizer, device: torch.device,
                     training: TrainingSettings, seed: int) -> Callable[[], Callable[[], torch.Tensor]]:
    """What a downloaded state is scored with (:meth:`SwarmOptimizer.check_downloads`): each call draws a new
    micro-batch of this peer's data and returns the model's loss function on it. The batches come from a stream of
    their own (``seed``), so the training stream is the same with and without downloads."""
    batches = None

    def draw() -> Callable[[], torch.Tensor]:
        nonlocal batches
        if batches is None:
            batches = task.batches(seed=seed)
        batch = batches.next_batch(training.per_device_batch_size, task.sequence_length(optimizer.local_epoch))
        batch = {key: value.to(device) for key, value in batch.items()}

        def loss() -> torch.Tensor:
            with mixed_precision(training, device):
                return model(**batch, return_logits=False).loss

        return loss

    return draw


def short_epoch_warning(target_batch_size: int, matchmaking_time: float, samples_per_second: float,
                        num_peers: int) -> Optional[str]:
    """A line of advice if the swarm fills its target batch in much less time than a matchmaking window.

    Then a peer that is slower, or busy catching up, misses the round: the others step alone and move on, it finds
    itself out of sync, reloads the state, and misses the next round again, so the swarm degenerates into one peer
    training alone (seen with --target_batch_size 64 --matchmaking_time 1 on loopback)."""
    swarm_rate = samples_per_second * max(1, num_peers)
    if swarm_rate <= 0 or target_batch_size / swarm_rate >= matchmaking_time / 2:
        return None
    enough = math.ceil(swarm_rate * matchmaking_time / 64) * 64
    return (f"--target_batch_size {target_batch_size} is filled in ~{target_batch_size / swarm_rate:.2f} s by this "
            f"swarm ({num_peers} peer(s), ~{swarm_rate:.0f} samples/s), much less than --matchmaking_time "
            f"{matchmaking_time:g} s: slower peers fall out of sync and stop averaging; use --target_batch_size "
            f"{enough} or more (or a shorter --matchmaking_time)")


def model_dtype(training: TrainingSettings, device: torch.device, host_gradients: bool) -> torch.dtype:
    """``--model_dtype``: auto is bfloat16 on a GPU that supports it when gradients go to the host (the float32 master
    weights need float32 gradients), else float32: ``--offload_gradients false`` alone keeps a GPU trainer valid."""
    if training.model_dtype == "auto":
        bf16_gpu = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16_gpu and host_gradients else torch.float32
    return getattr(torch, training.model_dtype)


def offload_gradients(training: TrainingSettings, device: torch.device) -> bool:
    """``--offload_gradients``: auto is on for a GPU (gradients leave it during backward), off on the CPU and with
    --block_grad_scaling."""
    if training.offload_gradients == "auto":
        return device.type == "cuda" and not training.block_grad_scaling
    return training.offload_gradients == "true"


def check_block_grad_scaling(training: TrainingSettings, dtype: torch.dtype, host_gradients: bool) -> None:
    """``--block_grad_scaling`` scales the .grad buffers of float32 weights under float16 autocast."""
    if not training.fp16:
        raise ValueError("--block_grad_scaling: needs --fp16 (it replaces the float16 loss scale)")
    if host_gradients:
        raise ValueError("--block_grad_scaling: not available with --offload_gradients true (host gradients are "
                         "unscaled with one scale as they leave the device); pass --offload_gradients false")
    if dtype != torch.float32:
        raise ValueError(f"--block_grad_scaling: needs float32 weights on the device (--model_dtype float32), got "
                         f"--model_dtype {training.model_dtype}")


def make_block_scaling(model: PreTrainedModel) -> SwarmBlockScaling:
    try:
        block_scaling = SwarmBlockScaling.for_lean_model(model)
    except ValueError as e:
        raise ValueError(f"--block_grad_scaling: {e}") from None
    if not model.config.fp32_residual:
        logger.warning("--block_grad_scaling: the model's residual stream is float16 under autocast "
                       "(fp32_residual=false), so the unscaled gradients between blocks may underflow; "
                       "fp32_residual=true in the model config keeps them in float32")
    return block_scaling


def format_scales(scales: list[float]) -> str:
    """The range of the block scales as powers of two, e.g. 2^13..2^16."""
    low, high = math.log2(min(scales)), math.log2(max(scales))
    return f"2^{low:g}" if low == high else f"2^{low:g}..2^{high:g}"


def gradients_are_finite(model: torch.nn.Module) -> bool:
    """Whether every ``.grad`` is finite: one pass per gradient without a temporary of its size (the extremes carry a
    NaN or an inf) and one device sync in all. ``isfinite(grad).all()`` per gradient took a quarter of a CPU
    trainer's local step (25M parameters, one thread: 123 ms against 14 ms)."""
    extremes = [torch.stack(torch.aminmax(param.grad)) for param in model.parameters()
                if param.grad is not None and param.grad.numel()]
    return not extremes or bool(torch.isfinite(torch.cat(extremes)).all())


def discard_local_gradients(optimizer: SwarmOptimizer, reuse_grad_buffers: bool) -> None:
    """Forget the gradients of the current local step. When the .grad buffers are hivemind's accumulators, they also
    hold this epoch's earlier steps, which are lost too (and withdrawn from the swarm's count)."""
    if reuse_grad_buffers:
        optimizer.grad_averager.reset_accumulated_grads_()
        optimizer.tracker.report_local_progress(optimizer.local_epoch, samples_accumulated=0)
    else:
        optimizer.zero_grad()
        if optimizer.host_grads is not None:  # DiLoCo's host gradients: the next ones overwrite
            optimizer.host_grads.reset()

