"""Per-peer training metrics in the DHT: a pydantic v2 schema, the validators that guard it, and helpers to publish
and read the records (``lean_transformer.swarm.monitoring.aggregation`` combines them into swarm-wide statistics).

Every trainer stores one record per epoch under the key ``{run_id}_metrics``, subkeyed by its RSA public key
(``[owner:...]``). hivemind's ``RSASignatureValidator`` makes such a subkey writable only by the holder of the
private key; ``MetricsValidator`` (below) rejects records that do not carry an owner subkey, do not match the
schema, have negative counts or non-finite numbers, or are oversized. Every DHT node of the swarm runs both
validators, on storing and on reading, so a forged or malformed record is dropped wherever it arrives.

hivemind's own ``SchemaValidator`` only accepts pydantic.v1 models, hence this small validator for v2 schemas.
"""
from __future__ import annotations

from typing import Annotated, Optional, Union

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MPFuture, MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_RECORD_BYTES = 1024  # a valid record takes ~100 bytes once the signature is stripped

Count = Annotated[int, Field(ge=0)]
Rate = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class LocalMetrics(BaseModel):
    """What one trainer reports once per epoch. ``epoch`` is the epoch it has just reached; the other fields describe
    its local work during the epoch before."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    epoch: Count
    samples_per_second: Rate
    samples_accumulated: Count
    loss_sum: Rate  # sum of the mini-batch losses; divide by mini_steps for the mean
    mini_steps: Count


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


def fetch_metrics(dht: hivemind.DHT, run_id: str) -> dict[bytes, LocalMetrics]:
    """All peers' current records, by public key. Anything that does not parse is skipped (the DHT validated remote
    records already; this also covers records stored through a node without the validators)."""
    entry = dht.get(metrics_key(run_id), latest=True)
    if entry is None or not isinstance(entry.value, dict):
        return {}
    records = {}
    for public_key, item in entry.value.items():
        try:
            records[public_key] = LocalMetrics.model_validate(item.value)
        except ValidationError:
            continue
    return records

