"""Swarm access control with no external server: an authority key, expiring access tokens, and the hivemind
authorizer that admits only DHT requests signed by peers holding a valid token.

How a swarm owner and a volunteer use it::

    # owner, once per swarm: the private key stays with the owner, authority.pub is handed to every peer
    python -m lean_transformer.swarm.auth new-authority --out authority.pem
    # volunteer: create (or reuse) the peer identity and send the printed public key to the owner
    python -m lean_transformer.swarm.auth peer-key --identity_path identity.key
    # owner: issue a token bound to that public key and send the token file back
    python -m lean_transformer.swarm.auth issue-token --authority authority.pem \
        --peer-public-key "ssh-rsa AAAA..." --expires-in 7d --name alice --out alice.token
    # volunteer: run_trainer.py ... --identity_path identity.key --auth_token_path alice.token \
    #     --authority_public_key_path authority.pub

One key per peer. The identity file (``--identity_path``, the RSA key in libp2p's format that hivemind writes) is
at once the peer's libp2p peer ID, the key that signs its DHT records (hivemind's ``RSASignatureValidator``, so its
metrics record is its own), and the key its access token is bound to. hivemind would otherwise use
``RSAPrivateKey.process_wide()``, a fresh random key per process, for the latter two: then a token could not be
issued ahead of time and a restarted peer would publish its metrics under a new owner key. So a DHT built with
authorization passes :func:`load_identity_key`'s key both to ``RSASignatureValidator`` and (through
:func:`make_authorizer`) to the authorizer.

What it covers: every DHT request and response (hivemind's ``AuthorizerBase`` hook in ``DHTProtocol``), so a peer
without a valid token can neither store nor read the swarm's records, and honest peers never put it in their
routing tables; and every averaging request (joining a group, all-reduce parts, state downloads), which hivemind
1.1.12 does not sign: each peer publishes its token in the DHT under its peer ID, and its averagers serve only
callers whose libp2p-authenticated peer ID has a valid token there (:mod:`lean_transformer.swarm.averaging_gate`).
So an outsider that learns a trainer's address, peer ID and the run's group keys elsewhere and calls its averagers
directly is refused, and one token holder cannot pass its token on to another key.

Peers' clocks must agree within a minute (use NTP): hivemind refuses requests whose timestamp is further off, as
replay protection, and token expiry is checked against each peer's own clock.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import os
import re
import sys
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import NoReturn, Optional, Sequence, Union

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.protobuf.message import DecodeError
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.logging import get_logger
from hivemind.utils.serializer import MSGPackSerializer

logger = get_logger(__name__)

PathLike = Union[str, os.PathLike]

# Prefixed to every signed token body so that an authority signature can never be replayed as another kind of
# signature made with the same key (and vice versa).
_TOKEN_DOMAIN = "lean_transformer.swarm.auth/access-token/v1"
_MAX_NAME_LENGTH = 100
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class KeyFileError(ValueError):
    """A key file exists but does not hold the expected key."""


class InvalidTokenError(ValueError):
    """An access token is malformed, not signed by the swarm authority, or bound to another peer's key."""


class TokenExpiredError(InvalidTokenError):
    """An access token was valid but its expiration time has passed."""


# ---------------------------------------------------------------- keys


def _wrap_private_key(key: rsa.RSAPrivateKey) -> RSAPrivateKey:
    """hivemind 1.1.12 has no ``RSAPrivateKey.from_bytes``; its pickling protocol rebuilds one from DER."""
    wrapped = RSAPrivateKey.__new__(RSAPrivateKey)
    der = key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )
    wrapped.__setstate__({"_private_key": der})
    return wrapped


def _read_file(path: PathLike, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"{what} is a directory, not a file: {path}") from None


def _write_atomic(path: PathLike, data: bytes, mode: int, overwrite: bool) -> None:
    """Write via a temporary file and a rename, so a crash never leaves a half-written key or token behind."""
    path = Path(path)
    if not overwrite and path.exists():
        raise FileExistsError(f"{path} already exists; refusing to overwrite it")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"directory {path.parent} does not exist (for {path})")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            os.fchmod(file.fileno(), mode)
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def public_key_text(key: Union[RSAPrivateKey, RSAPublicKey]) -> str:
    """The one-line OpenSSH form (``ssh-rsa AAAA...``) in which public keys are exchanged and bound to tokens."""
    if isinstance(key, RSAPrivateKey):
        key = key.get_public_key()
    return key.to_bytes().decode()


def key_fingerprint(key: Union[RSAPublicKey, bytes]) -> str:
    """The ``SHA256:...`` fingerprint that ``ssh-keygen -l`` would print: short enough to compare by eye in logs."""
    serialized = key.to_bytes() if isinstance(key, RSAPublicKey) else key
    blob = base64.b64decode(serialized.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def parse_public_key(text: Union[str, bytes], source: str = "public key") -> RSAPublicKey:
    """Parse an OpenSSH ``ssh-rsa ...`` line; raises KeyFileError naming ``source`` if it is not one."""
    data = text.encode() if isinstance(text, str) else text
    try:
        return RSAPublicKey.from_bytes(data.strip())
    except (ValueError, UnsupportedAlgorithm, IndexError) as e:
        raise KeyFileError(f"{source} is not an RSA public key in OpenSSH format ('ssh-rsa AAAA...'): {e}") from None


def load_public_key(path: PathLike, what: str = "public key file") -> RSAPublicKey:
    return parse_public_key(_read_file(path, what), source=f"{what} {path}")


def save_public_key(key: Union[RSAPrivateKey, RSAPublicKey], path: PathLike, overwrite: bool = False) -> None:
    _write_atomic(path, (public_key_text(key) + "\n").encode(), mode=0o644, overwrite=overwrite)


def save_authority_key(key: RSAPrivateKey, path: PathLike) -> None:
    """Write the authority's private key as unencrypted PKCS#8 PEM, readable by its owner only; never overwrites."""
    pem = serialization.load_der_private_key(key.to_bytes(), password=None).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write_atomic(path, pem, mode=0o600, overwrite=False)


def load_authority_key(path: PathLike) -> RSAPrivateKey:
    data = _read_file(path, "authority key file")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise KeyFileError(f"authority key file {path} is not an unencrypted PEM private key") from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise KeyFileError(f"authority key file {path} holds a {type(key).__name__}, expected an RSA key")
    return _wrap_private_key(key)


def load_identity_key(path: PathLike, create: bool = False) -> RSAPrivateKey:
    """Load the peer's identity key from a libp2p identity file, the format hivemind's ``identity_path`` uses.

    :param create: write a new identity (with hivemind's own generator) if the file does not exist yet
    """
    path = Path(path)
    if create and not path.exists():
        if not path.parent.is_dir():
            raise FileNotFoundError(f"directory {path.parent} for the identity file {path} does not exist")
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
            P2P.generate_identity(os.path.join(tmp, "identity"))
            os.replace(os.path.join(tmp, "identity"), path)
    data = _read_file(path, "identity file")
    if not data:
        raise KeyFileError(f"identity file {path} is empty")
    try:
        proto = crypto_pb2.PrivateKey.FromString(data)
    except DecodeError:
        raise KeyFileError(f"identity file {path} is not a libp2p private key") from None
    if proto.key_type != crypto_pb2.KeyType.RSA:
        raise KeyFileError(
            f"identity file {path} holds a {crypto_pb2.KeyType.Name(proto.key_type)} key; swarm authorization needs "
            f"an RSA identity (create one with `python -m lean_transformer.swarm.auth peer-key --identity_path NEW`)"
        )
    try:
        key = serialization.load_der_private_key(proto.data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise KeyFileError(f"identity file {path} holds a corrupt RSA key: {e}") from None
    return _wrap_private_key(key)


# ---------------------------------------------------------------- tokens


def parse_duration(text: str) -> timedelta:
    """Parse a positive duration such as ``90s``, ``15m``, ``12h``, ``7d`` or ``2w``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if match is None:
        raise ValueError(f"expires-in: {text!r} is not a duration like 90s, 15m, 12h, 7d or 2w")
    duration = timedelta(seconds=float(match.group(1)) * _DURATION_UNITS[match.group(2)])
    if duration <= timedelta(0):
        raise ValueError(f"expires-in: {text!r} must be a positive duration")
    return duration


def _signed_body(token: AccessToken) -> bytes:
    return MSGPackSerializer.dumps([_TOKEN_DOMAIN, token.username, token.public_key, token.expiration_time])


def token_expiration(token: AccessToken) -> datetime:
    """The token's expiration time as an aware UTC datetime; raises InvalidTokenError if it is malformed."""
    try:
        expiration = datetime.fromisoformat(token.expiration_time)
    except ValueError:
        raise InvalidTokenError(f"token expiration_time {token.expiration_time!r} is not an ISO 8601 time") from None
    if expiration.tzinfo is None:
        raise InvalidTokenError(f"token expiration_time {token.expiration_time!r} has no time zone")
    return expiration.astimezone(timezone.utc)


def issue_token(
    authority: RSAPrivateKey, peer_public_key: RSAPublicKey, expires_at: datetime, name: str = ""
) -> AccessToken:
    """Sign an access token that admits the holder of ``peer_public_key``'s private key until ``expires_at``.

    :param name: a human-readable label for the peer (shown in logs and by ``show-token``), not checked by peers
    """
    if expires_at.tzinfo is None:
        raise ValueError("expires_at must be a timezone-aware datetime")
    if len(name) > _MAX_NAME_LENGTH or not name.isprintable():
        raise ValueError(f"name must be at most {_MAX_NAME_LENGTH} printable characters, got {name!r}")
    token = AccessToken(
        username=name,
        public_key=peer_public_key.to_bytes(),  # normalized: the OpenSSH line without a comment
        expiration_time=expires_at.astimezone(timezone.utc).isoformat(timespec="seconds"),
    )
    token.signature = authority.sign(_signed_body(token))
    return token


def check_token(
    token: AccessToken,
    authority_public_key: RSAPublicKey,
    *,
    peer_public_key: Optional[RSAPublicKey] = None,
    now: Optional[datetime] = None,
) -> None:
    """Raise InvalidTokenError unless ``token`` is signed by the authority, unexpired and (if given) bound to
    ``peer_public_key``; TokenExpiredError if only its expiration time has passed."""
    if not authority_public_key.verify(_signed_body(token), token.signature):
        raise InvalidTokenError("token is not signed by this swarm's authority (or was modified after signing)")
    try:
        holder = RSAPublicKey.from_bytes(token.public_key)
    except (ValueError, UnsupportedAlgorithm, IndexError):
        raise InvalidTokenError("token's public_key is not an RSA public key") from None
    if peer_public_key is not None and holder.to_bytes() != peer_public_key.to_bytes():
        raise InvalidTokenError(
            f"token is bound to key {key_fingerprint(holder)}, not to this peer's identity key "
            f"{key_fingerprint(peer_public_key)}"
        )
    expiration = token_expiration(token)
    if expiration <= (now or datetime.now(timezone.utc)):
        raise TokenExpiredError(f"token expired at {expiration.isoformat()}")


def encode_token(token: AccessToken) -> str:
    """One line of base64, easy to send by chat or e-mail."""
    return base64.b64encode(token.SerializeToString()).decode()


def decode_token(text: Union[str, bytes], source: str = "token") -> AccessToken:
    try:
        token = AccessToken.FromString(base64.b64decode(text.strip(), validate=True))
    except (binascii.Error, DecodeError, ValueError):
        raise InvalidTokenError(f"{source} is not an access token (expected one line of base64)") from None
    if not token.public_key or not token.signature or not token.expiration_time:
        raise InvalidTokenError(f"{source} is not an access token (public_key, signature or expiration missing)")
    return token


def save_token(token: AccessToken, path: PathLike) -> None:
    # not secret: a token is useless without the private key it is bound to, and is sent with every request
    _write_atomic(path, (encode_token(token) + "\n").encode(), mode=0o644, overwrite=True)


def load_token(path: PathLike) -> AccessToken:
    return decode_token(_read_file(path, "access token file"), source=f"access token file {path}")


# ---------------------------------------------------------------- authorizer


class SwarmAuthorizer(TokenAuthorizerBase):
    """Signs this peer's DHT requests and responses with its identity key and token, and admits only counterparts
    whose token is signed by the swarm authority and unexpired. The request/response signatures, nonces and clock
    checks are hivemind's ``TokenAuthorizerBase``; this class supplies the token policy.

    The token file is re-read when the current token is within ``refresh_margin`` of its expiration, so an owner can
    renew a running peer's access by overwriting its token file.
    """

    def __init__(
        self,
        identity_key: RSAPrivateKey,
        authority_public_key: RSAPublicKey,
        token_path: PathLike,
        refresh_margin: timedelta = timedelta(minutes=5),
    ):
        super().__init__(identity_key)
        self._authority_public_key = authority_public_key
        self._token_path = Path(token_path)
        self._refresh_margin = refresh_margin
        self._last_warning: Optional[str] = None
        token = self._load_own_token()  # fail at startup, not at the first request
        logger.info(
            f"Swarm authorization on: token {token.username!r} for {key_fingerprint(self.local_public_key)} "
            f"valid until {token_expiration(token).isoformat()}"
        )

    def _load_own_token(self) -> AccessToken:
        token = load_token(self._token_path)
        check_token(token, self._authority_public_key, peer_public_key=self.local_public_key)
        return token

    async def get_token(self) -> AccessToken:
        try:
            return self._load_own_token()
        except (OSError, ValueError) as e:
            message = (
                f"This peer has lost access to the swarm: {e}. "
                f"Ask the swarm owner for a new token and write it to {self._token_path}"
            )
            if message != self._last_warning:  # once per distinct problem, not once per request
                logger.warning(message)
                self._last_warning = message
            raise

    def is_token_valid(self, access_token: AccessToken) -> bool:
        try:
            check_token(access_token, self._authority_public_key)
        except InvalidTokenError as e:
            logger.debug(f"Rejected a counterpart's access token: {e}")
            return False
        return True

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return token_expiration(access_token) - datetime.now(timezone.utc) < self._refresh_margin


def make_authorizer(
    token_path: Optional[PathLike], authority_public_key_path: Optional[PathLike], identity_path: Optional[PathLike]
) -> Optional[SwarmAuthorizer]:
    """The authorizer for ``hivemind.DHT(authorizer=...)``, or None for an open swarm (neither path given).

    Raises at startup if the configuration is incomplete, a file is missing or corrupt, or the token is expired,
    signed by another authority or bound to a key other than the identity's.
    """
    if token_path is None and authority_public_key_path is None:
        return None
    if token_path is None:
        raise ValueError("--authority_public_key_path is set but --auth_token_path is not: a peer needs both")
    if authority_public_key_path is None:
        raise ValueError("--auth_token_path is set but --authority_public_key_path is not: a peer needs both")
    if identity_path is None:
        raise ValueError("--auth_token_path needs --identity_path: the access token is bound to that identity's key")
    authority_public_key = load_public_key(authority_public_key_path, "authority public key file")
    return SwarmAuthorizer(load_identity_key(identity_path), authority_public_key, token_path)


# ---------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # one line instead of argparse's usage block; --help still shows the full usage
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _cmd_new_authority(args: argparse.Namespace) -> None:
    public_out = Path(args.public_out or Path(args.out).with_suffix(".pub"))
    for path in (Path(args.out), public_out):  # check both before writing either
        if path.exists():
            raise FileExistsError(f"{path} already exists; refusing to overwrite it")
    key = RSAPrivateKey()
    save_authority_key(key, args.out)
    save_public_key(key, public_out)
    print(public_key_text(key))
    print(f"authority key written to {args.out} (keep it private); give {public_out} to every peer", file=sys.stderr)


def _cmd_peer_key(args: argparse.Namespace) -> None:
    existed = Path(args.identity_path).exists()
    key = load_identity_key(args.identity_path, create=True)
    if args.out:
        save_public_key(key, args.out, overwrite=True)
    print(public_key_text(key))
    action = "using existing" if existed else "created"
    print(f"{action} identity {args.identity_path} ({key_fingerprint(key.get_public_key())}); send the public key "
          f"above to the swarm owner", file=sys.stderr)


def _cmd_issue_token(args: argparse.Namespace) -> None:
    expires_at = datetime.now(timezone.utc) + parse_duration(args.expires_in)
    authority = load_authority_key(args.authority)
    text = args.peer_public_key
    if text.startswith("ssh-"):
        peer_key = parse_public_key(text, source="--peer-public-key")
    else:
        peer_key = load_public_key(text, "peer public key file")
    token = issue_token(authority, peer_key, expires_at, name=args.name)
    if args.out:
        save_token(token, args.out)
        print(f"token {args.name!r} for {key_fingerprint(peer_key)} valid until {token.expiration_time} "
              f"written to {args.out}", file=sys.stderr)
    else:
        print(encode_token(token))


def _cmd_show_token(args: argparse.Namespace) -> None:
    token = load_token(args.token)
    print(f"name: {token.username!r}\nkey: {key_fingerprint(token.public_key)}\nexpires: {token.expiration_time}")
    if args.authority_public_key:
        check_token(token, load_public_key(args.authority_public_key, "authority public key file"))
        print("valid: signed by this authority and unexpired")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m lean_transformer.swarm.auth", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    new = commands.add_parser("new-authority", help="create the swarm's authority key pair (owner, once)")
    new.add_argument("--out", required=True, help="private key file to create (PEM, mode 0600)")
    new.add_argument("--public-out", help="public key file to create (default: --out with suffix .pub)")
    new.set_defaults(run=_cmd_new_authority)

    peer = commands.add_parser("peer-key", help="create or read a peer identity and print its public key")
    peer.add_argument("--identity_path", "--identity-path", required=True,
                      help="the peer's identity file (same as run_trainer.py --identity_path); created if missing")
    peer.add_argument("--out", help="also write the public key to this file")
    peer.set_defaults(run=_cmd_peer_key)

    issue = commands.add_parser("issue-token", help="issue an expiring access token for a peer's public key")
    issue.add_argument("--authority", required=True, help="authority private key file (from new-authority)")
    issue.add_argument("--peer-public-key", required=True, help="'ssh-rsa AAAA...' or a file holding it")
    issue.add_argument("--expires-in", required=True, help="validity, e.g. 12h, 7d, 2w")
    issue.add_argument("--name", default="", help="a label for the peer, shown in logs")
    issue.add_argument("--out", help="token file to write (default: print the token)")
    issue.set_defaults(run=_cmd_issue_token)

    show = commands.add_parser("show-token", help="print a token's holder and expiration, optionally verify it")
    show.add_argument("--token", required=True, help="access token file")
    show.add_argument("--authority-public-key", help="verify the token against this authority public key file")
    show.set_defaults(run=_cmd_show_token)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
