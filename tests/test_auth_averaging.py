"""Averaging access control: with authorization on, a peer's averagers serve token holders only.

The unit tests check the gate's token verification with real keys. The swarm test runs, each in its own process on
127.0.0.1, two token holders that average known gradients (alice and bob, ``tests/grad_peer.py``), a third token
holder (the control) and two strangers that bypass the DHT: they know the members' addresses and peer IDs, the run's
group key and the gradients' schema hash, and call the members' averagers directly. One stranger has no token at
all; for the other, the control (an insider) publishes bob's token under the stranger's peer ID.

Run as a script, this file is the visitor (control or stranger); see :func:`_visitor_main`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from functools import partial
from pathlib import Path
from typing import List

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

from aux_utils import PeerProcess, start_peer, wait_until  # noqa: E402
from grad_peer import check_rounds  # noqa: E402

from lean_transformer.demo.local_swarm import command_line  # noqa: E402

RUN_ID = "gated"
RUN = dict(run_id=RUN_ID, host_maddrs="/ip4/127.0.0.1/tcp/0", target_batch_size=24, per_device_batch_size=4,
           max_sequence_length=32, matchmaking_time=3, averaging_timeout=10, startup_timeout=60,
           grad_compression="none")
RUN_ARGV = command_line(RUN)
CALL_TIMEOUT = 10
PROBE_INTERVAL = 0.25  # seconds between a stranger's join requests while the members train


# ---------------------------------------------------------------- unit: the gate's verification


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    from hivemind.utils.crypto import RSAPrivateKey

    from lean_transformer.swarm.auth import load_identity_key

    tmp = tmp_path_factory.mktemp("keys")
    return dict(authority=RSAPrivateKey(), other_authority=RSAPrivateKey(),
                alice=load_identity_key(tmp / "alice.id", create=True), alice_file=tmp / "alice.id",
                mallory=load_identity_key(tmp / "mallory.id", create=True))


def test_peer_id_of_a_key_is_its_libp2p_peer_id(keys):
    from hivemind.p2p import PeerID

    from lean_transformer.swarm.auth import public_key_text
    from lean_transformer.swarm.auth.averaging_gate import peer_id_of

    expected = PeerID.from_identity(keys["alice_file"].read_bytes())  # hivemind's derivation from the identity file
    assert peer_id_of(keys["alice"].get_public_key()) == expected
    assert peer_id_of(public_key_text(keys["alice"]).encode()) == expected
    assert peer_id_of(keys["mallory"].get_public_key()) != expected


# case -> (who signs, whose key the token is bound to, hours until expiry, expected error or None)
TOKENS = {
    "valid": ("authority", "alice", 1, None),
    "expired": ("authority", "alice", -1, "expired at"),
    "bound to another key": ("authority", "mallory", 1, "bound to the key of peer"),
    "another authority": ("other_authority", "alice", 1, "not signed by this swarm's authority"),
}


@pytest.mark.parametrize("case", list(TOKENS))
def test_gate_admits_only_a_valid_token_of_the_calling_peer(keys, case):
    from lean_transformer.swarm.auth import InvalidTokenError, TokenExpiredError, issue_token
    from lean_transformer.swarm.auth.averaging_gate import check_member_token, peer_id_of

    signer, holder, hours, error = TOKENS[case]
    expires = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(hours=hours)
    token = issue_token(keys[signer], keys[holder].get_public_key(), expires, holder)
    alice = peer_id_of(keys["alice"].get_public_key())
    authority = keys["authority"].get_public_key()
    if error is None:
        assert check_member_token(token, alice, authority) == expires
    else:
        expected_type = TokenExpiredError if case == "expired" else InvalidTokenError
        with pytest.raises(expected_type, match=re.escape(error)):
            check_member_token(token, alice, authority)


def test_gate_refuses_a_token_whose_key_was_swapped(keys):
    """A token holder cannot lend its signature: the key is part of what the authority signed."""
    from lean_transformer.swarm.auth import InvalidTokenError, issue_token
    from lean_transformer.swarm.auth.averaging_gate import check_member_token, peer_id_of

    token = issue_token(keys["authority"], keys["alice"].get_public_key(),
                        datetime.now(timezone.utc) + timedelta(hours=1), "alice")
    token.public_key = keys["mallory"].get_public_key().to_bytes()
    mallory = peer_id_of(keys["mallory"].get_public_key())
    with pytest.raises(InvalidTokenError, match="not signed"):
        check_member_token(token, mallory, keys["authority"].get_public_key())


def test_gated_averagers_keep_hivemind_rpc_protocol():
    """Same RPCs and message types as hivemind's averagers, and their own handler table even when the parent's
    was built first (hivemind names handlers after the class, and the gated peers must call the gated ones)."""
    from hivemind.optim.grad_averager import GradientAverager
    from hivemind.optim.state_averager import TrainingStateAverager

    from lean_transformer.swarm.auth.averaging_gate import GatedGradientAverager, GatedTrainingStateAverager
    from lean_transformer.swarm.averaging.diloco import pseudo_gradient_averager_class
    from lean_transformer.swarm.averaging.host_grad_averager import HostGatedGradientAverager, HostGradientAverager

    for parent, gated in ((GradientAverager, GatedGradientAverager), (TrainingStateAverager,
                                                                      GatedTrainingStateAverager),
                          (HostGradientAverager, HostGatedGradientAverager),
                          (pseudo_gradient_averager_class(gated=False), pseudo_gradient_averager_class(gated=True))):
        parent._collect_rpc_handlers()
        gated._collect_rpc_handlers()
        assert gated._rpc_handlers == parent._rpc_handlers
        assert {handler.method_name for handler in gated._rpc_handlers} >= {
            "rpc_join_group", "rpc_aggregate_part", "rpc_download_state"}
        assert gated._stub_type is not parent._stub_type


# ---------------------------------------------------------------- the visitor process


def _averager_stub(node, member: str, service: str):
    """A stub for ``member``'s averager ``service``: "grad_averager", or "outer" (DiLoCo's pseudo-gradients)."""
    from hivemind.p2p import PeerID

    from lean_transformer.swarm.auth.averaging_gate import GatedGradientAverager
    from lean_transformer.swarm.averaging.diloco import pseudo_gradient_averager_class

    averager = GatedGradientAverager if service == "grad_averager" else pseudo_gradient_averager_class(gated=True)
    return averager.get_stub(node.p2p, PeerID.from_base58(member), namespace=f"{RUN_ID}_{service}")


async def _join(node, member: str, schema_hash: bytes, service: str) -> str:
    """Ask ``member``'s averager ``service`` to accept us as a follower; its first answer's code."""
    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import anext
    from hivemind.utils.timed_storage import get_dht_time

    prefix = f"{RUN_ID}_{service}"
    stub = _averager_stub(node, member, service)
    request = averaging_pb2.JoinRequest(schema_hash=schema_hash, expiration=get_dht_time() + CALL_TIMEOUT,
                                        group_key=f"{prefix}.0b")  # the group key of a swarm that has not split
    stream = await stub.rpc_join_group(request)
    try:
        message = await asyncio.wait_for(anext(stream), CALL_TIMEOUT)
    finally:
        await stream.aclose()
    return averaging_pb2.MessageCode.Name(message.code)


async def _aggregate(node, member: str, service: str) -> str:
    """Send ``member``'s averager ``service`` a tensor part for all-reduce (for a group it never formed); its answer's
    code."""
    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import anext, as_aiter

    stub = _averager_stub(node, member, service)
    part = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"a group of my own",
                                       peer_id=node.peer_id.to_bytes(), weight=1.0)
    stream = await stub.rpc_aggregate_part(as_aiter(part))
    try:
        message = await asyncio.wait_for(anext(stream), CALL_TIMEOUT)
    finally:
        await stream.aclose()  # answered: close first, as the members do (hivemind_fixes.stream_answers)
    return averaging_pb2.MessageCode.Name(message.code)


async def _download(node, member: str) -> dict:
    """Download ``member``'s training state directly: how many messages came and whether they held its metadata."""
    from hivemind.p2p import PeerID
    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import aiter_with_timeout

    from lean_transformer.swarm.auth.averaging_gate import GatedTrainingStateAverager
    from lean_transformer.swarm.hivemind_fixes.stream_answers import UntilStateEnd

    stub = GatedTrainingStateAverager.get_stub(node.p2p, PeerID.from_base58(member),
                                               namespace=f"{RUN_ID}_state_averager")
    stream = UntilStateEnd(await stub.rpc_download_state(averaging_pb2.DownloadRequest()))
    messages = [message async for message in aiter_with_timeout(stream, CALL_TIMEOUT)]
    return dict(messages=len(messages), metadata=any(message.metadata for message in messages))


async def _probe(_dht, node, member: str, schema_hash: bytes, service: str) -> dict:
    return dict(join=await _join(node, member, schema_hash, service), aggregate=await _aggregate(node, member, service),
                download=await _download(node, member))


async def _keep_asking_to_join(_dht, node, member: str, schema_hash: bytes, service: str, stop_file: str) -> dict:
    """Request to join ``member``'s group every PROBE_INTERVAL s until ``stop_file`` appears: the answers' codes."""
    codes: Counter = Counter()
    deadline = time.monotonic() + 180
    while not os.path.exists(stop_file) and time.monotonic() < deadline:
        try:
            codes[await _join(node, member, schema_hash, service)] += 1
        except Exception as e:  # the member has finished and left
            codes[f"error: {type(e).__name__}"] += 1
        await asyncio.sleep(PROBE_INTERVAL)
    return dict(codes)


def _visitor_main(argv: List[str]) -> None:
    """Start a DHT node (admitted to the swarm's DHT only with a token), probe the member's averagers, and (a
    stranger) keep asking it to let us join until the stop file appears. Results: JSON lines on stdout."""
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.p2p import PeerID
    from hivemind.utils.timed_storage import get_dht_time

    from lean_transformer.swarm.auth import encode_token, load_identity_key, load_token, make_authorizer
    from lean_transformer.swarm.auth.averaging_gate import access_token_key, publish_access_token

    parser = argparse.ArgumentParser()
    parser.add_argument("--identity", required=True)
    parser.add_argument("--initial_peers", nargs="+", required=True)
    parser.add_argument("--member", required=True, help="the peer ID of the member to call")
    parser.add_argument("--schema_hash", required=True)
    parser.add_argument("--token")
    parser.add_argument("--authority_pub")
    parser.add_argument("--plant", nargs=2, metavar=("PEER_ID", "TOKEN_FILE"),
                        help="(with a token) publish TOKEN_FILE's token under PEER_ID's key")
    parser.add_argument("--probe_file", help="wait for this file before probing")
    parser.add_argument("--stop_file", help="a stranger: keep asking to join until this file appears")
    parser.add_argument("--service", default="grad_averager", choices=["grad_averager", "outer"],
                        help="the averager to join and send parts to (outer: DiLoCo's pseudo-gradient all-reduce)")
    args = parser.parse_args(argv)

    validator = RSASignatureValidator(load_identity_key(args.identity))
    authorizer = make_authorizer(args.token, args.authority_pub, args.identity)  # None for a stranger
    authorized = authorizer is not None
    dht = hivemind.DHT(start=True, initial_peers=args.initial_peers, identity_path=args.identity,
                       host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=[validator], authorizer=authorizer,
                       ensure_bootstrap_success=authorized)  # a stranger's bootstrap fails: the DHT refuses it
    if authorized:  # what every member does at start (lean_transformer.swarm.averaging.optimizer.open_averaging_gate)
        publish_access_token(dht, RUN_ID, args.token, validator.local_public_key)
    if args.plant:
        planted = dht.store(access_token_key(RUN_ID, PeerID.from_base58(args.plant[0])),
                            encode_token(load_token(args.plant[1])), get_dht_time() + 600,
                            subkey=validator.local_public_key)
        assert planted, "the control could not publish the planted token"
    print(json.dumps(dict(ready=str(dht.peer_id))), flush=True)

    deadline = time.monotonic() + 180
    while args.probe_file and not os.path.exists(args.probe_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    schema_hash = bytes.fromhex(args.schema_hash)
    probe = partial(_probe, member=args.member, schema_hash=schema_hash, service=args.service)
    print(json.dumps(dict(probe=dht.run_coroutine(probe))), flush=True)
    if args.stop_file:
        codes = dht.run_coroutine(partial(_keep_asking_to_join, member=args.member, schema_hash=schema_hash,
                                          service=args.service, stop_file=args.stop_file))
        print(json.dumps(dict(codes=codes)), flush=True)
    dht.shutdown()


# ---------------------------------------------------------------- the swarm test


def _grad_schema_hash() -> bytes:
    """The schema hash of the run's gradient averagers, computed as a stranger running the project's code would."""
    import torch
    from hivemind.averaging.averager import compute_schema_hash

    from arguments import CollaborationSettings, NetworkSettings, TaskArguments, TrainingSettings, parse_arguments
    from tasks import get_task

    _, _, training, task_args = parse_arguments(
        [NetworkSettings, CollaborationSettings, TrainingSettings, TaskArguments], RUN_ARGV)
    task = get_task(task_args.task)(task_args, training)
    model = task.build_model()
    return compute_schema_hash([torch.zeros_like(param) for group in task.param_groups(model)
                                for param in group["params"]])


def _result(peer: PeerProcess, name: str, timeout: float) -> dict:
    """The visitor's JSON line that holds ``name``."""
    line = peer.wait_for(rf'^\{{"{name}": .*$', timeout, stream="stdout").group(0)
    return json.loads(line)[name]


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_strangers_are_refused_by_the_averagers_and_token_holders_average(tmp_path: Path, report):
    import torch
    from hivemind.p2p import PeerID
    from hivemind.utils.crypto import RSAPrivateKey

    from lean_transformer.swarm.auth import issue_token, load_identity_key, save_public_key, save_token

    authority = RSAPrivateKey()
    save_public_key(authority, tmp_path / "authority.pub")
    strangers = ["no-token", "planted-token"]  # the latter: the control publishes bob's token under its peer ID
    ids = {}
    for name in ["alice", "bob", "control", *strangers]:
        key = load_identity_key(tmp_path / f"{name}.id", create=True)
        ids[name] = PeerID.from_identity((tmp_path / f"{name}.id").read_bytes()).to_base58()
        if name not in strangers:
            token = issue_token(authority, key.get_public_key(), datetime.now(timezone.utc) + timedelta(hours=1), name)
            save_token(token, tmp_path / f"{name}.token")
    authority_pub = str(tmp_path / "authority.pub")
    files = {name: tmp_path / name for name in ("start", "probe", "stop")}
    schema_hash = _grad_schema_hash().hex()
    peers: List[PeerProcess] = []

    def start(name: str, argv: List[str], events: bool = True) -> PeerProcess:
        peers.append(start_peer(name, argv, tmp_path, events=events))
        return peers[-1]

    def grad_peer(name: str, seed: int, *initial_peers: str) -> PeerProcess:
        joining = ["--initial_peers", *initial_peers] if initial_peers else []
        return start(name, ["tests/grad_peer.py", "--out", str(tmp_path / f"{name}.pt"), "--grad_seed", str(seed),
                            "--rounds", "3", "--group_size", "2", "--max_epochs", "12", "--start_file",
                            str(files["start"]), "--stop_file", str(files["stop"]), *RUN_ARGV, *joining,
                            "--per_device_batch_size", str(seed + 2), "--identity_path", str(tmp_path / f"{name}.id"),
                            "--auth_token_path", str(tmp_path / f"{name}.token"), "--authority_public_key_path",
                            authority_pub])

    def visitor(name: str, initial_peers: List[str], *extra: str) -> PeerProcess:
        return start(name, [__file__, "--identity", str(tmp_path / f"{name}.id"), "--initial_peers", *initial_peers,
                            "--member", ids["alice"], "--schema_hash", schema_hash, *extra], events=False)

    try:
        alice = grad_peer("alice", 1)
        maddrs = alice.initial_peers(timeout=90)
        bob = grad_peer("bob", 2, *maddrs)
        control = visitor("control", maddrs, "--token", str(tmp_path / "control.token"), "--authority_pub",
                          authority_pub, "--plant", ids["planted-token"], str(tmp_path / "bob.token"))
        outsiders = [visitor(name, maddrs, "--probe_file", str(files["probe"]), "--stop_file", str(files["stop"]))
                     for name in strangers]
        for peer in (alice, bob):
            peer.wait_for("^ready$", timeout=90, stream="stdout")
        control_probe = _result(control, "probe", timeout=90)  # alice is idle: she waits for the start file
        files["probe"].touch()
        stranger_probes = {peer.name: _result(peer, "probe", timeout=90) for peer in outsiders}
        files["start"].touch()
        wait_until(lambda: alice.process.poll() is not None or bob.process.poll() is not None, 150,
                   "alice or bob to finish its rounds")
        files["stop"].touch()  # the other one cannot average alone any more; the strangers stop asking
        stranger_codes = {peer.name: _result(peer, "codes", timeout=60) for peer in outsiders}
        for peer in peers:
            assert peer.wait(60) == 0, f"{peer.name}: {peer.stderr[-3000:]}"
    finally:
        for peer in peers:
            peer.kill()

    # the control holds a token: the very same requests reach hivemind's own handlers
    assert control_probe["join"] == "NOT_LOOKING_FOR_GROUP", control_probe
    assert control_probe["aggregate"] == "BAD_GROUP_ID", control_probe
    assert control_probe["download"]["metadata"] and control_probe["download"]["messages"] > 1, control_probe
    report(f"control (token holder) calling alice's averagers directly: join -> {control_probe['join']}, tensor part "
           f"-> {control_probe['aggregate']}, state download -> {control_probe['download']['messages']} messages")

    # strangers: refused before hivemind reads their requests, with one warning per stranger in each averager
    for name, probe in stranger_probes.items():
        assert probe == dict(join="PROTOCOL_VIOLATION", aggregate="PROTOCOL_VIOLATION",
                             download=dict(messages=0, metadata=False)), (name, probe)
        answered = {code: count for code, count in stranger_codes[name].items() if not code.startswith("error")}
        assert set(answered) == {"PROTOCOL_VIOLATION"} and sum(answered.values()) >= 10, (name, stranger_codes[name])
        for service in ("grad_averager", "state_averager"):
            warnings = [event["reason"] for event in alice.events("peer_refused")
                        if (event["source"], event["service"]) == (ids[name], f"{RUN_ID}_{service}")]
            assert len(warnings) == 1, (name, service, warnings)
        if name == "planted-token":
            assert f"bound to the key of peer {ids['bob']}" in warnings[0], warnings
        report(f"stranger ({name}): join -> PROTOCOL_VIOLATION, tensor part -> PROTOCOL_VIOLATION, state download "
               f"-> nothing; {sum(answered.values())} more join requests while alice trained, all refused; alice "
               f"logged once per averager: {warnings[0]!r}")
    for name in ("bob", "control"):
        assert not [event for event in alice.events("peer_refused") + bob.events("peer_refused")
                    if event["source"] == ids[name]], name

    dumps = {name: torch.load(tmp_path / f"{name}.pt", weights_only=True) for name in ("alice", "bob")}
    checked = check_rounds(dumps, {ids[name] for name in strangers})
    recorded = {name: len(dump["rounds"]) for name, dump in dumps.items()}
    assert checked >= 1, f"alice and bob recorded no common round: {recorded}"
    report(f"token holders: {checked} all-reduce rounds of alice and bob (recorded {recorded}) averaged exactly their "
           f"own gradients through the gated averagers; no stranger in any group")


if __name__ == "__main__":
    _visitor_main(sys.argv[1:])
