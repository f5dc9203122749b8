"""The auxiliary peer: a long-lived member of the swarm that needs no GPU.

It records the swarm's progress (wandb, a JSONL file, a PNG plot and, with ``--dashboard_port``, a live web page)
and a table of the contributors, keeps checkpoints that outlive every volunteer
(model, tokenizer and training state; optionally mirrored to the Hugging Face Hub), evaluates each checkpoint on
held-out data (its validation loss is logged beside the training loss), can seed a new swarm from a checkpoint, and with
``--assist_in_averaging`` takes part in all-reduce without gradients of its own. Read top to bottom:
:func:`run_aux_peer` builds everything, :class:`AuxPeer` is the loop.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence

import hivemind
from transformers import PreTrainedModel

from lean_transformer.swarm.monitoring.aggregation import EpochCollector, SwarmStats
from lean_transformer.swarm.auth.revocation import RevocationWatcher
from lean_transformer.swarm.protocol.agreement import SwarmAgreement
from lean_transformer.swarm.storage.checkpoint_dir import CheckpointDir
from lean_transformer.swarm.monitoring.dashboard import Dashboard, state_json
from lean_transformer.swarm.monitoring.events import emit, peer_events
from lean_transformer.swarm.monitoring.peer_table import PeerTable, summary
from lean_transformer.swarm.protocol.dht import visible_maddrs
from lean_transformer.swarm.monitoring.evaluation import Evaluation, evaluate
from lean_transformer.swarm.storage.hub import HubUploader, resolve_checkpoint
from lean_transformer.swarm.protocol.metrics import fetch_metrics
from lean_transformer.swarm.averaging.optimizer import SwarmOptimizer
from lean_transformer.swarm.monitoring.plot import redraw_plot
from lean_transformer.swarm.monitoring.run_history import RunHistory
from lean_transformer.swarm.peers.shutdown import GracefulShutdown
from lean_transformer.swarm.peers.swarm_peer import SwarmPeer
from lean_transformer.swarm.storage.training_state import load_training_state, save_training_state

if TYPE_CHECKING:
    from lean_transformer.swarm.protocol.settings import (AuxSettings, Batch, CollaborationSettings, NetworkSettings,
                                                 TrainingSettings, TrainingTask)

logger = logging.getLogger(__name__)


class AuxiliaryOptimizer(SwarmOptimizer):
    """A swarm optimizer whose parameters are a snapshot of the swarm's state (downloaded from peers or read
    from a checkpoint) that its own steps never update.

    It shares the snapshot with newcomers only while the snapshot is current. hivemind advances an auxiliary peer's
    epoch together with the swarm; a download after that would pair old parameters with the new epoch, so sharing
    stops right before this peer's first epoch transition after a snapshot.
    """

    def _advance_epoch(self, grad_scaler: Optional[hivemind.GradScaler]) -> None:
        self.state_averager.allow_state_sharing = False
        super()._advance_epoch(grad_scaler)

    def share_snapshot(self) -> None:
        """Offer the current parameters to newcomers, ranked by their epoch (trainers that are further along win)."""
        if not self.client_mode:  # a client cannot serve downloads
            self.state_averager.state_sharing_priority = self.local_epoch
            self.state_averager.allow_state_sharing = True

    @contextlib.contextmanager
    def snapshot_from_peers(self) -> Iterator[Optional[int]]:
        """Download the newest state that a peer shares and yield its epoch (None if no peer sent one).

        Inside the block ``local_epoch`` is the downloaded state's epoch, so a checkpoint written there is labelled
        with the epoch of its parameters; afterwards this peer's epoch follows the swarm again. Unlike
        ``load_state_from_peers`` it never relabels a state with a newer epoch, and gives up after
        ``load_state_timeout`` instead of retrying forever.
        """
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self._tag_along_with_zero_weight(self.scheduled_grads)  # do not keep a pre-scheduled round waiting
            self.scheduled_grads = None
        averager = self.state_averager
        epoch_before, was_sharing = averager.local_epoch, averager.allow_state_sharing
        averager.allow_state_sharing = False  # the tensors are about to be replaced
        averager.local_epoch = -1  # accept a state of any epoch; stays -1 when nothing was loaded
        try:
            averager.load_state_from_peers(timeout=self.load_state_timeout, reason="checkpoint")
        except TimeoutError:
            logger.warning(f"Loading the swarm's state took longer than {self.load_state_timeout:g} s")
        loaded_epoch = averager.local_epoch if averager.local_epoch >= 0 else None
        if loaded_epoch is None:
            averager.local_epoch = epoch_before
            averager.allow_state_sharing = was_sharing
            yield None
            return
        self.restart_from_anchor()  # DiLoCo: the swarm's parameters are the anchor, not the serving peer's drift
        try:
            yield loaded_epoch
        finally:
            averager.local_epoch = max(epoch_before, loaded_epoch)
            if averager.local_epoch == loaded_epoch:
                self.share_snapshot()


class AuxPeer:
    """The loop: every refresh, aggregate the trainers' metrics and log them (with the table of contributors, written
    to the JSONL file whenever an epoch completes; the live page, if any, gets both); every N epochs, checkpoint (with
    the tokenizer, written by ``save_tokenizer``) and evaluate the checkpoint on ``validation_batches``."""

    def __init__(self, dht: hivemind.DHT, model: PreTrainedModel, optimizer: AuxiliaryOptimizer,
                 network: NetworkSettings, aux: AuxSettings, config: dict, shutdown: GracefulShutdown,
                 agreement: SwarmAgreement, save_tokenizer: Callable[[Path], None],
                 validation_batches: Sequence[Batch] = (), dashboard: Optional[Dashboard] = None,
                 revocations: Optional[RevocationWatcher] = None):
        self.dht, self.model, self.optimizer, self.agreement = dht, model, optimizer, agreement
        self.revocations = revocations
        self.save_tokenizer, self.validation_batches = save_tokenizer, validation_batches
        self.run_id, self.aux, self.shutdown = network.run_id, aux, shutdown
        self.history = RunHistory(aux.metrics_path, max_rows=aux.history_window)
        self.plot_path = Path(aux.metrics_path).with_suffix(".png")
        last_logged = self.history.last_epoch
        self.collector = EpochCollector(last_released_epoch=-1 if last_logged is None else last_logged)
        self.peers = PeerTable()
        if self.history.peers is not None:
            self.peers.restore(self.history.peers)
        self.dashboard = dashboard
        self.checkpoints = CheckpointDir(aux.checkpoint_dir, keep_last=aux.keep_checkpoints)
        latest = self.checkpoints.latest()
        self.last_checkpoint_epoch = max(optimizer.local_epoch, latest[0] if latest else 0)
        self.hub = HubUploader(aux.hub_repo_id, aux.hub_upload_interval, public=aux.hub_public,
                               include_training_state=aux.upload_training_state) if aux.hub_repo_id else None
        self.wandb = None
        if aux.wandb_project:
            from lean_transformer.swarm.monitoring.wandb_log import WandbLogger

            self.wandb = WandbLogger(aux.wandb_project, run_name=f"{self.run_id}-aux", config=config,
                                     directory=aux.wandb_dir)
        self.lock = threading.Lock()  # one user of the optimizer at a time: the assist thread or a checkpoint

    def run(self) -> None:
        assistant = None
        if self.aux.assist_in_averaging:
            assistant = threading.Thread(target=self._assist, name="assist-averaging", daemon=True)
            assistant.start()
        try:
            while not self.shutdown.requested.is_set():
                self.agreement.raise_if_mismatched()
                if self.revocations is not None:
                    self.revocations.raise_if_revoked()
                self.refresh()
                self.shutdown.requested.wait(self.aux.refresh_period)
        finally:
            if assistant is not None:
                assistant.join(self.optimizer.averaging_timeout)
            if self.wandb is not None:
                self.wandb.finish()
            if self.hub is not None:
                self.hub.wait(timeout=self.shutdown.timeout / 2)

    def refresh(self) -> None:
        records = fetch_metrics(self.dht, self.run_id)
        now = time.time()
        completed = self.collector.update(records, now=now)
        self.peers.update(records, now=now)
        for stats in completed:
            emit("swarm_epoch", epoch=stats.epoch, loss=stats.loss, samples=stats.samples_in_epoch,
                 samples_per_second=stats.samples_per_second, alive_peers=stats.alive_peers)
            self.history.append(stats)
            if self.wandb is not None:
                self.wandb.log(stats)
        if completed:
            self.history.append(self.peers.snapshot(now))
            self.redraw_plot()

        swarm_epoch = max([self.optimizer.tracker.global_epoch, *(record.epoch for record in records.values())])
        logger.info(status_line(swarm_epoch, len(records), self.history.rows[-1] if self.history.rows else None,
                                self.history.evaluations[-1] if self.history.evaluations else None)
                    + f" | {summary(self.peers.rows())}")
        self.publish(swarm_epoch, now)
        every = self.aux.checkpoint_every_epochs
        if every and swarm_epoch // every > self.last_checkpoint_epoch // every:
            self.checkpoint()

    def checkpoint(self) -> None:
        """Download the swarm's state, write it as a checkpoint, evaluate it (then maybe upload it)."""
        with self.lock, self.optimizer.snapshot_from_peers() as epoch:
            if epoch is None or epoch <= self.last_checkpoint_epoch:
                logger.warning(f"No peer shared a state newer than epoch {self.last_checkpoint_epoch}; will try to "
                               f"checkpoint again at the next refresh")
                return
            logger.info(f"Writing the checkpoint of epoch {epoch}")
            try:
                path = self.checkpoints.save(epoch, self._write_checkpoint)
            except OSError as error:  # e.g. a full disk: the previous checkpoints are intact, keep the peer up
                logger.error(f"Could not write the checkpoint of epoch {epoch}: {error}")
                return
            # the model holds the checkpoint's parameters until the snapshot block ends
            validation_loss = evaluate(self.model, self.validation_batches) if self.validation_batches else None
        self.last_checkpoint_epoch = epoch
        logger.info(f"Saved the swarm's state at epoch {epoch} to {path}")
        emit("checkpoint", epoch=epoch, path=str(path))
        if validation_loss is not None:
            self.log_evaluation(Evaluation(epoch, validation_loss, time.time()))
        if self.hub is not None:
            self.hub.maybe_upload(path, epoch)

    def _write_checkpoint(self, directory: Path) -> None:
        save_training_state(directory, self.model, self.optimizer)
        self.save_tokenizer(directory)

    def log_evaluation(self, evaluation: Evaluation) -> None:
        if not math.isfinite(evaluation.validation_loss):
            logger.warning(f"The checkpoint of epoch {evaluation.epoch} has a non-finite validation loss "
                           f"({evaluation.validation_loss}); not logged")
            return
        logger.info(f"Validation loss of the epoch {evaluation.epoch} checkpoint: {evaluation.validation_loss:.4f} "
                    f"({len(self.validation_batches)} held-out batches)")
        emit("evaluation", epoch=evaluation.epoch, validation_loss=evaluation.validation_loss)
        self.history.append(evaluation)
        if self.wandb is not None:
            self.wandb.log(evaluation)
        self.redraw_plot()

    def publish(self, swarm_epoch: int, now: float) -> None:
        if self.dashboard is not None:
            self.dashboard.publish(state_json(self.run_id, swarm_epoch, self.history.rows, self.history.evaluations,
                                              self.peers.rows(), now))

    def redraw_plot(self) -> None:
        redraw_plot(self.history.rows, self.plot_path, title=self.run_id, evaluations=self.history.evaluations)

    def _assist(self) -> None:
        """Join every averaging round without gradients of our own (hivemind's auxiliary mode)."""
        while not self.shutdown.requested.is_set():
            with self.lock:
                try:
                    self.optimizer.step()
                except Exception as error:  # one failed round must not end the assistance
                    logger.warning(f"Assisting in averaging failed: {type(error).__name__}: {error}")
            self.shutdown.requested.wait(self.aux.assist_refresh_period)


def status_line(swarm_epoch: int, alive_peers: int, last: Optional[SwarmStats],
                last_evaluation: Optional[Evaluation] = None) -> str:
    line = f"swarm epoch {swarm_epoch} | {alive_peers} peer{'s' if alive_peers != 1 else ''} reporting"
    if last is not None:
        loss = f"{last.loss:.4f}" if math.isfinite(last.loss) else "n/a"
        line += (f" | epoch {last.epoch}: loss {loss}, {last.samples_per_second:.1f} samples/s, "
                 f"{last.samples_in_epoch} samples, {last.alive_peers} peers")
    if last_evaluation is not None:
        line += f" | validation loss {last_evaluation.validation_loss:.4f} (epoch {last_evaluation.epoch})"
    return line


@contextlib.contextmanager
def open_dashboard(aux: AuxSettings, run_id: str) -> Iterator[Optional[Dashboard]]:
    """The live page while the block runs, with ``--dashboard_port`` (else None)."""
    if aux.dashboard_port is None:
        yield None
        return
    try:
        dashboard = Dashboard(aux.dashboard_host, aux.dashboard_port, title=run_id)
    except OSError as error:
        raise OSError(f"--dashboard_port: cannot listen on {aux.dashboard_host}:{aux.dashboard_port} "
                      f"({error})") from None
    with dashboard:
        logger.info(f"The live page of the run: {dashboard.url}")
        yield dashboard


def run_aux_peer(task: TrainingTask, network: NetworkSettings, collaboration: CollaborationSettings,
                 training: TrainingSettings, aux: AuxSettings, swarm_settings: Mapping[str, Any],
                 run_config: Optional[dict] = None) -> None:
    """Run an aux peer for a swarm training ``task`` until Ctrl+C / SIGTERM. ``swarm_settings`` must agree with the
    trainers' (see :func:`lean_transformer.swarm.peers.trainer.train`); ``run_config`` is logged with the metrics (wandb).
    Bad input raises ValueError / FileNotFoundError (naming the flag) or SwarmConnectionError before the peer
    joins. Its events go to ``training.events_path`` (default: events.jsonl beside ``aux.metrics_path``)."""
    events_path = training.events_path or Path(aux.metrics_path).with_name("events.jsonl")
    with peer_events(events_path, "aux") as ending:
        ending.update(_run_aux_peer(task, network, collaboration, training, aux, swarm_settings, run_config))


def _run_aux_peer(task: TrainingTask, network: NetworkSettings, collaboration: CollaborationSettings,
                  training: TrainingSettings, aux: AuxSettings, swarm_settings: Mapping[str, Any],
                  run_config: Optional[dict]) -> dict:
    """:func:`run_aux_peer`; returns the ``shutdown`` event's reason and epoch."""
    shutdown = GracefulShutdown(training.shutdown_timeout)
    if aux.assist_in_averaging and network.client_mode:
        raise ValueError("--assist_in_averaging: averaging through this peer needs incoming connections; "
                         "drop --client_mode")
    checkpoint = None
    if training.resume_from is not None:
        checkpoint = resolve_checkpoint(training.resume_from, Path(aux.checkpoint_dir) / "downloaded")
    evaluates = aux.eval_batches > 0 and aux.checkpoint_every_epochs > 0
    validation_batches = task.validation_batches(aux.eval_batches) if evaluates else []

    # the page's port is taken before joining: a port in use fails at once, and the page stops after the peer
    with open_dashboard(aux, network.run_id) as dashboard, SwarmPeer(network, swarm_settings) as peer:
        model = task.build_model()
        optimizer = peer.start_optimizer(AuxiliaryOptimizer, model, task, collaboration, training,
                                         auxiliary=not network.client_mode)
        optimizer.tracker.status_loglevel = logging.DEBUG  # its progress lines would repeat every half second
        if validation_batches:  # a state scoring worse than the last snapshot on a held-out batch is not saved
            optimizer.check_downloads(model, lambda: functools.partial(evaluate, model, validation_batches[:1]))
        if checkpoint is not None:
            epoch = load_training_state(checkpoint, model, optimizer)
            optimizer.share_snapshot()
            logger.info(f"Seeding the swarm with {checkpoint} (epoch {epoch}): trainers that join continue from it")
        peer.print_initial_peers()  # printed once ready, so trainers started on this line find the state
        emit("joined", epoch=optimizer.local_epoch, client_mode=network.client_mode,
             initial_peers=[] if network.client_mode else visible_maddrs(peer.dht), from_swarm=False)
        AuxPeer(peer.dht, model, optimizer, network, aux, run_config or {}, shutdown, peer.agreement,
                save_tokenizer=lambda directory: task.save_tokenizer(str(directory)),
                validation_batches=validation_batches, dashboard=dashboard, revocations=peer.revocations).run()
    logger.info("Shut down cleanly")
    return dict(reason="signal", epoch=optimizer.local_epoch)
