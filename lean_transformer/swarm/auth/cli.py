"""``python -m lean_transformer.swarm.auth``: create keys, issue and inspect access tokens, revoke identities (see
the package's docstring for the owner's and the volunteer's steps).

``revoke`` must write to the DHT of an authorized swarm, which answers token holders only: since it holds the
authority key, it mints a 15-minute token for a fresh throwaway identity and joins as a client (no incoming
connections needed), reads the newest revocation list there, merges the new identities into it (and into the
``--list-path`` copy, if given), signs and stores the result, then leaves. The peers then keep it alive
(:mod:`.revocation`)."""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from concurrent.futures import TimeoutError as FutureTimeoutError
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Optional, Sequence

from hivemind.utils.crypto import RSAPrivateKey

from lean_transformer.swarm import auth
from lean_transformer.swarm.auth.keys import (key_fingerprint, load_authority_key, load_identity_key,
                                              load_public_key, parse_public_key, peer_id_of, public_key_text,
                                              save_authority_key, save_public_key)
from lean_transformer.swarm.auth.revocation import (load_revocations, merge_revocations, newest_revocations,
                                                    parse_peer_id, publish_revocations, revocation_key,
                                                    save_revocations)
from lean_transformer.swarm.auth.tokens import (check_token, encode_token, issue_token, load_token, parse_duration,
                                                save_token)
from lean_transformer.cli import OneLineErrorParser


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
    peer_key = _peer_public_key(args.peer_public_key)
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


def _peer_public_key(text: str):
    if text.startswith("ssh-"):
        return parse_public_key(text, source="--peer-public-key")
    return load_public_key(text, "peer public key file")


def _cmd_revoke(args: argparse.Namespace) -> None:
    from hivemind.dht.crypto import RSASignatureValidator

    from lean_transformer.swarm.protocol.dht import SwarmConnectionError, build_dht
    from lean_transformer.swarm.protocol.settings import NetworkSettings

    if not args.timeout > 0:
        raise ValueError(f"--timeout: must be positive, got {args.timeout:g}")
    authority = load_authority_key(args.authority)
    revoked = [parse_peer_id(text, "--peer-id") for text in args.peer_id]
    revoked += [peer_id_of(_peer_public_key(text)) for text in args.peer_public_key]
    if not revoked:
        raise ValueError("revoke: give the identity to revoke with --peer-id or --peer-public-key")
    authority_public_key = authority.get_public_key()
    local = None
    if args.list_path is not None and Path(args.list_path).exists():
        local = load_revocations(args.list_path, authority_public_key)
    logging.getLogger("hivemind").setLevel(logging.ERROR)  # its startup lines would bury the one result line
    with tempfile.TemporaryDirectory(prefix="revoke-") as tmp:
        identity = load_identity_key(Path(tmp) / "identity.key", create=True)
        token = issue_token(authority, identity.get_public_key(), datetime.now(timezone.utc) + timedelta(minutes=15),
                            name="revoke-cli")
        save_token(token, Path(tmp) / "cli.token")
        save_public_key(authority, Path(tmp) / "authority.pub")
        network = NetworkSettings(run_id=args.run_id, initial_peers=args.initial_peers, client_mode=True,
                                  identity_path=str(Path(tmp) / "identity.key"),
                                  auth_token_path=str(Path(tmp) / "cli.token"),
                                  authority_public_key_path=str(Path(tmp) / "authority.pub"),
                                  startup_timeout=args.timeout)
        validator = RSASignatureValidator(identity)
        dht = build_dht(network, [validator])
        try:
            entry = dht.get(revocation_key(args.run_id), latest=True, return_future=True).result(timeout=args.timeout)
            current, _ = newest_revocations(None if entry is None else entry.value, authority_public_key)
            merged = merge_revocations(authority, [current, local], revoked, now=time.time())
            if not publish_revocations(dht, args.run_id, merged, validator.local_public_key, timeout=args.timeout):
                raise SwarmConnectionError("no peer of the swarm stored the revocation list; is --run_id right and "
                                           "are --initial_peers reachable from here?")
        except FutureTimeoutError:
            raise SwarmConnectionError(f"the swarm did not answer within {args.timeout:g} s (--timeout)") from None
        finally:
            dht.shutdown()
    if args.list_path is not None:
        save_revocations(merged, args.list_path)
    names = ", ".join(sorted({str(peer) for peer in revoked}))
    print(f"revoked {names}: the swarm's list now holds {len(merged.revoked)} identities (issued at "
          f"{merged.issued_at:.3f}); every peer refuses them within a minute", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m lean_transformer.swarm.auth",
                                description=auth.__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)

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

    revoke = commands.add_parser("revoke", help="revoke peer identities in a running swarm (owner)")
    revoke.add_argument("--authority", required=True, help="authority private key file (from new-authority)")
    revoke.add_argument("--peer-id", "--peer_id", action="append", default=[],
                        help="peer ID to revoke (as in logs and events); repeatable")
    revoke.add_argument("--peer-public-key", action="append", default=[],
                        help="'ssh-rsa AAAA...' or a file holding it, to revoke; repeatable")
    revoke.add_argument("--initial_peers", "--initial-peers", nargs="+", required=True,
                        help="multiaddrs of peers of the swarm (as for run_trainer.py)")
    revoke.add_argument("--run_id", "--run-id", required=True, help="the swarm's run_id")
    revoke.add_argument("--list-path", "--list_path", help="the owner's local copy of the list: merged, then updated")
    revoke.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the swarm (default 60)")
    revoke.set_defaults(run=_cmd_revoke)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: SwarmConnectionError (revoke)
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
