"""A DHT node checks each signed record once (lean_transformer.swarm.hivemind_fixes.record_checks), on two real DHT
nodes: one holds a dictionary of records signed by several owners, as the progress key holds every peer's record,
the other looks it up twice. hivemind verifies every record of every answer again; ours once, with the same
verdicts (a forged record is still refused, each time), and a validator added later counts from then on."""
from __future__ import annotations

import asyncio
from typing import List, Optional

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from lean_transformer.swarm.hivemind_fixes.record_checks import RememberedChecks

KEY = "run_progress"
OWNERS = 6
LOOKUPS = 2


class CountedSignatures(RSASignatureValidator):
    """hivemind's signature check, counting the records it verifies."""

    def __init__(self, private_key: Optional[RSAPrivateKey] = None):
        super().__init__(private_key)
        self.checked: List[DHTRecord] = []

    def validate(self, record: DHTRecord) -> bool:
        self.checked.append(record)
        return super().validate(record)


def signed(owner: RSAPrivateKey, value: dict, expiration: float, forged_by: Optional[RSAPrivateKey] = None
           ) -> tuple[bytes, bytes]:
    """``owner``'s record under KEY as a DHT node stores it: (subkey bytes, value with its signature), the signature
    made by ``forged_by`` if given."""
    subkey = RSASignatureValidator(owner).local_public_key
    record = DHTRecord(DHTID.generate(source=KEY).to_bytes(), MSGPackSerializer.dumps(subkey),
                       MSGPackSerializer.dumps(value), expiration)
    signer = RSASignatureValidator(forged_by or owner)
    # sign_value signs only its own key's records: a forger signs the record as if the subkey were its own
    mine = DHTRecord(record.key, MSGPackSerializer.dumps(signer.local_public_key), record.value, expiration)
    signature = signer.sign_value(mine)[len(record.value):]
    return subkey, record.value + signature


def lookups(validator: RecordValidatorBase, forged: bool = False) -> list:
    """Store OWNERS signed records (one forged if ``forged``) on one node; look KEY up LOOKUPS times from another
    node that checks records with ``validator``. Returns the number of records each lookup found (None: refused)."""
    async def run() -> list:
        holder = await DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        reader = await DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validator=validator,
                                      initial_peers=await holder.get_visible_maddrs(), cache_locally=False)
        try:
            expiration = get_dht_time() + 60
            owners = [RSAPrivateKey() for _ in range(OWNERS)]
            for index, owner in enumerate(owners):
                forged_by = owners[0] if forged and index == 1 else None
                subkey, value = signed(owner, {"samples": index}, expiration, forged_by)
                holder.protocol.storage.store_subkey(DHTID.generate(source=KEY), subkey, value, expiration)
            found = []
            for _ in range(LOOKUPS):
                entry = await reader.get(KEY, latest=True)
                found.append(None if entry is None else len(entry.value))
            return found
        finally:
            await reader.shutdown()
            await holder.shutdown()

    return asyncio.run(run())


@pytest.mark.parametrize("forged", [False, True], ids=["honest", "one forged"])
def test_each_record_is_verified_once_with_hiveminds_verdict(forged):
    hivemind_check, our_check = CountedSignatures(), CountedSignatures()
    expected = [None] * LOOKUPS if forged else [OWNERS] * LOOKUPS  # hivemind refuses a dictionary with a forgery
    assert lookups(CompositeValidator([hivemind_check]), forged) == expected
    assert lookups(RememberedChecks([our_check]), forged) == expected
    # hivemind checks each record of each answer (until the forged one, which ends the check of its dictionary)
    per_lookup = 2 if forged else OWNERS
    assert len(hivemind_check.checked) == LOOKUPS * per_lookup
    assert len(our_check.checked) == per_lookup
    assert len(set(our_check.checked)) == per_lookup


def test_a_new_version_of_a_record_and_a_later_validator_are_checked():
    owner = RSAPrivateKey()
    check = CountedSignatures(owner)
    remembered = RememberedChecks([check])
    key, subkey = DHTID.generate(source=KEY).to_bytes(), MSGPackSerializer.dumps(check.local_public_key)
    first = DHTRecord(key, subkey, MSGPackSerializer.dumps({"samples": 1}), get_dht_time() + 60)
    first = DHTRecord(key, subkey, remembered.sign_value(first), first.expiration_time)
    assert remembered.validate(first) and remembered.validate(first)
    assert len(check.checked) == 1
    newer = DHTRecord(key, subkey, MSGPackSerializer.dumps({"samples": 2}), first.expiration_time + 1)
    newer = DHTRecord(key, subkey, remembered.sign_value(newer), newer.expiration_time)
    assert remembered.validate(newer)
    assert len(check.checked) == 2

    class RefusesAll(RecordValidatorBase):
        def validate(self, record: DHTRecord) -> bool:
            return False

    outer = CompositeValidator([remembered])  # as hivemind's DHT holds it; DHT.add_validators extends it
    outer.extend([RefusesAll()])
    assert not outer.validate(first)  # the remembered verdict is gone with the validator that changes it
