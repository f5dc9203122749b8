"""Key files of swarm authorization: the authority's key pair and each peer's identity key (libp2p's format, the
one hivemind's ``identity_path`` uses), read and written atomically, with one clear error per bad file."""
from __future__ import annotations

import base64
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Union

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.protobuf.message import DecodeError
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

PathLike = Union[str, os.PathLike]


class KeyFileError(ValueError):
    """A key file exists but does not hold the expected key."""


def _wrap_private_key(key: rsa.RSAPrivateKey) -> RSAPrivateKey:
    """hivemind 1.1.12 has no ``RSAPrivateKey.from_bytes``; its pickling protocol rebuilds one from DER."""
    wrapped = RSAPrivateKey.__new__(RSAPrivateKey)
    der = key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )
    wrapped.__setstate__({"_private_key": der})
    return wrapped


def read_file(path: PathLike, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"{what} is a directory, not a file: {path}") from None


def write_atomic(path: PathLike, data: bytes, mode: int, overwrite: bool) -> None:
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


def peer_id_of(public_key: Union[RSAPublicKey, bytes]) -> PeerID:
    """The libp2p peer ID of an RSA public key (an ``RSAPublicKey`` or its OpenSSH line, as tokens hold it): the
    sha2-256 multihash of the protobuf-wrapped DER key, as libp2p derives it (and ``PeerID.from_identity``)."""
    openssh = public_key.to_bytes() if isinstance(public_key, RSAPublicKey) else public_key
    der = serialization.load_ssh_public_key(openssh).public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    wrapped = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(b"\x12\x20" + hashlib.sha256(wrapped).digest())  # multihash: code 0x12 (sha2-256), 32 bytes


def parse_public_key(text: Union[str, bytes], source: str = "public key") -> RSAPublicKey:
    """Parse an OpenSSH ``ssh-rsa ...`` line; raises KeyFileError naming ``source`` if it is not one."""
    data = text.encode() if isinstance(text, str) else text
    try:
        return RSAPublicKey.from_bytes(data.strip())
    except (ValueError, UnsupportedAlgorithm, IndexError) as e:
        raise KeyFileError(f"{source} is not an RSA public key in OpenSSH format ('ssh-rsa AAAA...'): {e}") from None


def load_public_key(path: PathLike, what: str = "public key file") -> RSAPublicKey:
    return parse_public_key(read_file(path, what), source=f"{what} {path}")


def save_public_key(key: Union[RSAPrivateKey, RSAPublicKey], path: PathLike, overwrite: bool = False) -> None:
    write_atomic(path, (public_key_text(key) + "\n").encode(), mode=0o644, overwrite=overwrite)


def save_authority_key(key: RSAPrivateKey, path: PathLike) -> None:
    """Write the authority's private key as unencrypted PKCS#8 PEM, readable by its owner only; never overwrites."""
    pem = serialization.load_der_private_key(key.to_bytes(), password=None).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_atomic(path, pem, mode=0o600, overwrite=False)


def load_authority_key(path: PathLike) -> RSAPrivateKey:
    data = read_file(path, "authority key file")
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
    data = read_file(path, "identity file")
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
