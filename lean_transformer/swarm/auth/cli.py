"""``python -m lean_transformer.swarm.auth``: create keys, issue and inspect access tokens (see the package's
docstring for the owner's and the volunteer's steps)."""
from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional, Sequence

from hivemind.utils.crypto import RSAPrivateKey

from lean_transformer.swarm import auth
from lean_transformer.swarm.auth.keys import (key_fingerprint, load_authority_key, load_identity_key,
                                              load_public_key, parse_public_key, public_key_text,
                                              save_authority_key, save_public_key)
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
