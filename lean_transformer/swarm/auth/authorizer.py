"""The DHT authorizer: hivemind's ``TokenAuthorizerBase`` (request/response signatures, nonces, clock checks) with
this swarm's token policy and its revocation list (:mod:`.revocation`)."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Optional

from cryptography.exceptions import UnsupportedAlgorithm
from hivemind.proto import dht_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.logging import get_logger

from lean_transformer.swarm.auth.keys import (PathLike, key_fingerprint, load_identity_key, load_public_key,
                                              peer_id_of)
from lean_transformer.swarm.auth.revocation import revocation_dht_id
from lean_transformer.swarm.auth.tokens import InvalidTokenError, check_token, load_token, token_expiration

logger = get_logger(__name__)


class SwarmAuthorizer(TokenAuthorizerBase):
    """Signs this peer's DHT requests and responses with its identity key and token, and admits only counterparts
    whose token is signed by the swarm authority and unexpired. The request/response signatures, nonces and clock
    checks are hivemind's ``TokenAuthorizerBase``; this class supplies the token policy.

    The token file is re-read when the current token is within ``refresh_margin`` of its expiration, so an owner can
    renew a running peer's access by overwriting its token file.

    Revoked identities (installed by :class:`~lean_transformer.swarm.auth.revocation.RevocationWatcher` through
    :meth:`install_revocations`, inside the DHT process) are refused whatever their tokens say: their requests and
    their responses, except a find request for the revocation record alone (given ``run_id``), so that a revoked peer
    can learn why it was cut off.
    """

    def __init__(
        self,
        identity_key: RSAPrivateKey,
        authority_public_key: RSAPublicKey,
        token_path: PathLike,
        refresh_margin: timedelta = timedelta(minutes=5),
        run_id: Optional[str] = None,
    ):
        super().__init__(identity_key)
        self.revoked_peer_ids: frozenset[str] = frozenset()
        self._revocations_issued_at = float("-inf")
        self._holders: dict[bytes, str] = {}  # token key -> its peer ID (base58): one hash per key, not per request
        self._revocation_find = None if run_id is None else revocation_dht_id(run_id)
        self._refused: set[str] = set()  # revoked peers whose first refusal was logged
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

    def install_revocations(self, revoked: frozenset[str], issued_at: float) -> None:
        """Refuse the peers ``revoked`` (base58 peer IDs) from now on, unless this list is older than the one held."""
        if issued_at > self._revocations_issued_at:
            self.revoked_peer_ids, self._revocations_issued_at = frozenset(revoked), issued_at

    def _revoked_holder(self, token: AccessToken) -> Optional[str]:
        """The peer ID of ``token``'s key if that peer is revoked, else None."""
        if not self.revoked_peer_ids:
            return None
        holder = self._holders.get(token.public_key)
        if holder is None:
            try:
                holder = str(peer_id_of(token.public_key))
            except (ValueError, TypeError, IndexError, UnsupportedAlgorithm):
                return None  # not a key: the token check refuses it anyway
            if len(self._holders) >= 10_000:
                self._holders.clear()
            self._holders[token.public_key] = holder
        return holder if holder in self.revoked_peer_ids else None

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        revoked = self._revoked_holder(request.auth.client_access_token)
        if revoked is not None and not (isinstance(request, dht_pb2.FindRequest) and self._revocation_find is not None
                                        and list(request.keys) == [self._revocation_find]):
            if revoked not in self._refused:
                self._refused.add(revoked)
                logger.info(f"Refusing DHT requests of the revoked peer {revoked}")
            return False
        return await super().validate_request(request)

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        if self._revoked_holder(response.auth.service_access_token) is not None:
            return False
        return await super().validate_response(response, request)

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return token_expiration(access_token) - datetime.now(timezone.utc) < self._refresh_margin


def make_authorizer(
    token_path: Optional[PathLike], authority_public_key_path: Optional[PathLike], identity_path: Optional[PathLike],
    run_id: Optional[str] = None,
) -> Optional[SwarmAuthorizer]:
    """The authorizer for ``hivemind.DHT(authorizer=...)``, or None for an open swarm (neither path given).
    ``run_id``: the run whose revocation record a revoked peer may still read.

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
    return SwarmAuthorizer(load_identity_key(identity_path), authority_public_key, token_path, run_id=run_id)
