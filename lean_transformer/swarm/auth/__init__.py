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
    # owner, to cut a peer off before its token expires (every peer refuses it within a minute):
    python -m lean_transformer.swarm.auth revoke --authority authority.pem --peer-id Qm... \
        --initial_peers /ip4/.../p2p/Qm... --run_id my_run --list-path revoked.list

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
callers whose libp2p-authenticated peer ID has a valid token there (:mod:`.averaging_gate`).
So an outsider that learns a trainer's address, peer ID and the run's group keys elsewhere and calls its averagers
directly is refused, and one token holder cannot pass its token on to another key.

Peers' clocks must agree within a minute (use NTP): hivemind refuses requests whose timestamp is further off, as
replay protection, and token expiry is checked against each peer's own clock.

Modules: :mod:`~lean_transformer.swarm.auth.keys` (key files), :mod:`~lean_transformer.swarm.auth.tokens` (the token
format), :mod:`~lean_transformer.swarm.auth.authorizer` (the DHT's authorizer),
:mod:`~lean_transformer.swarm.auth.averaging_gate` (the averagers' gate),
:mod:`~lean_transformer.swarm.auth.revocation` (revoked identities) and :mod:`~lean_transformer.swarm.auth.cli`.
"""
from lean_transformer.swarm.auth.authorizer import SwarmAuthorizer, make_authorizer
from lean_transformer.swarm.auth.keys import (KeyFileError, key_fingerprint, load_authority_key, load_identity_key,
                                              load_public_key, parse_public_key, peer_id_of, public_key_text,
                                              save_authority_key, save_public_key)
from lean_transformer.swarm.auth.revocation import (IdentityRevokedError, InvalidRevocationListError, RevocationList,
                                                    RevocationWatcher, sign_revocations)
from lean_transformer.swarm.auth.tokens import (InvalidTokenError, TokenExpiredError, check_token, decode_token,
                                                encode_token, issue_token, load_token, parse_duration, save_token,
                                                token_expiration)

__all__ = ["IdentityRevokedError", "InvalidRevocationListError", "InvalidTokenError", "KeyFileError", "RevocationList",
           "RevocationWatcher", "SwarmAuthorizer", "TokenExpiredError", "check_token", "decode_token", "encode_token",
           "issue_token", "key_fingerprint", "load_authority_key", "load_identity_key", "load_public_key",
           "load_token", "make_authorizer", "parse_duration", "parse_public_key", "peer_id_of", "public_key_text",
           "save_authority_key", "save_public_key", "save_token", "sign_revocations", "token_expiration"]
