"""Revoking identities: the signed list (signature, tampering, other authority, older lists, merging, garbage from
the DHT), the DHT authorizer's refusal of a revoked token holder, the CLI's bad input, and one swarm test in which
the owner revokes a trainer with the real CLI while the swarm trains.

Run as a script, this file is the swarm test's probe (see :func:`_probe_main`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from functools import partial
from pathlib import Path
from typing import Dict, List

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # run as a probe
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


def test_watcher_installs_the_newest_list_ignores_the_rest_and_keeps_it_alive(keys, caplog):
    """One real DHT peer (alice, authorized) and its watcher, driven one read at a time: the newest list is installed
    in the DHT process's authorizer (an older one beside it does not count), garbage and another authority's list are
    ignored with one line each and the revocation logged once (not once per read), an expiring record is re-published
    under alice's own subkey, and alice's own revocation is raised in her loop."""
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils.timed_storage import get_dht_time

    from lean_transformer.swarm.auth import make_authorizer
    from lean_transformer.swarm.auth.revocation import (IdentityRevokedError, RevocationWatcher, revoked_peer_ids,
                                                        revocation_key)

    tmp, authority = keys["tmp"], keys["authority"]
    validator = RSASignatureValidator(load_identity_key(tmp / "alice.id"))
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(tmp / "alice.id"),
                       authorizer=make_authorizer(tmp / "alice.token", tmp / "authority.pub", tmp / "alice.id", RUN_ID),
                       record_validators=[validator])
    try:
        key, far = revocation_key(RUN_ID), get_dht_time() + 3600

        def store(subkey: bytes, value, expiration: float = far) -> None:
            assert dht.store(key, value, expiration, subkey=subkey)

        watcher = RevocationWatcher(dht, RUN_ID, authority.get_public_key(), validator.local_public_key)
        watcher.check()
        assert watcher.current is None and dht.get(key) is None  # nothing to install, nothing to publish

        first = sign_revocations(authority, [keys["mallory"]], issued_at=200.0)
        store(b"cli", first.to_dht_value())
        store(b"older", sign_revocations(authority, [], issued_at=100.0).to_dht_value())
        store(b"garbage", {"issued_at": 300.0})
        store(b"foreign", sign_revocations(keys["other"], [], issued_at=400.0).to_dht_value())
        caplog.clear()
        with caplog.at_level("WARNING", logger="lean_transformer.swarm.auth.revocation"):
            for _ in range(3):
                watcher.check()
        assert watcher.current == first
        assert dht.run_coroutine(revoked_peer_ids) == {keys["mallory"]}
        lines = sorted(record.getMessage() for record in caplog.records)  # after three reads: one line each
        assert [line.split(":")[0] for line in lines] == ["Identity " + keys["mallory"] + " was revoked by the swarm "
                                                          "authority", "Ignoring an entry of the revocation record",
                                                          "Ignoring an entry of the revocation record"], lines
        assert validator.local_public_key not in dht.get(key, latest=True).value  # the DHT's copy is fresh

        both = sign_revocations(authority, [keys["mallory"], keys["alice"]], issued_at=500.0)
        store(b"cli-again", both.to_dht_value(), expiration=get_dht_time() + 30)  # expires soon: alice renews it
        watcher.check()
        assert dht.run_coroutine(revoked_peer_ids) == {keys["mallory"], keys["alice"]}
        renewed = dht.get(key, latest=True).value[validator.local_public_key]
        assert RevocationList.from_dht_value(renewed.value) == both and renewed.expiration_time > far - 3600 + 500
        with pytest.raises(IdentityRevokedError, match=f"revoked this peer's identity {keys['alice']}"):
            watcher.raise_if_revoked()
    finally:
        dht.shutdown()


BAD_INPUTS = {  # name -> (arguments, the start of the one error line)
    "no identity": (["--initial_peers", "{peer}"], "error: revoke: give the identity to revoke"),
    "bad peer ID": (["--peer-id", "12D3notapeer", "--initial_peers", "{peer}"],
                    "error: --peer-id '12D3notapeer' is not the peer ID of an RSA"),
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


# ---------------------------------------------------------------- the swarm test's probe


async def _probe_member(_dht, node, member: str) -> dict:
    """One try of each refusable request at ``member``: a DHT store sent straight to it, a request to join its
    gradient averager's group (a wrong schema hash: admitted, it can never be accepted into the group) and a state
    download."""
    from hivemind.p2p import PeerID
    from hivemind.utils.timed_storage import get_dht_time
    from test_auth_averaging import _download, _join

    result = {}
    stored = await node.protocol.call_store(PeerID.from_base58(member), [DHTID.generate(source="probe.record")],
                                            [node.protocol.serializer.dumps("probe")], get_dht_time() + 60)
    result["store"] = None if stored is None else all(stored)
    for name, call in (("join", partial(_join, node, member, b"not the run's schema", "grad_averager")),
                       ("download", partial(_download, node, member))):
        try:
            result[name] = await call()
        except Exception as e:  # a refused or broken stream
            result[name] = f"error: {type(e).__name__}"
    return result


async def _read_revocations(_dht, node, run_id: str) -> List[str]:
    entry = await node.get(revocation_key(run_id), latest=True)
    if entry is None or not isinstance(entry.value, dict):
        return []
    return sorted({peer for item in entry.value.values() for peer in item.value.get("revoked", [])})


def _probe_main(argv: List[str]) -> None:
    """A token holder that asks each member, every ``--interval`` s until the stop file appears, to store a record,
    to let it join and to send it the state; one JSON line per round on stdout, with the revoked identities it can
    read."""
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator

    from lean_transformer.swarm.auth import make_authorizer
    from lean_transformer.swarm.auth.averaging_gate import publish_access_token

    parser = argparse.ArgumentParser()
    parser.add_argument("--identity", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--authority_pub", required=True)
    parser.add_argument("--run_id", required=True)
    parser.add_argument("--initial_peers", nargs="+", required=True)
    parser.add_argument("--members", nargs="+", required=True)
    parser.add_argument("--stop_file", required=True)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args(argv)

    validator = RSASignatureValidator(load_identity_key(args.identity))
    dht = hivemind.DHT(start=True, initial_peers=args.initial_peers, identity_path=args.identity,
                       host_maddrs=["/ip4/127.0.0.1/tcp/0"], authorizer=make_authorizer(
                           args.token, args.authority_pub, args.identity, args.run_id),
                       record_validators=[validator])
    publish_access_token(dht, args.run_id, args.token, validator.local_public_key)  # as every member does
    print(json.dumps(dict(ready=str(dht.peer_id))), flush=True)
    deadline = time.monotonic() + 280
    while not os.path.exists(args.stop_file) and time.monotonic() < deadline:
        row = dict(time=time.time(), members={member: dht.run_coroutine(partial(_probe_member, member=member))
                                              for member in args.members},
                   revoked=dht.run_coroutine(partial(_read_revocations, run_id=args.run_id)))
        print(json.dumps(dict(probe=row)), flush=True)
        time.sleep(args.interval)
    dht.shutdown()
    os._exit(0)  # the DHT and its daemon are gone; skip the interpreter's slow finalization


# ---------------------------------------------------------------- the swarm test


def _refused(result: dict) -> bool:
    return result["store"] is None and result["join"] == "PROTOCOL_VIOLATION" and result["download"]["messages"] == 0


def _admitted(result: dict) -> bool:
    return result["store"] is True and result["join"] in ("NOT_LOOKING_FOR_GROUP", "BAD_SCHEMA_HASH") \
        and result["download"]["messages"] > 0


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_revoked_trainer_is_refused_by_every_peer_within_a_minute(tmp_path: Path, report):
    """Three trainers of an authorized swarm (alice, bob, mallory) train; a probe (eve, a token holder too) asks
    alice and bob every second to store a record, to let it join and for the state. The owner then revokes mallory
    and eve with the real CLI. Within 60 s of the CLI's exit, alice and bob refuse eve's every request, and report
    both identities revoked; mallory sees its own revocation and exits with one line."""
    from aux_utils import REPO, PeerProcess, start_peer, stop_all, wait_until
    from hivemind.p2p import PeerID
    from test_auth_averaging import RUN, RUN_ARGV

    from lean_transformer.swarm.auth import save_authority_key

    authority = RSAPrivateKey()
    save_authority_key(authority, tmp_path / "authority.pem")
    save_public_key(authority, tmp_path / "authority.pub")
    ids = {}
    for name in ("alice", "bob", "mallory", "eve"):
        key = load_identity_key(tmp_path / f"{name}.id", create=True)
        ids[name] = PeerID.from_identity((tmp_path / f"{name}.id").read_bytes()).to_base58()
        save_token(issue_token(authority, key.get_public_key(), datetime.now(timezone.utc) + timedelta(hours=1), name),
                   tmp_path / f"{name}.token")
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    stop_file = tmp_path / "stop"
    peers: Dict[str, PeerProcess] = {}

    def trainer(name: str, initial_peers: List[str]) -> PeerProcess:
        joining = ["--initial_peers", *initial_peers] if initial_peers else []
        peers[name] = start_peer(name, ["run_trainer.py", *RUN_ARGV, *joining, "--output_dir", str(tmp_path / name),
                                        "--identity_path", str(tmp_path / f"{name}.id"), "--auth_token_path",
                                        str(tmp_path / f"{name}.token"), "--authority_public_key_path",
                                        str(tmp_path / "authority.pub"), "--max_epochs", "1000"], tmp_path, env)
        return peers[name]

    def probe_rows() -> List[dict]:
        return [json.loads(line)["probe"] for line in peers["eve"].stdout.splitlines() if line.startswith('{"probe"')]

    try:
        alice = trainer("alice", [])
        maddrs = alice.initial_peers(timeout=90)
        bob, mallory = trainer("bob", maddrs), trainer("mallory", maddrs)
        peers["eve"] = start_peer("eve", [__file__, "--identity", str(tmp_path / "eve.id"), "--token",
                                          str(tmp_path / "eve.token"), "--authority_pub",
                                          str(tmp_path / "authority.pub"),
                                          "--run_id", RUN["run_id"], "--initial_peers", *maddrs, "--members",
                                          ids["alice"], ids["bob"], "--stop_file", str(stop_file)], tmp_path, env,
                                  events=False)
        mallory.wait_for_event("averaged", timeout=150)  # mallory is a member of the training swarm
        wait_until(lambda: any(all(_admitted(result) for result in row["members"].values()) for row in probe_rows()),
                   timeout=60, what="eve's requests to be served by alice and bob (the control)")

        cli = subprocess.run([sys.executable, "-m", "lean_transformer.swarm.auth", "revoke", "--authority",
                              str(tmp_path / "authority.pem"), "--peer-id", ids["mallory"], "--peer-id", ids["eve"],
                              "--initial_peers", *maddrs, "--run_id", RUN["run_id"], "--list-path",
                              str(tmp_path / "revoked.list")], cwd=REPO, capture_output=True, text=True, timeout=120)
        revoked_at = time.time()
        assert cli.returncode == 0, cli.stderr
        assert cli.stderr.strip().splitlines()[-1].startswith(f"revoked {min(ids['mallory'], ids['eve'])}"), cli.stderr

        def refused_since() -> Dict[str, float]:
            """member -> the time of the first probe round after which eve was refused everything there."""
            rows = [row for row in probe_rows() if row["time"] > revoked_at]
            since = {}
            for member in (ids["alice"], ids["bob"]):
                first = None
                for row in rows:
                    first = (first or row["time"]) if _refused(row["members"][member]) else None
                if first is not None and rows[-1]["time"] - first >= 5:  # and it stays refused
                    since[member] = first
            return since if len(since) == 2 else {}

        refused = wait_until(refused_since, timeout=90, what="alice and bob to refuse eve", interval=1.0)
        code = mallory.wait(90)
        noticed = {(peer.name, event["source"]): event["time"] for peer in (alice, bob)
                   for event in peer.events("identity_revoked")}
        rows = probe_rows()
        stop_file.touch()
        assert peers["eve"].wait(60) == 0, peers["eve"].stderr[-3000:]
        exit_codes = stop_all([alice, bob])
    finally:
        for peer in peers.values():
            peer.kill()

    seconds = {name: refused[ids[name]] - revoked_at for name in ("alice", "bob")}
    assert max(seconds.values()) < 60, seconds
    report(f"CLI: {cli.stderr.strip().splitlines()[-1]}")
    report(f"eve (revoked, still holding a valid token): served by alice and bob before (store, join, download), "
           f"then refused all three {seconds['alice']:.1f} s (alice) and {seconds['bob']:.1f} s (bob) after the "
           f"CLI's exit, at every one of the {len([row for row in rows if row['time'] > refused[ids['alice']]])} "
           f"later rounds")
    assert all(_refused(row["members"][ids[name]]) for name in ("alice", "bob")
               for row in rows if row["time"] >= refused[ids[name]])
    assert sorted(rows[-1]["revoked"]) == sorted([ids["mallory"], ids["eve"]]), rows[-1]
    report("eve can still read the revocation record, and sees both identities in it")
    for peer in (alice, bob):
        reasons = {event["reason"] for event in peer.events("peer_refused") if event["source"] == ids["eve"]}
        assert reasons == {"its identity was revoked by the swarm authority"}, (peer.name, reasons)

    expected = {(peer, ids[name]) for peer in ("alice", "bob") for name in ("mallory", "eve")}
    assert expected <= set(noticed), noticed
    took = {key: noticed[key] - revoked_at for key in expected}
    assert max(took.values()) < 60, took
    report(f"alice and bob logged identity_revoked for mallory and eve {min(took.values()):.1f}-"
           f"{max(took.values()):.1f} s after the CLI's exit")

    assert code == 1, mallory.stderr[-3000:]
    lines = [line for line in mallory.stderr.splitlines() if "revoked this peer's identity" in line]
    assert len(lines) == 1 and lines[0].startswith(
        f"run_trainer.py: error: the swarm authority revoked this peer's identity {ids['mallory']} "), mallory.stderr
    assert sorted((event["source"], event["own"]) for event in mallory.events("identity_revoked")) == sorted(
        [(ids["mallory"], True), (ids["eve"], False)])
    shutdown = mallory.events("shutdown")[-1]
    assert shutdown["reason"] == "error" and "IdentityRevokedError" in shutdown["error"], shutdown
    report(f"mallory exited with code 1 {shutdown['time'] - revoked_at:.1f} s after the CLI's exit, with one line: "
           f"{lines[0]!r}")
    assert exit_codes == [0, 0], [peer.stderr[-3000:] for peer in (alice, bob)]


if __name__ == "__main__":
    _probe_main(sys.argv[1:])
