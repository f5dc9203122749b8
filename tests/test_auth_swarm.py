"""Swarm authorization end to end: real hivemind DHT peers, each in its own process on 127.0.0.1.

Two honest peers (alice, bob) hold tokens from the swarm authority. Visitors then join one at a time: a newcomer
with a valid token (the control, which must get in through the very same steps) and outsiders with no token, an
expired token, bob's token (copied: tokens travel with every request) or a token from another authority. Each
outsider tries to store, read, store directly at alice and query alice directly; the honest peers then check that
their records are unchanged and that the outsider never entered their routing tables.

Run as a script, this file is one peer: it reads JSON commands on stdin and answers on stdout.
"""

import argparse
import json
import os
import sys
import time
from datetime import datetime, timedelta, timezone
from functools import partial
from pathlib import Path
from typing import Optional

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # run as a peer too
from aux_utils import start_peer  # noqa: E402
from lean_transformer.swarm.peers.processes import PeerExited, wait_until  # noqa: E402

PREFIX = "@@ "  # marks protocol lines on stdout; everything else (e.g. logs) is ignored
READY_TIMEOUT = 60
CALL_TIMEOUT = 30
EXPIRATION = 600  # seconds the test records live

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]  # the fixture starts 7 peers, one at a time


# ---------------------------------------------------------------- the peer process


async def _routing_peers(dht, node) -> list:
    return [str(peer_id) for peer_id in node.protocol.routing_table.peer_id_to_uid]


async def _direct_store(peer_id: str, key: str, value: str, dht, node):
    """Send a store RPC straight to ``peer_id``, bypassing routing: what an outsider who knows an ID would do."""
    from hivemind.dht.routing import DHTID
    from hivemind.p2p import PeerID
    from hivemind.utils import get_dht_time

    result = await node.protocol.call_store(
        PeerID.from_base58(peer_id), [DHTID.generate(source=key)], [node.protocol.serializer.dumps(value)],
        get_dht_time() + EXPIRATION,
    )
    return None if result is None else list(result)  # None: the peer refused or did not answer


async def _direct_find(peer_id: str, key: str, dht, node):
    from hivemind.dht.routing import DHTID
    from hivemind.p2p import PeerID

    key_id = DHTID.generate(source=key)
    response = await node.protocol.call_find(PeerID.from_base58(peer_id), [key_id])
    if response is None:
        return {"responded": False}
    found, _ = response[key_id]
    return {"responded": True, "value": None if found is None else node.protocol.serializer.loads(found.value)}


def _peer_main(argv) -> None:
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.p2p import PeerID
    from hivemind.utils import get_dht_time
    from hivemind.utils.auth import TokenAuthorizerBase

    from lean_transformer.swarm.auth import load_identity_key, load_token, make_authorizer

    class PresentingAuthorizer(TokenAuthorizerBase):
        """What an outsider can run: presents whatever token it has, signs with its own key, trusts everyone."""

        def __init__(self, key, token):
            super().__init__(key)
            self._token = token

        async def get_token(self):
            return self._token

        def is_token_valid(self, access_token) -> bool:
            return True

        def does_token_need_refreshing(self, access_token) -> bool:
            return False

    parser = argparse.ArgumentParser()
    parser.add_argument("--identity", required=True)
    parser.add_argument("--mode", choices=["authorized", "present", "none"], required=True)
    parser.add_argument("--token")
    parser.add_argument("--authority_pub")
    parser.add_argument("--initial_peers", default="[]")
    parser.add_argument("--expect_admission", action="store_true")
    args = parser.parse_args(argv)

    key = load_identity_key(args.identity)  # one key: peer ID, record signatures and token binding
    authorizer = {
        "authorized": lambda: make_authorizer(args.token, args.authority_pub, args.identity),
        "present": lambda: PresentingAuthorizer(key, load_token(args.token)),
        "none": lambda: None,
    }[args.mode]()
    validator = RSASignatureValidator(key)
    initial_peers = json.loads(args.initial_peers)
    dht = hivemind.DHT(
        start=True, initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=args.identity,
        check_if_identity_free=False, authorizer=authorizer, record_validators=[validator],
        ensure_bootstrap_success=bool(initial_peers) and args.expect_admission,
    )

    def answer(**message):
        print(PREFIX + json.dumps(message), flush=True)

    answer(
        peer_id=str(dht.peer_id),
        identity_peer_id=str(PeerID.from_identity(Path(args.identity).read_bytes())),
        owner_key=validator.local_public_key.decode(),
        maddrs=[str(maddr) for maddr in dht.get_visible_maddrs()],
    )
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "store":
            subkey = command.get("subkey")
            ok = dht.store(
                command["key"], command["value"], get_dht_time() + command.get("expiration", EXPIRATION),
                subkey=None if subkey is None else subkey.encode(), exclude_self=True,
            )
            answer(ok=ok)
        elif op == "get":
            found = dht.get(command["key"], latest=True)
            value = None if found is None else found.value
            if isinstance(value, dict):  # a dictionary record: {subkey: ValueWithExpiration}
                value = {subkey.decode(): item.value for subkey, item in value.items()}
            answer(value=value)
        elif op == "direct_store":
            store = partial(_direct_store, command["peer_id"], command["key"], command["value"])
            answer(result=dht.run_coroutine(store))
        elif op == "direct_find":
            answer(**dht.run_coroutine(partial(_direct_find, command["peer_id"], command["key"])))
        elif op == "routing":
            answer(peers=dht.run_coroutine(_routing_peers))
        elif op == "quit":
            dht.shutdown()
            answer(bye=True)
            # the DHT and its p2pd are gone; skip interpreter finalization, which takes seconds on a busy machine
            os._exit(0)


# ---------------------------------------------------------------- the test's side


class Peer:
    """A peer process driven over stdin and its stdout's protocol lines; every wait is bounded. ``info`` waits for it
    to be ready."""

    def __init__(self, name: str, log_dir: Path, *args: str):
        self.name = name
        self.process = start_peer(name, [__file__, *args], log_dir, events=False, stdin=True)
        self._answers = 0  # protocol lines read so far
        self._info = None

    @property
    def info(self) -> dict:
        """What the peer announced when ready: peer_id, identity_peer_id, owner_key, maddrs."""
        if self._info is None:
            self._info = self._receive(READY_TIMEOUT)
        return self._info

    def _receive(self, timeout: float) -> dict:
        def next_answer() -> Optional[str]:
            exited = self.process.returncode is not None
            text = self.process.stdout
            answers = [line for line in text[:text.rfind("\n") + 1].splitlines() if line.startswith(PREFIX)]
            if len(answers) > self._answers:
                return answers[self._answers]
            if exited:
                raise PeerExited(f"{self.name} exited with code {self.process.returncode}:\n{self.process.log_tail()}")
            return None

        line = wait_until(next_answer, timeout, f"{self.name}'s answer", interval=0.05)
        self._answers += 1
        return json.loads(line[len(PREFIX):])

    def call(self, op: str, timeout: float = CALL_TIMEOUT, **kwargs) -> dict:
        self.info  # noqa: B018 (the ready message comes first)
        self.process.send(json.dumps({"op": op, **kwargs}))
        return self._receive(timeout)


def close_all(peers) -> None:
    """Ask every peer to shut down at once, then wait for each; kill whichever is still there after 20 s (its whole
    process group: the peer, its DHT process and the p2p daemon)."""
    for peer in peers:
        try:
            peer.process.send(json.dumps({"op": "quit"}))
        except OSError:  # already gone
            pass
    deadline = time.monotonic() + 20
    for peer in peers:
        try:
            peer.process.wait(max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            pass  # killed


# case -> how the visitor starts: mode, whose token it presents, which authority signed it, token expiry (hours)
VISITORS = {
    "valid token (control)": ("authorized", "own", "authority", 24),
    "no token": ("none", None, None, None),
    "expired token": ("present", "own", "authority", -1),
    "bob's token, own key": ("present", "bob", "authority", 24),
    "token of another authority": ("authorized", "own", "other_authority", 24),
}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """alice and bob (token holders) and one visitor per case, started before the first test runs."""
    from hivemind.utils.crypto import RSAPrivateKey

    from lean_transformer.swarm.auth import issue_token, load_identity_key, save_public_key, save_token

    tmp = tmp_path_factory.mktemp("auth_swarm")
    now = datetime.now(timezone.utc)
    authorities = {"authority": RSAPrivateKey(), "other_authority": RSAPrivateKey()}
    for name, key in authorities.items():
        save_public_key(key, tmp / f"{name}.pub")

    def start(name, mode, token_owner=None, signer="authority", hours=24, initial_peers=(), expect_admission=True):
        args = ["--identity", str(tmp / f"{name}.id"), "--mode", mode, "--initial_peers", json.dumps(initial_peers)]
        key = load_identity_key(tmp / f"{name}.id", create=True)
        if token_owner == "own":
            token = issue_token(authorities[signer], key.get_public_key(), now + timedelta(hours=hours), name)
            save_token(token, tmp / f"{name}.token")
        if token_owner is not None:
            token_path = tmp / f"{name if token_owner == 'own' else token_owner}.token"
            args += ["--token", str(token_path), "--authority_pub", str(tmp / f"{signer}.pub")]
        return Peer(name, tmp, *args, *(["--expect_admission"] if expect_admission else []))

    peers = [start("alice", "authorized", "own")]
    try:
        alice = peers[0]
        peers.append(start("bob", "authorized", "own", initial_peers=alice.info["maddrs"]))
        bob = peers[1]
        maddrs = alice.info["maddrs"] + bob.info["maddrs"]
        visitors = {}
        for i, (case, (mode, token_owner, signer, hours)) in enumerate(VISITORS.items()):
            visitors[case] = start(f"visitor{i}", mode, token_owner, signer, hours, maddrs,
                                   expect_admission=mode == "authorized" and signer == "authority")
            peers.append(visitors[case])
            visitors[case].info  # noqa: B018 (one start at a time: parallel starts time out on 2 busy cores)
        assert alice.call("store", key="swarm.victim", value="original")["ok"]
        yield {"alice": alice, "bob": bob, "visitors": visitors, "tokens": tmp}
    finally:
        close_all(peers)


def test_token_holders_share_records_and_keep_one_identity(swarm, report):
    from lean_transformer.swarm.auth import load_token

    alice, bob = swarm["alice"], swarm["bob"]
    assert alice.call("store", key="swarm.alice", value="from alice")["ok"]
    assert bob.call("store", key="swarm.bob", value="from bob")["ok"]
    assert bob.call("get", key="swarm.alice")["value"] == "from alice"
    assert alice.call("get", key="swarm.bob")["value"] == "from bob"
    assert bob.info["peer_id"] in alice.call("routing")["peers"]
    report("token holders: alice and bob store and read each other's records")

    # one key per peer: its libp2p ID, the owner key of its signed records and its token's key coincide
    for peer in (alice, bob):
        token_key = load_token(swarm["tokens"] / f"{peer.name}.token").public_key.decode()
        assert peer.info["peer_id"] == peer.info["identity_peer_id"]
        assert peer.info["owner_key"] == f"[owner:{token_key}]"
    report("identity: peer ID, record owner key and token key come from the same identity file")

    # a signed per-peer record (the metrics pattern): readable by bob, not overwritable by him
    owner = alice.info["owner_key"]
    assert alice.call("store", key="swarm.metrics", subkey=owner, value="alice's metrics")["ok"]
    assert not bob.call("store", key="swarm.metrics", subkey=owner, value="forged", expiration=EXPIRATION + 60)["ok"]
    assert bob.call("get", key="swarm.metrics")["value"] == {owner: "alice's metrics"}
    report("signed records: bob reads alice's metrics record and cannot overwrite it")


@pytest.mark.parametrize("case", list(VISITORS))
def test_visitor(swarm, case, report):
    alice, bob, visitor = swarm["alice"], swarm["bob"], swarm["visitors"][case]
    admitted = case == "valid token (control)"
    key = f"visitor.{case}"
    stored = visitor.call("store", key=key, value=case)["ok"]
    read = visitor.call("get", key="swarm.victim")["value"]
    direct = visitor.call("direct_store", peer_id=alice.info["peer_id"], key=key + ".direct", value=case)["result"]
    found = visitor.call("direct_find", peer_id=alice.info["peer_id"], key="swarm.victim")
    tried = f"{case}: store -> {stored}, get -> {read!r}, direct store at alice -> {direct}, direct find at alice -> " \
            f"{'answered' if found['responded'] else 'refused'}"
    if not admitted:  # try to replace an honest record with a newer one, through the DHT and directly
        overwrite = (visitor.call("store", key="swarm.victim", value="forged", expiration=EXPIRATION + 60)["ok"],
                     visitor.call("direct_store", peer_id=alice.info["peer_id"], key="swarm.victim",
                                  value="forged")["result"])

    in_routing = {p.name: visitor.info["peer_id"] in p.call("routing")["peers"] for p in (alice, bob)}
    seen = {p.name: (p.call("get", key=key)["value"], p.call("get", key=key + ".direct")["value"])
            for p in (alice, bob)}
    victim = {p.name: p.call("get", key="swarm.victim")["value"] for p in (alice, bob)}
    assert victim == {"alice": "original", "bob": "original"}, victim

    if admitted:
        assert stored and read == "original" and direct == [True], tried
        assert found == {"responded": True, "value": "original"}, found
        assert all(value == (case, case) for value in seen.values()), seen
        assert in_routing["alice"], "the newcomer is routable"
        report(f"{tried}; honest peers read its records -> admitted like any token holder")
    else:
        assert stored is False and read is None and direct is None and not found["responded"], tried
        assert overwrite == (False, None), overwrite
        assert all(value == (None, None) for value in seen.values()), seen
        assert not any(in_routing.values()), in_routing
        report(f"{tried}; overwrite of alice's record refused {overwrite}; honest records intact {victim}; "
               f"absent from honest routing tables")


if __name__ == "__main__":
    _peer_main(sys.argv[1:])
