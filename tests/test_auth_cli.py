"""The access-control CLI: the owner's and the volunteer's journey end to end, and one clear line per bad input."""

import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from lean_transformer.swarm.auth import (
    issue_token,
    load_authority_key,
    load_identity_key,
    make_authorizer,
    save_token,
)
from lean_transformer.swarm.auth.cli import main

CLI = [sys.executable, "-m", "lean_transformer.swarm.auth"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=120)


def _main(capsys, *args) -> tuple:
    """Run the CLI in-process (each `python -m` start imports torch through hivemind: seconds on a busy CI box)."""
    code = main([str(arg) for arg in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_journey(tmp_path, capsys, report):
    """Owner creates an authority, volunteer prints its key, owner issues a token: the peer's files then load."""
    new = _run("new-authority", "--out", tmp_path / "authority.pem")  # once through the real `python -m` entry
    assert new.returncode == 0, new.stderr
    assert new.stdout.startswith("ssh-rsa ") and (tmp_path / "authority.pub").read_text() == new.stdout
    assert (tmp_path / "authority.pem").stat().st_mode & 0o777 == 0o600

    code, peer_key, err = _main(capsys, "peer-key", "--identity_path", tmp_path / "peer.id",
                                "--out", tmp_path / "peer.pub")
    assert code == 0 and "created identity" in err and (tmp_path / "peer.pub").read_text() == peer_key
    code, again, err = _main(capsys, "peer-key", "--identity_path", tmp_path / "peer.id")
    assert code == 0 and again == peer_key and "using existing identity" in err

    code, _, err = _main(capsys, "issue-token", "--authority", tmp_path / "authority.pem", "--peer-public-key",
                         peer_key.strip(), "--expires-in", "7d", "--name", "alice", "--out", tmp_path / "alice.token")
    assert code == 0, err

    code, shown, err = _main(capsys, "show-token", "--token", tmp_path / "alice.token",
                             "--authority-public-key", tmp_path / "authority.pub")
    assert code == 0 and "name: 'alice'" in shown and "valid: signed by this authority" in shown, err
    expires = datetime.fromisoformat(shown.split("expires: ")[1].split()[0])
    assert timedelta(days=6, hours=23) < expires - datetime.now(timezone.utc) <= timedelta(days=7)

    authorizer = make_authorizer(tmp_path / "alice.token", tmp_path / "authority.pub", tmp_path / "peer.id")
    assert authorizer.local_public_key.to_bytes().decode() == peer_key.strip()
    report("journey: new-authority -> peer-key -> issue-token -> show-token -> the peer's authorizer loads")

    bad = _run("issue-token", "--authority", tmp_path / "missing.pem", "--peer-public-key", tmp_path / "peer.pub",
               "--expires-in", "7d")
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.splitlines() == [f"error: authority key file not found: {tmp_path / 'missing.pem'}"]
    report("python -m with a missing authority file: exit 1 and one line, no traceback")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """An authority, a peer identity and tokens made through the library (the CLI journey is tested above)."""
    tmp = tmp_path_factory.mktemp("auth_cli")
    assert main(["new-authority", "--out", str(tmp / "authority.pem")]) == 0
    peer = load_identity_key(tmp / "peer.id", create=True).get_public_key()
    now = datetime.now(timezone.utc)
    save_token(issue_token(RSAPrivateKey(), peer, now + timedelta(days=1)), tmp / "foreign.token")
    (tmp / "peer.pub").write_text(peer.to_bytes().decode() + "\n")
    (tmp / "garbage").write_text("this is not a key\n")
    return tmp


BAD_INPUTS = {  # name -> (arguments, exit code, the start of the one error line)
    "authority exists": (["new-authority", "--out", "{d}/authority.pem"], 1, "error: {d}/authority.pem already exists"),
    "no such directory": (["new-authority", "--out", "{d}/no/dir.pem"], 1, "error: directory {d}/no does not exist"),
    "missing authority": (["issue-token", "--authority", "{d}/none.pem", "--peer-public-key", "{d}/peer.pub",
                           "--expires-in", "1d"], 1, "error: authority key file not found"),
    "corrupt authority": (["issue-token", "--authority", "{d}/garbage", "--peer-public-key", "{d}/peer.pub",
                           "--expires-in", "1d"], 1, "error: authority key file {d}/garbage is not an unencrypted PEM"),
    "garbage public key": (["issue-token", "--authority", "{d}/authority.pem", "--peer-public-key", "ssh-rsa AAAAxx",
                            "--expires-in", "1d"], 1, "error: --peer-public-key is not an RSA public key"),
    "missing public key": (["issue-token", "--authority", "{d}/authority.pem", "--peer-public-key", "{d}/none.pub",
                            "--expires-in", "1d"], 1, "error: peer public key file not found"),
    "bad duration": (["issue-token", "--authority", "{d}/authority.pem", "--peer-public-key", "{d}/peer.pub",
                      "--expires-in", "7x"], 1, "error: expires-in: '7x' is not a duration"),
    "negative duration": (["issue-token", "--authority", "{d}/authority.pem", "--peer-public-key", "{d}/peer.pub",
                           "--expires-in=-1d"], 1, "error: expires-in: '-1d' is not a duration"),
    "missing argument": (["issue-token", "--authority", "{d}/authority.pem"], 2,
                         "python -m lean_transformer.swarm.auth issue-token: error: the following arguments"),
    "corrupt identity": (["peer-key", "--identity_path", "{d}/garbage"], 1,
                         "error: identity file {d}/garbage is not a libp2p private key"),
    "corrupt token": (["show-token", "--token", "{d}/garbage"], 1, "error: access token file {d}/garbage is not an"),
    "other authority": (["show-token", "--token", "{d}/foreign.token", "--authority-public-key", "{d}/authority.pub"],
                        1, "error: token is not signed by this swarm's authority"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gives_one_line(setup, case, capsys, report):
    args, code, message = BAD_INPUTS[case]
    args = [arg.format(d=setup) for arg in args]
    try:
        result = main(args)
    except SystemExit as e:  # argparse's own errors
        result = e.code
    err = capsys.readouterr().err
    assert result == code, err
    assert len(err.splitlines()) == 1 and err.startswith(message.format(d=setup)), err
    report(f"{case}: exit {result}, {err.strip()}")


def test_expired_token_reported_as_expired(setup, capsys):
    """A token signed by the right authority but past its time is reported as expired, not as forged."""
    peer = load_identity_key(setup / "peer.id").get_public_key()
    expired = issue_token(load_authority_key(setup / "authority.pem"), peer, datetime.now(timezone.utc) - timedelta(1))
    save_token(expired, setup / "own-expired.token")
    assert main(["show-token", "--token", str(setup / "own-expired.token"),
                 "--authority-public-key", str(setup / "authority.pub")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: token expired at ") and len(err.splitlines()) == 1, err
