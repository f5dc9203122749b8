"""Averaging with token holders only: the part of swarm authorization that hivemind's authorizer does not cover.

hivemind 1.1.12 signs DHT requests (see :mod:`lean_transformer.swarm.auth`) but not the averagers' RPCs: anyone who
knows a peer's ID and the run's group keys could ask to join its averaging group, send it tensor parts or download
its state. Those RPCs do come with an identity, though: libp2p authenticates the remote peer ID of every stream,
and a peer ID is the hash of the peer's identity key, the very key its access token is bound to. So:

- every peer with authorization publishes its token in the DHT under a key named after its peer ID
  (:func:`publish_access_token`), which only token holders can read or write;
- its averagers (:class:`GatedGradientAverager`, :class:`GatedTrainingStateAverager` and DiLoCo's
  :class:`~lean_transformer.swarm.averaging.diloco.GatedPseudoGradientAverager`, all taking the gate as their ``gate``
  argument) answer a join, all-reduce or state download request only if the caller's peer ID has a token there that
  the swarm authority signed, that has not expired and whose key hashes to that peer ID (:class:`AveragingGate`);
  anyone else gets the protocol's refusal;
- a peer whose identity the swarm authority revoked (:mod:`.revocation`) is refused even with a valid token: the gate
  asks the DHT process for the revoked peer IDs (its authorizer holds the newest list) at most every
  ``REVOCATION_REFRESH`` s and checks them before its remembered verdicts, so revocation bites an admitted peer too.

:class:`lean_transformer.swarm.averaging.optimizer.SwarmOptimizer` runs the gated averagers only when it is given a
gate (authorization is configured); an open swarm speaks hivemind's own protocol unchanged. hivemind names an
averager's RPCs after its class, so the gated averagers are classes of their own (names unchanged on the wire).
"""
from __future__ import annotations

import asyncio
import functools
import os
import time
from datetime import datetime
from typing import AsyncIterator, Optional, Union

import hivemind
from hivemind.dht import DHTNode
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.asyncio import as_aiter
from hivemind.utils.crypto import RSAPublicKey
from hivemind.utils.logging import get_logger
from hivemind.utils.timed_storage import get_dht_time

from lean_transformer.swarm.auth.keys import peer_id_of
from lean_transformer.swarm.auth.revocation import revoked_peer_ids
from lean_transformer.swarm.auth.tokens import (InvalidTokenError, check_token, decode_token, encode_token, load_token,
                                                token_expiration)
from lean_transformer.swarm.averaging.averagers import GradientAverager, TrainingStateAverager
from lean_transformer.swarm.hivemind_fixes.stream_answers import answer_then_drain, lingering
from lean_transformer.swarm.monitoring.events import emit

logger = get_logger(__name__)

PUBLISH_PERIOD = 60.0  # seconds between re-publications of a peer's token (its DHT record lives twice as long)
REVOCATION_REFRESH = 5.0  # seconds between the gate's questions to the DHT process about revoked peers
REFUSAL_TTL = 5.0  # seconds a refusal is remembered: a stranger costs one DHT lookup per this period at most
_MAX_VERDICTS = 10_000  # remembered peers per averager, beyond which expired verdicts are dropped


def access_token_key(run_id: str, peer_id: PeerID) -> str:
    """The DHT key under which the peer ``peer_id`` publishes its access token (subkey: its record owner key)."""
    return f"{run_id}_access_token_{peer_id.to_base58()}"


def check_member_token(token: AccessToken, peer_id: PeerID, authority_public_key: RSAPublicKey, *,
                       now: Optional[datetime] = None) -> datetime:
    """Return the expiration of ``token`` if it admits the peer ``peer_id`` (signed by the authority, unexpired and
    bound to the key whose peer ID is ``peer_id``); raise InvalidTokenError (TokenExpiredError) otherwise."""
    check_token(token, authority_public_key, now=now)
    holder = peer_id_of(token.public_key)
    if holder != peer_id:
        raise InvalidTokenError(f"its token {token.username!r} is bound to the key of peer {holder}")
    return token_expiration(token)


# ---------------------------------------------------------------- publishing one's own token


def _token_record(token_path: str, period: float) -> tuple[str, float]:
    """The token file's content and the DHT expiration of its record: two periods, or the token's own end."""
    token = load_token(token_path)
    return encode_token(token), min(get_dht_time() + 2 * period, token_expiration(token).timestamp())


async def _keep_published(_dht: hivemind.DHT, node: DHTNode, key: str, owner: bytes, token_path: str,
                          period: float) -> None:
    """Runs inside the DHT process for as long as it lives; re-reads the file, so that a renewed token is used."""
    while True:
        await asyncio.sleep(period)
        try:
            value, expiration = _token_record(token_path, period)
            await node.store(key, value, expiration, subkey=owner)
        except (OSError, ValueError) as e:
            logger.warning(f"Could not re-publish this peer's access token: {e}")


def publish_access_token(dht: hivemind.DHT, run_id: str, token_path: Union[str, os.PathLike], owner: bytes,
                         period: float = PUBLISH_PERIOD) -> None:
    """Store this peer's access token under its peer ID now, then again every ``period`` s (in the DHT process).

    :param owner: the subkey, this peer's record owner key (``RSASignatureValidator.local_public_key``): the DHT's
      signature validator then lets no other peer overwrite the record
    """
    key = access_token_key(run_id, dht.peer_id)
    value, expiration = _token_record(os.fspath(token_path), period)
    if not dht.store(key, value, expiration, subkey=owner):
        logger.warning("Could not publish this peer's access token in the DHT: peers will refuse to average with it "
                       f"until a re-publication succeeds (every {period:g} s)")
    dht.run_coroutine(functools.partial(_keep_published, key=key, owner=owner, token_path=os.fspath(token_path),
                                        period=period), return_future=True)


# ---------------------------------------------------------------- checking the others' tokens


class AveragingGate:
    """Decides, inside an averager's process, whether a remote peer may use its averaging RPCs.

    A verdict is remembered: an admission until the token expires, a refusal for ``REFUSAL_TTL`` s (so a token that
    was published late is seen soon). Each refusal of a peer that was not refused just before logs one warning.
    Revoked peers are refused first, whatever the remembered verdict.
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, authority_public_key: RSAPublicKey):
        self._dht, self._run_id, self._authority_public_key = dht, run_id, authority_public_key
        self._verdicts: dict[PeerID, tuple[bool, float]] = {}  # peer -> (admitted, until this time.time())
        self._revoked: frozenset[str] = frozenset()
        self._revoked_checked = -float("inf")  # time.monotonic() of the last question to the DHT process
        self._revoked_refused: set[str] = set()  # revoked peers already reported by this averager

    async def _revoked_now(self) -> frozenset[str]:
        if time.monotonic() - self._revoked_checked >= REVOCATION_REFRESH:
            self._revoked_checked = time.monotonic()
            try:
                self._revoked = await self._dht.run_coroutine(revoked_peer_ids, return_future=True)
            except Exception as e:  # the DHT is shutting down: keep the last answer
                logger.debug(f"Could not ask the DHT process for revoked peers: {e!r}")
        return self._revoked

    async def admits(self, peer_id: PeerID, service: str) -> bool:
        """Whether ``peer_id`` holds a valid token and is not revoked; ``service`` names the averager in the
        warning."""
        if str(peer_id) in await self._revoked_now():
            if str(peer_id) not in self._revoked_refused:
                self._revoked_refused.add(str(peer_id))
                reason = "its identity was revoked by the swarm authority"
                logger.warning(f"{service}: refusing averaging requests from peer {peer_id}: {reason}")
                emit("peer_refused", source=str(peer_id), reason=reason, service=service)
            return False
        previous = self._verdicts.get(peer_id)
        if previous is not None and time.time() < previous[1]:
            return previous[0]
        try:
            verdict = (True, (await self._find_token(peer_id)).timestamp())
        except InvalidTokenError as e:
            verdict = (False, time.time() + REFUSAL_TTL)
            if previous is None or previous[0]:
                logger.warning(f"{service}: refusing averaging requests from peer {peer_id}: {e}")
                emit("peer_refused", source=str(peer_id), reason=str(e), service=service)
        if len(self._verdicts) >= _MAX_VERDICTS:
            self._verdicts = {peer: item for peer, item in self._verdicts.items() if time.time() < item[1]}
        self._verdicts[peer_id] = verdict
        return verdict[0]

    async def _find_token(self, peer_id: PeerID) -> datetime:
        """The expiration of the first valid token published under ``peer_id`` (other token holders can add
        entries under their own subkeys, never replace the peer's own: a bad entry is skipped)."""
        entry = await self._dht.get(access_token_key(self._run_id, peer_id), return_future=True)
        if entry is None or not isinstance(entry.value, dict):
            raise InvalidTokenError("it has published no access token")
        error = InvalidTokenError("its access token record is malformed")
        for item in entry.value.values():
            try:
                return check_member_token(decode_token(str(item.value)), peer_id, self._authority_public_key)
            except InvalidTokenError as e:
                error = e
        raise error


class GatedRPCs:
    """Mixed in front of a hivemind averager: its rpc_* handlers first ask ``gate`` about the caller."""

    # hivemind caches the RPC table per class and names handlers after the class; without these, a subclass would
    # reuse its parent's table (and stubs calling the parent's handler names) if the parent's was built first
    _rpc_handlers = None
    _stub_type = None

    def __init__(self, *args, gate: AveragingGate, **kwargs):
        self._gate = gate  # before hivemind's __init__, which starts the averager's process
        super().__init__(*args, **kwargs)

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not await self._gate.admits(context.remote_id, self.prefix):  # delivered (hivemind_fixes.stream_answers)
            async for message in lingering(as_aiter(averaging_pb2.MessageFromLeader(
                    code=averaging_pb2.PROTOCOL_VIOLATION))):
                yield message
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if not await self._gate.admits(context.remote_id, self.prefix):  # read the part, or the refusal is lost
            refusal = averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            async for message in answer_then_drain(as_aiter(refusal), stream):
                yield message
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not await self._gate.admits(context.remote_id, self.prefix):
            return  # an empty answer, as hivemind's own refusal: the downloader moves on to the next peer
        async for message in super().rpc_download_state(request, context):
            yield message


class GatedGradientAverager(GatedRPCs, GradientAverager):
    """hivemind's GradientAverager, serving token holders only (``gate=`` is required)."""

    rpc_class_name = "GatedGradientAverager"  # with or without host gradients


class GatedTrainingStateAverager(GatedRPCs, TrainingStateAverager):
    """hivemind's TrainingStateAverager, serving token holders only (``gate=`` is required)."""
