"""Access tokens: an authority-signed, expiring grant bound to one peer's public key, sent as one line of base64.
The signed body is domain-separated, so an authority signature can never be replayed as another kind of signature
made with the same key."""
from __future__ import annotations

import base64
import binascii
import re
from datetime import datetime, timedelta, timezone
from typing import Optional, Union

from cryptography.exceptions import UnsupportedAlgorithm
from google.protobuf.message import DecodeError
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer

from lean_transformer.swarm.auth.keys import PathLike, key_fingerprint, read_file, write_atomic

_TOKEN_DOMAIN = "lean_transformer.swarm.auth/access-token/v1"  # the wire format's name: unchanged by the file split
_MAX_NAME_LENGTH = 100
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class InvalidTokenError(ValueError):
    """An access token is malformed, not signed by the swarm authority, or bound to another peer's key."""


class TokenExpiredError(InvalidTokenError):
    """An access token was valid but its expiration time has passed."""


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
    write_atomic(path, (encode_token(token) + "\n").encode(), mode=0o644, overwrite=True)


def load_token(path: PathLike) -> AccessToken:
    return decode_token(read_file(path, "access token file"), source=f"access token file {path}")
