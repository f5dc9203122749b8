"""Revoking identities: an authority-signed list of peer IDs that every peer of an authorized swarm refuses, even
while their access tokens are still valid.

The list holds peer IDs (libp2p's hash of the identity key a token is bound to), not keys or tokens: a peer ID is
what an owner sees in logs, events and metrics, the averagers' gate knows callers only by it, and a token's key maps
to it in one hash (:func:`~lean_transformer.swarm.auth.averaging_gate.peer_id_of`); so revoking an identity revokes
every token ever issued for its key. A list is cumulative and carries its issue time: a newer list supersedes an
older one, and a peer ignores (with one log line) a list that is older than the one it holds, signed by another
authority, tampered with or malformed. The signed body is domain-separated from access tokens (same key).

How the list travels: ``python -m lean_transformer.swarm.auth revoke`` (:mod:`.cli`) merges the new identities into
the newest list it finds in the DHT (and in its optional local copy), signs it and stores it under
``{run_id}_revoked_identities``, a dictionary record whose subkey is the publisher's record owner key (hivemind's
``RSASignatureValidator``): a token holder can add entries but never replace another's, so a malicious member
cannot hide a list by overwriting it. Every authorized peer runs a :class:`RevocationWatcher` that reads the record
every ``POLL_PERIOD`` s, installs the newest valid list in its DHT authorizer (which then refuses the revoked peers'
DHT requests and responses) and tells its averagers' gates (which refuse their averaging and state-download
requests). Every peer, not only the aux peer, re-publishes its list when the DHT's copy is missing, older or about
to expire: the list survives the CLI's exit and any single peer, as long as one peer of the swarm is alive.

A revoked peer may still read the revocation record, and nothing else (:meth:`SwarmAuthorizer.validate_request`):
otherwise the other peers, refusing its DHT requests, would hide from it why it lost access; its watcher then
raises :class:`IdentityRevokedError` in its training loop and it exits with one line.
"""
from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from lean_transformer.swarm.auth.keys import PathLike, read_file, write_atomic
from lean_transformer.swarm.monitoring.events import emit

logger = logging.getLogger(__name__)

_DOMAIN = "lean_transformer.swarm.auth/revocation-list/v1"
POLL_PERIOD = 15.0  # seconds between a peer's reads of the list: with DHT latency, refusal comes within 60 s
RECORD_TTL = 600.0  # seconds a published list lives in the DHT; peers renew it once it expires within REFRESH_MARGIN
REFRESH_MARGIN = 4 * POLL_PERIOD
MAX_REVOKED = 100_000  # identities in one list: bounds what a peer verifies and keeps


class InvalidRevocationListError(ValueError):
    """A revocation list is malformed, or not signed by this swarm's authority (or modified after signing)."""


class IdentityRevokedError(ValueError):
    """This peer's own identity is in the swarm authority's revocation list: it can no longer take part."""


def revocation_key(run_id: str) -> str:
    """The DHT key of the run's revocation lists (subkeys: their publishers' record owner keys)."""
    return f"{run_id}_revoked_identities"


def revocation_dht_id(run_id: str) -> bytes:
    """The DHT ID that a find request for the revocation record asks for (see :func:`revocation_key`)."""
    return DHTID.generate(source=revocation_key(run_id)).to_bytes()


def parse_peer_id(text: str, source: str = "peer ID") -> PeerID:
    """The base58 peer ID of an RSA identity (``Qm...``, as every peer of an authorized swarm has); raises ValueError
    naming ``source`` otherwise."""
    error = ValueError(f"{source} {text!r} is not the peer ID of an RSA identity (base58, like Qm...)")
    try:
        peer_id = PeerID.from_base58(text.strip())
    except Exception:  # base58 decoding raises assorted errors
        raise error from None
    raw = peer_id.to_bytes()  # RSA keys are too long to inline: their IDs are sha2-256 multihashes (0x12 0x20)
    if peer_id.to_base58() != text.strip() or raw[:2] != b"\x12\x20" or len(raw) != 34:
        raise error
    return peer_id


@dataclass(frozen=True)
class RevocationList:
    """The revoked peer IDs (base58) as of ``issued_at`` (Unix time, the authority's clock), and the signature."""

    issued_at: float
    revoked: frozenset[str]
    signature: bytes = b""

    def _body(self) -> bytes:
        return MSGPackSerializer.dumps([_DOMAIN, float(self.issued_at), sorted(self.revoked)])

    def verify(self, authority_public_key: RSAPublicKey) -> "RevocationList":
        """Return self if signed by the authority; raise InvalidRevocationListError otherwise."""
        if not authority_public_key.verify(self._body(), self.signature):
            raise InvalidRevocationListError("revocation list is not signed by this swarm's authority (or was modified "
                                             "after signing)")
        return self

    def to_dht_value(self) -> dict:
        return dict(issued_at=float(self.issued_at), revoked=sorted(self.revoked), signature=self.signature)

    @classmethod
    def from_dht_value(cls, value: Any) -> "RevocationList":
        """Parse a DHT value (or a decoded local file); raises InvalidRevocationListError if it is malformed."""
        if not isinstance(value, dict) or set(value) != {"issued_at", "revoked", "signature"}:
            raise InvalidRevocationListError("revocation list is malformed (expected issued_at, revoked, signature)")
        issued_at, revoked, signature = value["issued_at"], value["revoked"], value["signature"]
        if not isinstance(issued_at, (int, float)) or isinstance(issued_at, bool) or issued_at != issued_at:
            raise InvalidRevocationListError("revocation list's issued_at is not a time")
        if not isinstance(revoked, (list, tuple)) or len(revoked) > MAX_REVOKED or \
                not all(isinstance(peer, str) for peer in revoked):
            raise InvalidRevocationListError(f"revocation list's revoked is not a list of at most {MAX_REVOKED} "
                                             f"peer IDs")
        if not isinstance(signature, bytes):
            raise InvalidRevocationListError("revocation list's signature is not bytes")
        return cls(float(issued_at), frozenset(revoked), signature)

    def describe(self) -> str:
        return f"{len(self.revoked)} revoked identit{'y' if len(self.revoked) == 1 else 'ies'}, issued at " \
               f"{self.issued_at:.3f}"


def sign_revocations(authority: RSAPrivateKey, revoked: Iterable[Union[str, PeerID]],
                     issued_at: float) -> RevocationList:
    """Sign the list of ``revoked`` peer IDs (base58 or PeerID) as of ``issued_at`` (Unix time)."""
    peers = frozenset(str(peer) if isinstance(peer, PeerID) else parse_peer_id(peer).to_base58() for peer in revoked)
    if len(peers) > MAX_REVOKED:
        raise ValueError(f"a revocation list holds at most {MAX_REVOKED} identities, got {len(peers)}")
    unsigned = RevocationList(float(issued_at), peers)
    return RevocationList(unsigned.issued_at, peers, authority.sign(unsigned._body()))


def merge_revocations(authority: RSAPrivateKey, lists: Iterable[Optional[RevocationList]],
                      new: Iterable[Union[str, PeerID]], now: float) -> RevocationList:
    """One list revoking everything that ``lists`` and ``new`` revoke, issued after all of them (so that it
    supersedes each, even if the authority's clock went back)."""
    known = [item for item in lists if item is not None]
    revoked = set(new).union(*(item.revoked for item in known))
    issued_at = max([now, *(item.issued_at + 0.001 for item in known)])
    return sign_revocations(authority, revoked, issued_at)


def newest_revocations(entries: Any, authority_public_key: RSAPublicKey,
                       on_invalid: Callable[[bytes, str], None] = lambda subkey, reason: None
                       ) -> tuple[Optional[RevocationList], float]:
    """The newest list signed by the authority among a DHT record's entries (``{subkey: ValueWithExpiration}``, as
    ``DHT.get`` returns a dictionary record; anything else counts as no entry), and the latest expiration of the
    entries that hold it (0 if none). Each invalid entry is reported to ``on_invalid(subkey, reason)``."""
    newest, expiration = None, 0.0
    if not isinstance(entries, dict):
        return None, 0.0
    for subkey, item in entries.items():
        try:
            candidate = RevocationList.from_dht_value(getattr(item, "value", None)).verify(authority_public_key)
        except InvalidRevocationListError as e:
            on_invalid(subkey if isinstance(subkey, bytes) else repr(subkey).encode(), str(e))
            continue
        item_expiration = float(getattr(item, "expiration_time", 0.0))
        if newest is None or candidate.issued_at > newest.issued_at:
            newest, expiration = candidate, item_expiration
        elif candidate == newest:
            expiration = max(expiration, item_expiration)
    return newest, expiration


def save_revocations(revocations: RevocationList, path: PathLike) -> None:
    """The owner's local copy (not secret: peers read the same list from the DHT)."""
    write_atomic(path, MSGPackSerializer.dumps(revocations.to_dht_value()), mode=0o644, overwrite=True)


def load_revocations(path: PathLike, authority_public_key: RSAPublicKey) -> RevocationList:
    data = read_file(path, "revocation list file")
    try:
        value = MSGPackSerializer.loads(data)
    except Exception:  # msgpack raises assorted errors on garbage
        raise InvalidRevocationListError(f"revocation list file {path} is not a revocation list") from None
    try:
        return RevocationList.from_dht_value(value).verify(authority_public_key)
    except InvalidRevocationListError as e:
        raise InvalidRevocationListError(f"revocation list file {path}: {e}") from None


def publish_revocations(dht: hivemind.DHT, run_id: str, revocations: RevocationList, owner: bytes,
                        ttl: float = RECORD_TTL, timeout: Optional[float] = None) -> bool:
    """Store ``revocations`` under this peer's subkey ``owner`` (its record owner key); whether a peer stored it."""
    future = dht.store(revocation_key(run_id), revocations.to_dht_value(), get_dht_time() + ttl, subkey=owner,
                       return_future=True)
    return bool(future.result(timeout=timeout))


# ---------------------------------------------------------------- inside the DHT process


async def _install_in_authorizer(_dht: hivemind.DHT, node: Any, revoked: frozenset[str], issued_at: float) -> bool:
    """Runs in the DHT process: hand the revoked peer IDs to its authorizer; False if it has none of ours."""
    install = getattr(node.protocol.authorizer, "install_revocations", None)
    if install is None:
        return False
    install(revoked, issued_at)
    return True


async def revoked_peer_ids(_dht: hivemind.DHT, node: Any) -> frozenset[str]:
    """Runs in the DHT process: the peer IDs its authorizer refuses as revoked (for the averagers' gates, which run in
    processes of their own and ask through ``DHT.run_coroutine``)."""
    return frozenset(getattr(node.protocol.authorizer, "revoked_peer_ids", frozenset()))


# ---------------------------------------------------------------- the watcher


class RevocationWatcher:
    """Reads the run's revocation record every ``period`` s in a background thread; installs each newer valid list
    in the DHT's authorizer (which the averagers' gates ask), logs one line and emits one ``identity_revoked`` event
    per newly revoked identity, re-publishes the list when the DHT's copy is missing, older or about to expire, and
    remembers whether this peer itself was revoked (:meth:`raise_if_revoked`, called by the peer's loop).

    :param owner: this peer's record owner key (``RSASignatureValidator.local_public_key``), the subkey it publishes
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, authority_public_key: RSAPublicKey, owner: bytes,
                 period: float = POLL_PERIOD):
        self.dht, self.run_id, self.owner, self.period = dht, run_id, owner, period
        self._authority_public_key = authority_public_key
        self._own_peer_id = str(dht.peer_id)
        self.current: Optional[RevocationList] = None
        self.revoked_self: Optional[IdentityRevokedError] = None
        self._reported: set[tuple[bytes, str]] = set()  # invalid or outdated entries already logged
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="revocation-watcher", daemon=True)

    def start(self) -> "RevocationWatcher":
        """Read the list once (a revoked peer raises IdentityRevokedError here, before it trains), then keep
        watching."""
        try:
            self.check()
        except Exception as error:  # a DHT hiccup: the thread tries again
            logger.debug(f"Could not read the revocation list: {error!r}")
        self.raise_if_revoked()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def raise_if_revoked(self) -> None:
        if self.revoked_self is not None:
            raise self.revoked_self

    def check(self) -> None:
        """One read of the record: install a newer list, re-publish if needed."""
        entry = self.dht.get(revocation_key(self.run_id), latest=True)
        entries = entry.value if entry is not None else None
        newest, expiration = newest_revocations(entries, self._authority_public_key, self._report_invalid)
        if newest is not None and (self.current is None or newest.issued_at > self.current.issued_at):
            self._install(newest)
        elif newest is not None and newest.issued_at < self.current.issued_at:
            self._report_once(b"", f"newest in the DHT issued at {newest.issued_at:.3f}",
                              f"Ignoring the DHT's revocation list issued at {newest.issued_at:.3f}: this peer holds a "
                              f"newer one (issued at {self.current.issued_at:.3f}); re-publishing it")
        if self.current is not None and (newest is None or newest.issued_at < self.current.issued_at
                                         or expiration - get_dht_time() < REFRESH_MARGIN):
            publish_revocations(self.dht, self.run_id, self.current, self.owner, timeout=self.period)

    def _install(self, revocations: RevocationList) -> None:
        install = functools.partial(_install_in_authorizer, revoked=revocations.revoked,
                                    issued_at=revocations.issued_at)
        if not self.dht.run_coroutine(install):
            raise RuntimeError("the DHT has no swarm authorizer to install the revocation list in")
        added = sorted(revocations.revoked - (self.current.revoked if self.current is not None else frozenset()))
        self.current = revocations
        for peer in added:
            if peer == self._own_peer_id:
                self.revoked_self = IdentityRevokedError(  # the peer's one line, when its loop raises it
                    f"the swarm authority revoked this peer's identity {peer} (revocation list issued at "
                    f"{revocations.issued_at:.3f}): it can no longer take part; ask the swarm owner")
            else:
                logger.warning(f"Identity {peer} was revoked by the swarm authority: refusing its DHT requests, "
                               f"averaging and state downloads from now on")
            emit("identity_revoked", source=peer, issued_at=revocations.issued_at, own=peer == self._own_peer_id)

    def _report_invalid(self, subkey: bytes, reason: str) -> None:
        self._report_once(subkey, reason, f"Ignoring an entry of the revocation record: {reason}")

    def _report_once(self, subkey: bytes, reason: str, message: str) -> None:
        if (subkey, reason) not in self._reported:
            if len(self._reported) >= 1000:  # garbage under ever new subkeys must not grow it without bound
                self._reported.clear()
            self._reported.add((subkey, reason))
            logger.warning(message)

    def _watch(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.check()
            except Exception as error:  # a DHT hiccup or garbage from it: try again at the next period
                logger.debug(f"Could not read the revocation list: {error!r}")

