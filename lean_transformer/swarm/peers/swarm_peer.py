"""What every peer role does to join the swarm and to leave it, in one place: the trainer and the aux peer differ in
what they do in between."""
from __future__ import annotations

import logging
from types import TracebackType
from typing import TYPE_CHECKING, Any, Mapping, Optional, TypeVar

from torch import nn

from lean_transformer.swarm.auth.keys import load_public_key
from lean_transformer.swarm.auth.revocation import RevocationWatcher
from lean_transformer.swarm.monitoring.events import set_peer
from lean_transformer.swarm.protocol.agreement import SwarmAgreement
from lean_transformer.swarm.protocol.dht import build_dht, initial_peers_line, peer_private_key
from lean_transformer.swarm.protocol.metrics import MetricsPublisher, make_validators

if TYPE_CHECKING:
    from lean_transformer.swarm.averaging.optimizer import SwarmOptimizer
    from lean_transformer.swarm.protocol.settings import (CollaborationSettings, NetworkSettings, TrainingSettings,
                                                          TrainingTask)

    Optimizer = TypeVar("Optimizer", bound=SwarmOptimizer)

logger = logging.getLogger(__name__)

# How long a leaving peer waits for the store of its last metrics record, after its averagers left (the store had
# their shutdown's seconds already), within the graceful shutdown's default budget of 25 s
LAST_RECORD_TIMEOUT = 5.0


class SwarmPeer:
    """A peer's membership in the swarm, as a context manager.

    On entry: the peer's identity key (``private_key``, which also signs its DHT records: ``public_key`` is their
    owner), the DHT with the run's record validators (``dht``), the agreement on ``swarm_settings`` with the peers
    already there (``agreement``; a mismatch raises SettingsMismatchError) and, in an authorized swarm, the watcher of
    the authority's revocation list (``revocations``, else None; a revoked identity raises IdentityRevokedError), and
    the publisher of its metrics records (``metrics``). On exit, after an error too: the optimizer of
    :meth:`start_optimizer` leaves first (its averagers say goodbye through the DHT), then the last metrics record is
    given up to ``LAST_RECORD_TIMEOUT`` to be stored, the agreement and the watcher stop and the DHT shuts down, also if
    the optimizer's shutdown failed.
    A peer that was asked to stop is held to its time budget by
    :class:`~lean_transformer.swarm.peers.shutdown.GracefulShutdown` meanwhile.
    """

    def __init__(self, network: NetworkSettings, swarm_settings: Mapping[str, Any]):
        self.network, self.swarm_settings = network, swarm_settings
        self.optimizer: Optional[SwarmOptimizer] = None
        self.revocations: Optional[RevocationWatcher] = None

    def __enter__(self) -> SwarmPeer:
        self.private_key = peer_private_key(self.network)
        signature_validator, metrics_validator = make_validators(self.network.run_id, self.private_key)
        self.public_key: bytes = signature_validator.local_public_key
        self.dht = build_dht(self.network, [signature_validator, metrics_validator])
        set_peer(str(self.dht.peer_id))  # before the averagers fork: their events name this peer too
        self.metrics = MetricsPublisher(self.dht, self.network.run_id, self.public_key)
        try:
            if self.network.auth_token_path is not None:
                authority = load_public_key(self.network.authority_public_key_path, "authority public key file")
                self.revocations = RevocationWatcher(self.dht, self.network.run_id, authority, self.public_key).start()
            self.agreement = SwarmAgreement(self.dht, self.network.run_id, self.public_key,
                                            self.swarm_settings).start()
        except BaseException:
            if self.revocations is not None:
                self.revocations.stop()
            self.dht.shutdown()
            raise
        return self

    def print_initial_peers(self) -> None:
        """Print the ``--initial_peers`` line through which other peers join (a client-mode peer cannot be
        reached: none)."""
        if not self.network.client_mode:
            print(initial_peers_line(self.dht), flush=True)

    def start_optimizer(self, optimizer_class: type[Optimizer], model: nn.Module, task: TrainingTask,
                        collaboration: CollaborationSettings, training: TrainingSettings, **options: Any) -> Optimizer:
        """``optimizer_class.from_settings`` on this peer's DHT and key (``options`` are its keyword arguments); it
        shuts down when the peer leaves."""
        self.optimizer = optimizer_class.from_settings(self.dht, model, task, self.network, collaboration, training,
                                                       self.private_key, **options)
        return self.optimizer

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> None:
        try:
            if self.optimizer is not None:
                logger.info("Leaving the swarm")
                self.optimizer.shutdown()
        finally:
            self.metrics.flush(timeout=LAST_RECORD_TIMEOUT)
            self.agreement.stop()
            if self.revocations is not None:
                self.revocations.stop()
            self.dht.shutdown()
