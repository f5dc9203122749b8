"""A DHT node checks each signed record once, not each time the record reaches it.

What hivemind 1.1.12 does: a node validates every record of every answer to its ``find`` requests (an RSA-2048
signature check, with the owner's key parsed from its SSH form, and a pydantic schema check), and a dictionary
value comes whole in every answer. A lookup of the run's progress key gets all N peers' records from each of the
few nodes that hold it, and every store first searches for the nodes nearest to its key with the same ``find``
requests, whose values it then throws away: the store of a peer's progress record verifies the other N-1 records
several times over. The records are the same ones, again and again, until their owners store new ones. Measured
with py-spy in a DHT process of 6 tiny DiLoCo trainers on loopback: 36% of its samples were in this validation
(26% for stores' node searches alone, whose values are discarded).

:class:`RememberedChecks` wraps the node's validators and remembers the verdict on each exact record (key, subkey,
value with its signature, expiration time), the latest records up to :data:`REMEMBERED_BYTES`. The verdict depends
on those bytes alone (a signature and a schema check), so a remembered one is the one a new check would give; a
validator added later (hivemind's optimizer adds its progress schema) joins the wrapped ones and clears what was
remembered.
Reproduced by ``tests/test_record_checks.py``. Drop when hivemind skips values it does not use and remembers
checked records (neither in its master, checked 2026-11-29).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase

# the remembered records' bytes, per DHT process: a signed progress or metrics record takes ~1 KB (most of it the
# owner's key and the signature), a swarm of 32 peers keeps a few hundred alive
REMEMBERED_BYTES = 4 * 2**20
LARGEST_REMEMBERED = REMEMBERED_BYTES // 64  # a larger record is checked each time rather than crowd out the rest


class RememberedChecks(RecordValidatorBase):
    """``validators`` (composed as hivemind composes them) whose verdict on an exact record is remembered."""

    def __init__(self, validators: Iterable[RecordValidatorBase]):
        self._validators = CompositeValidator(validators)
        self._verdicts: OrderedDict[DHTRecord, bool] = OrderedDict()  # oldest first
        self._bytes = 0

    def validate(self, record: DHTRecord) -> bool:
        verdict = self._verdicts.get(record)
        if verdict is not None:
            self._verdicts.move_to_end(record)
            return verdict
        verdict = self._validators.validate(record)
        if _size(record) > LARGEST_REMEMBERED:
            return verdict
        self._verdicts[record] = verdict
        self._bytes += _size(record)
        while self._bytes > REMEMBERED_BYTES:
            self._bytes -= _size(self._verdicts.popitem(last=False)[0])
        return verdict

    def sign_value(self, record: DHTRecord) -> bytes:
        return self._validators.sign_value(record)

    def strip_value(self, record: DHTRecord) -> bytes:
        return self._validators.strip_value(record)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        """Take any validator added later (``DHT.add_validators``) in, so that its records are remembered too."""
        self._validators.extend([other])
        self._verdicts.clear()
        self._bytes = 0
        return True


def _size(record: DHTRecord) -> int:
    return len(record.key) + len(record.subkey) + len(record.value)
