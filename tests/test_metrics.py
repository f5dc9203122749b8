"""Per-peer metrics records: the schema and validators on their own, then a real DHT where an honest peer and an
attacker (separate processes) store records and only the valid ones can be read back.

Run as a script, this file is one of those peers: ``python tests/test_metrics.py honest|attacker ...``.
"""
from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

RUN_ID = "metrics_test"
VALID = dict(epoch=3, samples_per_second=12.5, samples_accumulated=96, loss_sum=40.25, mini_steps=12)


def signed_record(value, subkey: bytes, signer):
    """A DHT record under the run's metrics key, signed as a DHT node with the ``signer`` validators would sign it."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer

    from lean_transformer.swarm.protocol.metrics import metrics_key

    record = DHTRecord(DHTID.generate(source=metrics_key(RUN_ID)).to_bytes(), MSGPackSerializer.dumps(subkey),
                       MSGPackSerializer.dumps(value), expiration_time=1e10)
    return DHTRecord(record.key, record.subkey, signer.sign_value(record), record.expiration_time)


if __name__ != "__main__":
    import math

    import pytest
    from hivemind.dht.validation import CompositeValidator
    from hivemind.utils.crypto import RSAPrivateKey
    from pydantic import ValidationError

    from aux_utils import REPO
    from lean_transformer.swarm.protocol.metrics import LocalMetrics, MetricsValidator, make_validators

    @pytest.fixture(scope="module")
    def keys():
        """Our validators (signing with our key) and a stranger's."""
        ours = CompositeValidator(make_validators(RUN_ID, RSAPrivateKey()))
        stranger = CompositeValidator(make_validators(RUN_ID, RSAPrivateKey()))
        our_key = next(v for v in ours._validators if hasattr(v, "local_public_key")).local_public_key
        return ours, stranger, our_key

    def test_valid_record_is_accepted(keys):
        ours, _, our_key = keys
        assert ours.validate(signed_record(VALID, our_key, ours))
        assert LocalMetrics.model_validate(VALID).loss_sum == 40.25

    @pytest.mark.parametrize("change", [
        dict(samples_accumulated=-1), dict(epoch=-2), dict(mini_steps=-3), dict(loss_sum=-0.5),
        dict(samples_per_second=-1.0), dict(loss_sum=math.nan), dict(samples_per_second=math.inf),
        dict(epoch=3.0), dict(epoch="3"), dict(mini_steps=True), dict(extra_field=1), dict(epoch=None),
        # the fields that came later: a history of earlier epochs, the peer's description, its averaged rounds
        dict(history=((3, 1, 1.0, 1, 1.0),)), dict(history=((2, 1, 1.0, 1, 1.0), (1, 1, 1.0, 1, 1.0))),
        dict(history=((2, 1, 1.0, 1, 1.0), (2, 1, 1.0, 1, 1.0))), dict(history=((2, -1, 1.0, 1, 1.0),)),
        dict(history=((2, 1, math.nan, 1, 1.0),)), dict(history=((2, 1, 1.0, 1),)),
        dict(epoch=20, history=tuple((e, 1, 1.0, 1, 1.0) for e in range(10, 19))),
        dict(client_mode="yes"), dict(peer_id="<script>"), dict(peer_id="x" * 65), dict(peer_id="0OIl"),
        dict(rounds_attempted=1), dict(rounds_averaged=1), dict(rounds_attempted=1, rounds_averaged=2),
        dict(rounds_attempted=-1, rounds_averaged=-1),
        dict(joined=True), dict(joined="yes"),  # a joining record reports no work (VALID has some)
    ])
    def test_malformed_or_negative_values_are_rejected(keys, change):
        ours, _, our_key = keys
        value = {**VALID, **change}
        assert not ours.validate(signed_record(value, our_key, ours))
        with pytest.raises(ValidationError):
            LocalMetrics.model_validate(value)

    def test_records_with_history_and_peer_description_are_accepted(keys):
        """A full record stays well under the size limit; an older trainer's record (without the later fields)
        covers its own epoch only."""
        from hivemind.utils import MSGPackSerializer

        from lean_transformer.swarm.protocol.metrics import HISTORY_LENGTH, MAX_RECORD_BYTES, EpochReport

        ours, _, our_key = keys
        history = tuple((epoch, 10**6, 1e6 / 3, 10**5, 123.456) for epoch in range(3 - HISTORY_LENGTH, 3))
        full = {**VALID, "epoch": 3 + 10**6, "history": tuple((e + 10**6, *rest) for e, *rest in history),
                "client_mode": True, "peer_id": "12D3KooWQhUmQE8WTfH4GqXcb6S2oykFE4X8gZuQ3bPuC6m4Y4tj",
                "rounds_attempted": 10**6, "rounds_averaged": 10**6 - 1}
        assert len(MSGPackSerializer.dumps(full)) < MAX_RECORD_BYTES * 3 // 4
        assert ours.validate(signed_record(full, our_key, ours))
        record = LocalMetrics.model_validate(full)
        assert [report.epoch for report in record.reports()] == list(range(10**6 - 5, 10**6 + 4))
        assert record.reports()[0] == EpochReport(10**6 - 5, 10**6, 1e6 / 3, 10**5, 123.456)
        old = LocalMetrics.model_validate(VALID)
        assert old.reports() == [EpochReport(3, 96, 40.25, 12, 12.5)]
        assert (old.history, old.client_mode, old.peer_id, old.rounds_attempted) == ((), None, None, None)

    def test_missing_fields_and_non_dict_values_are_rejected(keys):
        ours, _, our_key = keys
        partial = {k: v for k, v in VALID.items() if k != "loss_sum"}
        for value in (partial, [1, 2, 3], "metrics", 7):
            assert not ours.validate(signed_record(value, our_key, ours))

    def accepted(validator, record) -> bool:
        """A validator that raises refuses the record too (the DHT request fails)."""
        try:
            return validator.validate(record)
        except Exception:
            return False

    def test_forged_records_are_rejected(keys):
        ours, stranger, our_key = keys
        assert not accepted(ours, signed_record(VALID, our_key, stranger))  # the stranger cannot sign as us
        assert not accepted(ours, signed_record(VALID, our_key, CompositeValidator()))  # unsigned
        assert not accepted(ours, signed_record(VALID, b"[owner:not a key]", ours))
        assert not accepted(ours, signed_record(VALID, b"anonymous", ours))  # no owner: nobody could protect it

    def test_oversized_records_are_rejected(keys):
        ours, _, our_key = keys
        padded = signed_record({**VALID, "padding": "x" * 2000}, our_key, ours)
        assert not ours.validate(padded)

    def test_other_keys_are_left_to_other_validators(keys):
        from hivemind.dht.validation import DHTRecord

        validator = MetricsValidator(RUN_ID)
        assert validator.validate(DHTRecord(b"some other key", b"x", b"garbage", 1e10))
        other_run = MetricsValidator("other_run")
        assert validator.merge_with(other_run) and not validator.merge_with(object())

    @pytest.fixture(scope="module")
    def swarm_results(tmp_path_factory) -> dict:
        """Start the honest peer, let the attacker store its records, then read back through the honest peer."""
        log = tmp_path_factory.mktemp("metrics")
        script = str(Path(__file__).resolve())
        with open(log / "honest.err", "wb") as honest_err, open(log / "attacker.err", "wb") as attacker_err:
            honest = subprocess.Popen([sys.executable, script, "honest"], cwd=REPO, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=honest_err, text=True)
            try:
                hello = json.loads(honest.stdout.readline())
                attacker = subprocess.run([sys.executable, script, "attacker", hello["public_key"], *hello["maddrs"]],
                                          cwd=REPO, stdout=subprocess.PIPE, stderr=attacker_err,
                                          text=True, timeout=240)
                stored = json.loads(attacker.stdout.strip().splitlines()[-1])
                honest.stdin.write("read\n")
                honest.stdin.flush()
                read_back = json.loads(honest.stdout.readline())
                assert honest.wait(60) == 0
            finally:
                honest.kill()
        return dict(hello=hello, stored=stored, read_back=read_back)

    def test_dht_keeps_only_valid_records(swarm_results):
        stored, read_back = swarm_results["stored"], swarm_results["read_back"]
        assert stored.pop("valid record of the attacker") is True
        assert stored == {case: False for case in stored}, stored  # every honest node refused the bad records
        honest_key = swarm_results["hello"]["public_key"]
        assert read_back[honest_key] == VALID
        others = {key: value for key, value in read_back.items() if key != honest_key}
        assert list(others.values()) == [{**VALID, "epoch": 4}]  # the attacker's own, valid record


def _encode(key: bytes) -> str:
    return base64.b64encode(key).decode()


def _honest() -> None:
    """A full peer with the run's validators: publishes its record, then reads all records when asked."""
    import hivemind

    from lean_transformer.swarm.protocol.metrics import LocalMetrics, fetch_metrics, make_validators, publish_metrics

    signature_validator, metrics_validator = make_validators(RUN_ID)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                       record_validators=[signature_validator, metrics_validator])
    public_key = signature_validator.local_public_key
    assert publish_metrics(dht, RUN_ID, public_key, LocalMetrics(**VALID), expiration=300)
    print(json.dumps(dict(maddrs=[str(m) for m in dht.get_visible_maddrs()], public_key=_encode(public_key))),
          flush=True)
    sys.stdin.readline()
    records = fetch_metrics(dht, RUN_ID)
    print(json.dumps({_encode(key): record.model_dump(exclude_defaults=True) for key, record in records.items()}),
          flush=True)
    dht.shutdown()


def _attacker(victim_key: str, initial_peers: list[str]) -> None:
    """A client peer without the metrics validator, trying to plant bad records; prints what each store returned."""
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils import get_dht_time

    from lean_transformer.swarm.protocol.metrics import metrics_key

    class SignsEverything(RSASignatureValidator):
        """Signs every record with its own key, even records owned by someone else."""

        def sign_value(self, record):
            signature = self._private_key.sign(self._serialize_record(record))
            return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", signature)

    signer = SignsEverything()
    dht = hivemind.DHT(start=True, client_mode=True, initial_peers=initial_peers, record_validators=[signer])
    own, victim = signer.local_public_key, base64.b64decode(victim_key)
    cases = {
        "overwrite the honest peer's record": (victim, {**VALID, "epoch": 99}),
        "negative samples": (own, {**VALID, "samples_accumulated": -5}),
        "string epoch": (own, {**VALID, "epoch": "three"}),
        "extra field": (own, {**VALID, "admin": True}),
        "float count": (own, {**VALID, "mini_steps": 12.0}),
        "no owner in the subkey": (b"anonymous", VALID),
        "history in the wrong order": (own, {**VALID, "history": ((2, 1, 1.0, 1, 1.0), (1, 1, 1.0, 1, 1.0))}),
        "history too long": (own, {**VALID, "epoch": 30, "history": tuple((e, 1, 1.0, 1, 1.0) for e in range(20))}),
        "more rounds averaged than attempted": (own, {**VALID, "rounds_attempted": 1, "rounds_averaged": 2}),
        "valid record of the attacker": (own, {**VALID, "epoch": 4}),
    }
    results = {name: bool(dht.store(metrics_key(RUN_ID), subkey=subkey, value=value,
                                    expiration_time=get_dht_time() + 300))
               for name, (subkey, value) in cases.items()}
    print(json.dumps(results), flush=True)
    dht.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if sys.argv[1] == "honest":
        _honest()
    else:
        _attacker(sys.argv[2], sys.argv[3:])
