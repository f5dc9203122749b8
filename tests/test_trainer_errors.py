"""Bad input to run_trainer.py: one readable line on stderr and a non-zero exit code, in bounded time.

The cases of the issue run as real processes, all at once; tests/test_args.py covers more flags in-process (through
the same parser)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

import preloaded
from aux_utils import REPO, closed_port

UNREACHABLE_TIMEOUT = 8  # --startup_timeout for the unreachable peer
SOME_PEER_ID = "12D3KooWDNh6GZkBqi2zGzKXH27ZXhcm2aMoKHjZ3YdYXTndzrRs"


@pytest.fixture(scope="module")
def silent_listener():
    """A TCP port that accepts connections and never answers: a peer that cannot be reached, without a quick
    'connection refused'."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield server.getsockname()[1]


def cases(port: int) -> dict[str, tuple[list[str], str]]:
    """name -> (extra arguments, a fragment the error line must contain)"""
    return {
        "unknown task": (["--task", "translation"], "--task: unknown task 'translation'"),
        "missing dataset": (["--dataset", "/nonexistent/*.txt"], "--dataset: no files match"),
        "missing config": (["--model_config_path", "/nonexistent/config.json"], "--model_config_path:"),
        "malformed multiaddr": (["--initial_peers", "/ip4/127.0.0.1/tcp/notaport"], "--initial_peers:"),
        "unreachable peer": (["--initial_peers", f"/ip4/127.0.0.1/tcp/{port}/p2p/{SOME_PEER_ID}",
                              "--startup_timeout", str(UNREACHABLE_TIMEOUT)], "--initial_peers"),
        "missing Hub checkpoint": (["--resume_from", "someone/missing-checkpoint"],
                                   "--resume_from: someone/missing-checkpoint is not a local directory and could "
                                   "not be downloaded as a Hub repo"),
    }


@pytest.fixture(scope="module")
def results(silent_listener, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, float]]:
    output_dir = tmp_path_factory.mktemp("errors")
    # a Hub that is down (read when huggingface_hub is imported: that case runs as a new Python, not preloaded.py's)
    hub = {"HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}", "HF_HUB_DOWNLOAD_TIMEOUT": "5"}
    started = {}
    for name, (extra, _) in cases(silent_listener).items():
        argv = [sys.executable, "run_trainer.py", "--run_id", "errors", "--host_maddrs", "/ip4/127.0.0.1/tcp/0",
                "--output_dir", str(output_dir), *extra]
        env = {**os.environ, **preloaded.PEER_ENV, **(hub if name == "missing Hub checkpoint" else {})}
        started[name] = (preloaded.popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         env=env), time.monotonic())
    finished = {}
    for name, (process, start) in started.items():
        stdout, stderr = process.communicate(timeout=300)
        finished[name] = (subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr),
                          time.monotonic() - start)
    return finished


@pytest.mark.parametrize("name", list(cases(0)))
def test_bad_input_gives_one_clear_line(name, results, silent_listener):
    result, _ = results[name]
    _, fragment = cases(silent_listener)[name]
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(error_lines) == 1, result.stderr
    assert error_lines[0].startswith("run_trainer.py: error: "), error_lines
    assert error_lines[0] == result.stderr.strip().splitlines()[-1]  # the last thing a person sees
    assert fragment in error_lines[0]


def test_unreachable_peer_fails_within_the_startup_timeout(results):
    _, seconds = results["unreachable peer"]
    assert seconds < UNREACHABLE_TIMEOUT + 90  # plus the start-up of a process on a busy, shared CPU
