"""Revoking identities: the signed list (signature, tampering, other authority, older lists, merging, garbage from
the DHT), the DHT authorizer's refusal of a revoked token holder, the CLI's bad input, and one swarm test in which
the owner revokes a trainer with the real CLI while the swarm trains."""
from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hivemind.dht.routing import DHTID
from hivemind.proto import dht_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import ValueWithExpiration

from lean_transformer.swarm.auth import issue_token, load_identity_key, save_public_key, save_token
from lean_transformer.swarm.auth.authorizer import SwarmAuthorizer
from lean_transformer.swarm.auth.cli import main
from lean_transformer.swarm.auth.keys import peer_id_of
from lean_transformer.swarm.auth.revocation import (InvalidRevocationListError, RevocationList, load_revocations,
                                                    merge_revocations, newest_revocations, revocation_dht_id,
                                                    revocation_key, save_revocations, sign_revocations)

RUN_ID = "revoke"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("revocation")
    authority = RSAPrivateKey()
    save_public_key(authority, tmp / "authority.pub")
    peers = {}
    for name in ("alice", "mallory"):
        key = load_identity_key(tmp / f"{name}.id", create=True)
        save_token(issue_token(authority, key.get_public_key(), datetime.now(timezone.utc) + timedelta(hours=1), name),
                   tmp / f"{name}.token")
        peers[name] = str(peer_id_of(key.get_public_key()))
    return dict(authority=authority, other=RSAPrivateKey(), tmp=tmp, **peers)


def _entries(*lists: RevocationList, expiration: float = 1e10) -> dict:
    return {f"subkey{i}".encode(): ValueWithExpiration(item.to_dht_value(), expiration + i)
            for i, item in enumerate(lists)}


def test_signed_list_verifies_and_tampering_is_refused(keys):
    authority = keys["authority"].get_public_key()
    signed = sign_revocations(keys["authority"], [keys["mallory"]], issued_at=100.0)
    parsed = RevocationList.from_dht_value(signed.to_dht_value()).verify(authority)
    assert parsed.revoked == {keys["mallory"]} and parsed.issued_at == 100.0

    tampered = [RevocationList(signed.issued_at, signed.revoked | {keys["alice"]}, signed.signature),
                RevocationList(signed.issued_at, frozenset(), signed.signature),  # a member unrevokes itself
                RevocationList(signed.issued_at + 1, signed.revoked, signed.signature)]  # replayed as newer
    for item in tampered:
        with pytest.raises(InvalidRevocationListError, match="not signed by this swarm's authority"):
            item.verify(authority)
    foreign = sign_revocations(keys["other"], [keys["mallory"]], issued_at=100.0)
    with pytest.raises(InvalidRevocationListError, match="not signed by this swarm's authority"):
        foreign.verify(authority)


@pytest.mark.parametrize("value", [None, "garbage", {"issued_at": 1.0}, dict(issued_at="x", revoked=[], signature=b""),
                                   dict(issued_at=1.0, revoked=[3], signature=b""),
                                   dict(issued_at=1.0, revoked=[], signature="text"),
                                   dict(issued_at=float("nan"), revoked=[], signature=b"")])
def test_malformed_dht_values_are_refused_with_a_precise_error(value):
    with pytest.raises(InvalidRevocationListError, match="revocation list"):
        RevocationList.from_dht_value(value)


def test_newest_valid_list_wins_and_bad_entries_are_reported(keys):
    authority = keys["authority"].get_public_key()
    old = sign_revocations(keys["authority"], [keys["mallory"]], issued_at=100.0)
    new = sign_revocations(keys["authority"], [keys["mallory"], keys["alice"]], issued_at=200.0)
    forged = RevocationList(300.0, frozenset(), new.signature)  # newest, but its signature does not match
    foreign = sign_revocations(keys["other"], [], issued_at=400.0)
    entries = _entries(old, new, forged, foreign)
    entries[b"garbage"] = ValueWithExpiration("garbage", 1e10)
    invalid = []
    newest, expiration = newest_revocations(entries, authority, lambda subkey, reason: invalid.append(subkey))
    assert newest == new and expiration == 1e10 + 1
    assert sorted(invalid) == [b"garbage", b"subkey2", b"subkey3"]
    assert newest_revocations(None, authority) == (None, 0.0)
    assert newest_revocations("not a dictionary record", authority) == (None, 0.0)


def test_merge_keeps_every_revocation_and_supersedes_all(keys, tmp_path):
    authority = keys["authority"]
    in_dht = sign_revocations(authority, [keys["mallory"]], issued_at=time.time() + 3600)  # a clock ahead of ours
    local = sign_revocations(authority, [keys["alice"]], issued_at=50.0)
    merged = merge_revocations(authority, [in_dht, local, None], [keys["alice"]], now=time.time())
    assert merged.revoked == {keys["mallory"], keys["alice"]}
    assert merged.issued_at > in_dht.issued_at
    merged.verify(authority.get_public_key())

    save_revocations(merged, tmp_path / "revoked.list")
    assert load_revocations(tmp_path / "revoked.list", authority.get_public_key()) == merged
    with pytest.raises(InvalidRevocationListError, match="revoked.list: revocation list is not signed"):
        load_revocations(tmp_path / "revoked.list", keys["other"].get_public_key())
    (tmp_path / "garbage.list").write_bytes(b"\xc1 not msgpack")
    with pytest.raises(InvalidRevocationListError, match="is not a revocation list"):
        load_revocations(tmp_path / "garbage.list", authority.get_public_key())


def test_authorizer_refuses_a_revoked_token_holder(keys):
    """alice's DHT authorizer, given a list that revokes mallory, refuses mallory's requests and responses (her
    token is still valid), except a find request for the revocation record alone; an older list changes nothing."""
    tmp, authority = keys["tmp"], keys["authority"].get_public_key()

    def authorizer(name: str) -> SwarmAuthorizer:
        return SwarmAuthorizer(load_identity_key(tmp / f"{name}.id"), authority, tmp / f"{name}.token", run_id=RUN_ID)

    alice, mallory = authorizer("alice"), authorizer("mallory")

    async def exchange(request) -> tuple[bool, bool]:
        """(alice accepts mallory's request, mallory's response to alice's request)"""
        await mallory.sign_request(request, None)
        accepted = await alice.validate_request(request)
        ours = dht_pb2.StoreRequest()
        await alice.sign_request(ours, None)
        response = dht_pb2.StoreResponse()
        await mallory.sign_response(response, ours)
        return accepted, await alice.validate_response(response, ours)

    def run(request) -> tuple[bool, bool]:
        return asyncio.run(exchange(request))

    other_key = DHTID.generate(source="another key").to_bytes()
    assert run(dht_pb2.StoreRequest()) == (True, True)
    alice.install_revocations(frozenset({keys["mallory"]}), issued_at=200.0)
    assert run(dht_pb2.StoreRequest()) == (False, False)
    assert run(dht_pb2.FindRequest(keys=[other_key])) == (False, False)
    assert run(dht_pb2.FindRequest(keys=[revocation_dht_id(RUN_ID), other_key])) == (False, False)
    assert run(dht_pb2.FindRequest(keys=[revocation_dht_id(RUN_ID)])) == (True, False)
    alice.install_revocations(frozenset(), issued_at=100.0)  # older: ignored
    assert run(dht_pb2.StoreRequest()) == (False, False)
    assert revocation_dht_id(RUN_ID) == DHTID.generate(source=revocation_key(RUN_ID)).to_bytes()


BAD_INPUTS = {  # name -> (arguments, the start of the one error line)
    "no identity": (["--initial_peers", "{peer}"], "error: revoke: give the identity to revoke"),
    "bad peer ID": (["--peer-id", "12D3notapeer", "--initial_peers", "{peer}"], "error: --peer-id '12D3notapeer' is not the peer ID of an RSA"),
    "missing key file": (["--peer-public-key", "{d}/none.pub", "--initial_peers", "{peer}"],
                         "error: peer public key file not found"),
    "bad initial peer": (["--peer-id", "{mallory}", "--initial_peers", "/ip4/1.2.3.4/tcp/1"], "error: --initial_peers"),
    "foreign local list": (["--peer-id", "{mallory}", "--initial_peers", "{peer}", "--list-path", "{d}/foreign.list"],
                           "error: revocation list file {d}/foreign.list: revocation list is not signed"),
    "unreachable swarm": (["--peer-id", "{mallory}", "--initial_peers", "{peer}", "--timeout", "3"],
                          "error: could not reach --initial_peers"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_revoke_bad_input_gives_one_line(keys, case, capsys, report):
    from aux_utils import closed_port

    tmp = keys["tmp"]
    if not (tmp / "authority.pem").exists():
        assert main(["new-authority", "--out", str(tmp / "authority.pem"), "--public-out", str(tmp / "cli.pub")]) == 0
        save_revocations(sign_revocations(keys["other"], [], 1.0), tmp / "foreign.list")
        capsys.readouterr()
    peer = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{keys['alice']}"  # nobody listens there
    args, message = BAD_INPUTS[case]
    args = [arg.format(d=tmp, peer=peer, mallory=keys["mallory"]) for arg in args]
    code = main(["revoke", "--authority", str(tmp / "authority.pem"), "--run_id", RUN_ID, *args])
    err = capsys.readouterr().err
    assert code == 1, err
    assert len(err.splitlines()) == 1 and err.startswith(message.format(d=tmp)), err
    report(f"{case}: exit 1, {err.strip()}")
