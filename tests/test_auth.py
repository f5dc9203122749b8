"""Unit tests of swarm access control: tokens, key files, identity and the authorizer's request protocol
(no network: requests and responses are hivemind's real DHT protobufs, signed and checked in-process)."""

import asyncio
from datetime import datetime, timedelta, timezone

import pytest
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2, dht_pb2
from hivemind.utils.crypto import RSAPrivateKey

from lean_transformer.swarm.auth import (
    InvalidTokenError,
    KeyFileError,
    SwarmAuthorizer,
    TokenExpiredError,
    check_token,
    decode_token,
    encode_token,
    issue_token,
    key_fingerprint,
    load_authority_key,
    load_identity_key,
    load_public_key,
    load_token,
    make_authorizer,
    parse_duration,
    save_authority_key,
    save_public_key,
    save_token,
)

NOW = datetime.now(timezone.utc)
DAY = timedelta(days=1)


@pytest.fixture(scope="module")
def keys():
    """Two authorities and two peers; RSA key generation is the slow part, so it is shared."""
    return {name: RSAPrivateKey() for name in ("authority", "other_authority", "alice", "bob")}


@pytest.fixture
def files(tmp_path, keys):
    """An authorized peer's files as the CLI would lay them out: alice's identity, token and the authority key."""
    identity = tmp_path / "alice.id"
    alice = load_identity_key(identity, create=True)
    save_public_key(keys["authority"], tmp_path / "authority.pub")
    save_token(issue_token(keys["authority"], alice.get_public_key(), NOW + DAY, "alice"), tmp_path / "alice.token")
    return {"identity": identity, "token": tmp_path / "alice.token", "authority_pub": tmp_path / "authority.pub",
            "key": alice}


def test_token_round_trip(tmp_path, keys, report):
    authority, alice = keys["authority"], keys["alice"].get_public_key()
    token = issue_token(authority, alice, NOW + DAY, name="alice")
    save_token(token, tmp_path / "token")
    loaded = load_token(tmp_path / "token")
    assert loaded.SerializeToString() == token.SerializeToString()
    assert len((tmp_path / "token").read_text().splitlines()) == 1, "a token file is one pasteable line"
    check_token(loaded, authority.get_public_key(), peer_public_key=alice)
    assert loaded.username == "alice" and loaded.public_key == alice.to_bytes()
    report(f"round trip: token for {key_fingerprint(alice)} saved, loaded and verified")


def test_expiry_boundary(keys, report):
    expires_at = (NOW + DAY).replace(microsecond=0)
    token = issue_token(keys["authority"], keys["alice"].get_public_key(), expires_at)
    authority = keys["authority"].get_public_key()
    check_token(token, authority, now=expires_at - timedelta(seconds=1))
    with pytest.raises(TokenExpiredError, match="expired at"):
        check_token(token, authority, now=expires_at)
    past = issue_token(keys["authority"], keys["alice"].get_public_key(), NOW - timedelta(hours=1))
    with pytest.raises(TokenExpiredError):
        check_token(past, authority)
    report("expiry: valid one second before expires_at, TokenExpiredError at it and after")


@pytest.mark.parametrize("field", ["username", "expiration_time", "public_key", "signature"])
def test_tampered_token_is_rejected(keys, field, report):
    token = issue_token(keys["authority"], keys["alice"].get_public_key(), NOW + DAY, "alice")
    tampered = {
        "username": "mallory",
        "expiration_time": (NOW + 100 * DAY).isoformat(timespec="seconds"),
        "public_key": keys["bob"].get_public_key().to_bytes(),
        "signature": token.signature[:-8] + b"AAAAAAA=",
    }[field]
    setattr(token, field, tampered)
    with pytest.raises(InvalidTokenError, match="not signed by this swarm's authority"):
        check_token(token, keys["authority"].get_public_key())
    report(f"tampered {field}: signature check fails")


def test_other_authority_and_other_key_are_rejected(keys, report):
    foreign = issue_token(keys["other_authority"], keys["alice"].get_public_key(), NOW + DAY)
    with pytest.raises(InvalidTokenError, match="not signed"):
        check_token(foreign, keys["authority"].get_public_key())
    token = issue_token(keys["authority"], keys["alice"].get_public_key(), NOW + DAY)
    with pytest.raises(InvalidTokenError, match="bound to key .* not to this peer's identity key"):
        check_token(token, keys["authority"].get_public_key(), peer_public_key=keys["bob"].get_public_key())
    report("another authority's token and a token bound to another key are both rejected")


@pytest.mark.parametrize("text", ["", "not base64 !", "aGVsbG8gd29ybGQ=", encode_token(dht_pb2.PingRequest())])
def test_decode_rejects_non_tokens(text):
    with pytest.raises(InvalidTokenError, match="is not an access token"):
        decode_token(text)


@pytest.mark.parametrize("text,seconds", [("90s", 90), ("15m", 900), ("12h", 43200), ("7d", 604800), ("2w", 1209600),
                                          ("1.5h", 5400)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["7", "7x", "-1d", "0d", "d", "7 days"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="expires-in"):
        parse_duration(text)


def test_issue_token_rejects_bad_arguments(keys):
    alice = keys["alice"].get_public_key()
    with pytest.raises(ValueError, match="timezone-aware"):
        issue_token(keys["authority"], alice, datetime.now() + DAY)
    with pytest.raises(ValueError, match="name must be"):
        issue_token(keys["authority"], alice, NOW + DAY, name="bad\nname")


def test_authority_key_files(tmp_path, keys):
    save_authority_key(keys["authority"], tmp_path / "authority.pem")
    assert (tmp_path / "authority.pem").stat().st_mode & 0o777 == 0o600, "the authority key is private"
    loaded = load_authority_key(tmp_path / "authority.pem")
    assert loaded.get_public_key().to_bytes() == keys["authority"].get_public_key().to_bytes()
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        save_authority_key(keys["other_authority"], tmp_path / "authority.pem")
    (tmp_path / "garbage.pem").write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    with pytest.raises(KeyFileError, match="garbage.pem is not an unencrypted PEM private key"):
        load_authority_key(tmp_path / "garbage.pem")
    with pytest.raises(FileNotFoundError, match="authority key file not found"):
        load_authority_key(tmp_path / "missing.pem")
    (tmp_path / "garbage.pub").write_text("ssh-rsa AAAAnotakey\n")
    with pytest.raises(KeyFileError, match="garbage.pub is not an RSA public key"):
        load_public_key(tmp_path / "garbage.pub")


def test_identity_key_is_the_libp2p_identity(tmp_path):
    path = tmp_path / "peer.id"
    key = load_identity_key(path, create=True)
    assert path.stat().st_mode & 0o777 == 0o400, "written by hivemind's own generator, owner-read-only"
    again = load_identity_key(path, create=True)
    assert again.get_public_key().to_bytes() == key.get_public_key().to_bytes(), "create=True reuses the file"
    proto = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    assert proto.data == key.to_bytes(), "the file holds exactly this RSA key"
    PeerID.from_identity(path.read_bytes())  # and libp2p accepts it as an identity

    ed25519 = tmp_path / "ed25519.id"
    ed25519.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=b"x" * 64).SerializeToString())
    with pytest.raises(KeyFileError, match="holds a Ed25519 key"):
        load_identity_key(ed25519)
    corrupt = tmp_path / "corrupt.id"
    corrupt.write_bytes(b"\x08\x00\x12\x03abc")
    with pytest.raises(KeyFileError, match="corrupt RSA key"):
        load_identity_key(corrupt)
    with pytest.raises(FileNotFoundError, match="identity file not found"):
        load_identity_key(tmp_path / "missing.id")


def test_make_authorizer_open_swarm_and_config_errors(files):
    assert make_authorizer(None, None, files["identity"]) is None, "no auth arguments: the swarm stays open"
    with pytest.raises(ValueError, match="--authority_public_key_path is set but --auth_token_path is not"):
        make_authorizer(None, files["authority_pub"], files["identity"])
    with pytest.raises(ValueError, match="--auth_token_path is set but --authority_public_key_path is not"):
        make_authorizer(files["token"], None, files["identity"])
    with pytest.raises(ValueError, match="--auth_token_path needs --identity_path"):
        make_authorizer(files["token"], files["authority_pub"], None)
    authorizer = make_authorizer(files["token"], files["authority_pub"], files["identity"])
    assert authorizer.local_public_key.to_bytes() == files["key"].get_public_key().to_bytes()


def test_make_authorizer_bad_files(tmp_path, files, keys, report):
    alice = files["key"].get_public_key()
    (tmp_path / "corrupt.token").write_text("####\n")
    tokens = {  # case -> the token file's content, as an AccessToken (None: leave as is or missing)
        "expired": issue_token(keys["authority"], alice, NOW - DAY),
        "other authority": issue_token(keys["other_authority"], alice, NOW + DAY),
        "bound to bob": issue_token(keys["authority"], keys["bob"].get_public_key(), NOW + DAY),
    }
    for case, token in tokens.items():
        save_token(token, tmp_path / f"{case}.token")
    expected = {
        "missing": (FileNotFoundError, "access token file not found"),
        "corrupt": (InvalidTokenError, "is not an access token"),
        "expired": (TokenExpiredError, "expired at"),
        "other authority": (InvalidTokenError, "not signed by this swarm's authority"),
        "bound to bob": (InvalidTokenError, "bound to key .* not to this peer's identity key"),
    }
    for case, (error, message) in expected.items():
        with pytest.raises(error, match=message):
            make_authorizer(tmp_path / f"{case}.token", files["authority_pub"], files["identity"])
        report(f"startup, {case} token: {error.__name__} ({message})")

    with pytest.raises(FileNotFoundError, match="authority public key file not found"):
        make_authorizer(files["token"], tmp_path / "nope.pub", files["identity"])
    (tmp_path / "empty.id").write_bytes(b"")
    with pytest.raises(KeyFileError, match="identity file .* is empty"):
        make_authorizer(files["token"], files["authority_pub"], tmp_path / "empty.id")


def _authorizer(tmp_path, name, key, authority, expires_at=NOW + DAY, **kwargs) -> SwarmAuthorizer:
    save_token(issue_token(authority, key.get_public_key(), expires_at, name), tmp_path / f"{name}.token")
    return SwarmAuthorizer(key, authority.get_public_key(), tmp_path / f"{name}.token", **kwargs)


def test_authorizer_request_protocol(tmp_path, keys, report):
    """Client bob -> servicer alice over real DHT protobufs, then what an outsider can do with what it sees."""
    authority = keys["authority"]
    alice = _authorizer(tmp_path, "alice", keys["alice"], authority)
    bob = _authorizer(tmp_path, "bob", keys["bob"], authority)

    async def run():
        request = dht_pb2.PingRequest(validate=True)
        await bob.sign_request(request, service_public_key=None)
        signed = request.SerializeToString()
        assert await alice.validate_request(dht_pb2.PingRequest.FromString(signed)), "a token holder is admitted"
        assert not await alice.validate_request(dht_pb2.PingRequest.FromString(signed)), "a replay is refused"

        response = dht_pb2.PingResponse(available=True)
        await alice.sign_response(response, request)
        assert await bob.validate_response(response, request), "the token holder's response is accepted"

        # an outsider copies bob's token (it travels with every request) and signs with its own key
        stolen = dht_pb2.PingRequest(validate=True)
        stolen.auth.CopyFrom(dht_pb2.PingRequest.FromString(signed).auth)
        stolen.auth.nonce, stolen.auth.signature = b"fresh-nonce", b""
        stolen.auth.signature = keys["other_authority"].sign(stolen.SerializeToString())
        assert not await alice.validate_request(stolen), "bob's token signed by another key is refused"

        tampered = dht_pb2.PingRequest.FromString(signed)
        tampered.auth.nonce, tampered.validate = b"other-nonce", False
        assert not await alice.validate_request(tampered), "a request changed after signing is refused"

        assert not await alice.validate_request(dht_pb2.PingRequest(validate=True)), "no token is refused"
        forged_response = dht_pb2.PingResponse(available=True)
        forged_response.auth.service_access_token.CopyFrom(response.auth.service_access_token)
        forged_response.auth.nonce = request.auth.nonce
        forged_response.auth.signature = keys["other_authority"].sign(forged_response.SerializeToString())
        assert not await bob.validate_response(forged_response, request), "a response in alice's name is refused"

    asyncio.run(run())
    report("protocol: holder admitted; replay, stolen token, tampering, no token and forged response refused")


def test_authorizer_picks_up_renewed_token_and_loses_access_on_expiry(tmp_path, keys, report):
    """A token within refresh_margin of expiry is re-read from its file, so an owner can renew a running peer."""
    authority = keys["authority"]
    alice = _authorizer(tmp_path, "alice", keys["alice"], authority, expires_at=NOW + DAY,
                        refresh_margin=4 * DAY)  # every token counts as expiring soon: re-read on each request
    renewed = issue_token(authority, keys["alice"].get_public_key(), NOW + 3 * DAY, "alice")

    async def sign() -> str:
        request = dht_pb2.PingRequest()
        await alice.sign_request(request, None)
        return request.auth.client_access_token.expiration_time

    async def run():
        assert await sign() == (NOW + DAY).isoformat(timespec="seconds")
        save_token(renewed, tmp_path / "alice.token")
        assert await sign() == renewed.expiration_time, "the renewed token from the file is used"
        save_token(issue_token(authority, keys["alice"].get_public_key(), NOW - DAY), tmp_path / "alice.token")
        with pytest.raises(TokenExpiredError):
            await sign()

    asyncio.run(run())
    report("renewal: new token file picked up while running; an expired one cuts the peer off")
