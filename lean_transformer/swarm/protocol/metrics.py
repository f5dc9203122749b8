"""Per-peer training metrics in the DHT: a pydantic v2 schema, the validators that guard it, and helpers to publish
and read the records (``lean_transformer.swarm.monitoring.aggregation`` combines them into swarm-wide statistics).

Every trainer stores one record per epoch under the key ``{run_id}_metrics``, subkeyed by its RSA public key
(``[owner:...]``). hivemind's ``RSASignatureValidator`` makes such a subkey writable only by the holder of the
private key; ``MetricsValidator`` (below) rejects records that do not carry an owner subkey, do not match the
schema, have negative counts or non-finite numbers, or are oversized. Every DHT node of the swarm runs both
validators, on storing and on reading, so a forged or malformed record is dropped wherever it arrives.

A record also carries the trainer's last few epochs (``history``), so that an aux peer that reads the DHT less often
than the epochs change still sees every epoch of every trainer, and what the aux peer's per-peer table shows (client
mode, peer ID, averaged rounds). These fields came later and are optional, so records of older trainers stay valid;
older peers' validators refuse the new fields, so all peers of a run should run the same version.

hivemind's own ``SchemaValidator`` only accepts pydantic.v1 models, hence this small validator for v2 schemas.
"""
from __future__ import annotations

import logging
import time
from typing import Annotated, NamedTuple, Optional, Union

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MPFuture, MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

logger = logging.getLogger(__name__)

MAX_RECORD_BYTES = 1024  # a valid record takes ~100 bytes once the signature is stripped, <= ~520 with a history
HISTORY_LENGTH = 8  # earlier epochs a record repeats: the aux peer misses none while it refreshes within 8 epochs
MAX_EXCLUDED = 4  # peer IDs a record lists as excluded (each ~53 bytes: the record stays within MAX_RECORD_BYTES)

Count = Annotated[int, Field(ge=0)]
Rate = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
PastEpoch = tuple[Count, Count, Rate, Count, Rate]  # the fields of EpochReport, in its order (compact in msgpack)
PEER_ID_PATTERN = r"[1-9A-HJ-NP-Za-km-z]{1,64}"  # base58, as libp2p prints peer IDs


class EpochReport(NamedTuple):
    """One trainer's work in one epoch, as the aggregation reads it: labelled, like a record, with the epoch that the
    trainer reached at the end of that work."""

    epoch: int
    samples_accumulated: int
    loss_sum: float
    mini_steps: int
    samples_per_second: float


class LocalMetrics(BaseModel):
    """What one trainer reports once per epoch. ``epoch`` is the epoch it has just reached; the other fields describe
    its local work during the epoch before.

    ``history`` repeats the reports of its previous epochs (at most ``HISTORY_LENGTH``, oldest first, each an
    ``EpochReport`` as a tuple, epochs increasing and below ``epoch``). ``client_mode`` and ``peer_id`` (its libp2p
    ID, as it claims it: for display only; the record's owner key is what identifies it) describe the peer;
    ``rounds_attempted`` counts the epochs it trained in since it started and ``rounds_averaged`` those in which it
    averaged with at least one other peer (DiLoCo: outer rounds); ``excluded``: the peer IDs its averagers exclude now
    (robust aggregation, :mod:`lean_transformer.swarm.averaging.exclusion`; at most ``MAX_EXCLUDED``).
    ``joined``: True for the record a trainer publishes as it joins, at the epoch it joined at, before any work: it
    reports no epoch (:meth:`reports`), but tells the aux peer that this trainer is there, so that the aux peer waits
    for it before releasing the next epoch (without it, the swarm's first epoch was released with the 1-2 trainers
    that reached it first: benchmarks/internet.py, 16 trainers). ``None`` / empty: an older trainer's record.
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    epoch: Count
    samples_per_second: Rate
    samples_accumulated: Count
    loss_sum: Rate  # sum of the mini-batch losses; divide by mini_steps for the mean
    mini_steps: Count
    history: Annotated[tuple[PastEpoch, ...], Field(max_length=HISTORY_LENGTH)] = ()
    client_mode: Optional[bool] = None
    peer_id: Optional[Annotated[str, Field(pattern=f"^{PEER_ID_PATTERN}$")]] = None
    rounds_attempted: Optional[Count] = None
    rounds_averaged: Optional[Count] = None
    excluded: Optional[Annotated[tuple[Annotated[str, Field(pattern=f"^{PEER_ID_PATTERN}$")], ...],
                                 Field(max_length=MAX_EXCLUDED)]] = None
    joined: Optional[bool] = None

    @model_validator(mode="after")
    def _consistent(self) -> "LocalMetrics":
        epochs = [past[0] for past in self.history] + [self.epoch]
        if any(earlier >= later for earlier, later in zip(epochs, epochs[1:])):
            raise ValueError(f"history: epochs must increase and stay below the record's epoch, got {epochs}")
        if (self.rounds_attempted is None) != (self.rounds_averaged is None):
            raise ValueError("rounds_attempted and rounds_averaged come together")
        if self.rounds_averaged is not None and self.rounds_averaged > self.rounds_attempted:
            raise ValueError(f"rounds_averaged ({self.rounds_averaged}) exceeds rounds_attempted "
                             f"({self.rounds_attempted})")
        if self.joined and (self.samples_accumulated or self.mini_steps or self.loss_sum or self.history):
            raise ValueError("a joining record reports no work: no samples, mini-steps, loss or history")
        return self

    def reports(self) -> list[EpochReport]:
        """Every epoch this record covers, oldest first: the history, then the epoch it has just reached (none for a
        joining record)."""
        if self.joined:
            return []
        return [*(EpochReport(*past) for past in self.history),
                EpochReport(self.epoch, self.samples_accumulated, self.loss_sum, self.mini_steps,
                            self.samples_per_second)]


def metrics_key(run_id: str) -> str:
    return f"{run_id}_metrics"


class MetricsValidator(RecordValidatorBase):
    """Accepts a record under a run's metrics key only if its subkey is an RSA owner key and its value is a valid
    ``LocalMetrics``; records under other keys are left to the other validators."""

    def __init__(self, run_id: str):
        self._key_ids = {DHTID.generate(source=metrics_key(run_id)).to_bytes()}

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self._key_ids:
            return True
        if record.subkey in DHTProtocol.RESERVED_SUBKEYS or len(record.value) > MAX_RECORD_BYTES:
            return False  # a metrics record is always one peer's entry, and always small
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            value = MSGPackSerializer.loads(record.value)
        except Exception:  # msgpack raises a variety of errors on garbage
            return False
        if not isinstance(subkey, bytes) or not RSASignatureValidator._PUBLIC_KEY_RE.fullmatch(subkey):
            return False  # without an owner key in the subkey, the signature validator would not protect it
        try:
            LocalMetrics.model_validate(value)
        except ValidationError:
            return False
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, MetricsValidator):
            return False
        self._key_ids |= other._key_ids
        return True


def make_validators(run_id: str, private_key: Optional[RSAPrivateKey] = None
                    ) -> tuple[RSASignatureValidator, MetricsValidator]:
    """The validators every DHT node of the run should be created with; the first one's ``local_public_key`` is
    this peer's metrics subkey. ``private_key=None`` uses hivemind's process-wide key (the one its optimizer uses)."""
    return RSASignatureValidator(private_key), MetricsValidator(run_id)


def publish_metrics(dht: hivemind.DHT, run_id: str, public_key: bytes, metrics: LocalMetrics, expiration: float,
                    wait: bool = True) -> Union[bool, MPFuture]:
    """Store this peer's record (signed by the DHT's signature validator). Returns whether any node accepted it, or
    with ``wait=False`` a future of that (so that a slow DHT does not hold up training)."""
    return dht.store(metrics_key(run_id), subkey=public_key, value=metrics.model_dump(),
                     expiration_time=get_dht_time() + expiration, return_future=not wait)


class MetricsPublisher:
    """Stores this peer's records without holding up training, and lets the last one reach the DHT before it leaves.

    A DHT request in a swarm of dozens over slow links takes seconds (the progress lookups of
    ``benchmarks/internet.py``'s 16-trainer runs: 11-16 s at the 90th percentile), and a peer that shut its DHT down
    meanwhile lost the record of the epoch it had just reached, so the aux peer's row of that epoch missed it (a
    trainer that left by SIGTERM 0.5 s after reaching its epoch; its DHT was stopped 11 s later). :meth:`flush` waits,
    bounded, for the last store.
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, public_key: bytes):
        self.dht, self.run_id, self.public_key = dht, run_id, public_key
        self._last: Optional[MPFuture] = None
        self._last_published = 0.0

    def publish(self, metrics: LocalMetrics, expiration: float) -> None:
        """Start storing ``metrics`` for ``expiration`` seconds; it replaces the peer's earlier record."""
        self._last = publish_metrics(self.dht, self.run_id, self.public_key, metrics, expiration, wait=False)
        self._last_published = time.monotonic()

    def flush(self, timeout: float) -> Optional[bool]:
        """Wait up to ``timeout`` seconds for the last record's store: True if some node accepted it, False if none
        did or it is still under way (one line says which), None if nothing was published."""
        if self._last is None:
            return None
        try:
            stored = bool(self._last.result(timeout=timeout))
        except TimeoutError:
            logger.warning(f"This peer's last metrics record was not stored within "
                           f"{time.monotonic() - self._last_published:.1f} s; the aux peer may miss its last epoch")
            return False
        except Exception as error:  # the DHT failed the request: the same consequence, said once
            logger.warning(f"Storing this peer's last metrics record failed ({type(error).__name__}: {error})")
            return False
        if not stored:
            logger.warning("No DHT node accepted this peer's last metrics record")
        return stored


def fetch_metrics(dht: hivemind.DHT, run_id: str) -> dict[bytes, LocalMetrics]:
    """All peers' current records, by public key. A record that does not parse is dropped with one warning line (the
    DHT validated remote records already; this covers records stored through a node without the validators)."""
    entry = dht.get(metrics_key(run_id), latest=True)
    if entry is None or not isinstance(entry.value, dict):
        return {}
    records = {}
    for public_key, item in entry.value.items():
        try:
            records[public_key] = LocalMetrics.model_validate(item.value)
        except ValidationError as error:
            logger.warning(f"Dropped a malformed metrics record ({error.error_count()} error(s), first: "
                           f"{error.errors()[0]['msg']})")
    return records

