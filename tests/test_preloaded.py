"""tests/preloaded.py: a peer forked from the preloaded server is the process ``python ARGS`` would be (argv, cwd,
environment, files, session, exit codes, signals, stdin and pipes), and a command it could not run so goes to a new
Python."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import preloaded
from aux_utils import start_peer

pytestmark = pytest.mark.skipif(os.environ.get("LEAN_TEST_PRELOAD") == "0", reason="LEAN_TEST_PRELOAD=0: no forks")
ENV = dict(os.environ, **preloaded.PEER_ENV)
# prints what the child is: pid, parent, session, argv, cwd, an environment variable, numpy's first draw, sys.path[0]
WHO = ("import json, os, sys, numpy; print(json.dumps(dict(pid=os.getpid(), ppid=os.getppid(), sid=os.getsid(0), "
       "argv=sys.argv, cwd=os.getcwd(), slow=os.environ.get('SLOW_BATCH_SECONDS'), draw=float(numpy.random.rand()), "
       "path0=sys.path[0], main=__name__)))")


def test_a_forked_child_is_what_a_new_python_would_be(tmp_path: Path):
    script = tmp_path / "who.py"
    script.write_text(f"{WHO}\nraise SystemExit(3)\n")
    forked = [preloaded.run([sys.executable, str(script), "a", "b"], 60, dict(ENV, SLOW_BATCH_SECONDS=str(index)),
                            cwd=tmp_path) for index in range(2)]
    fresh = subprocess.run([sys.executable, str(script), "a", "b"], cwd=tmp_path, env=ENV, capture_output=True,
                           text=True, timeout=60)
    who = [json.loads(done.stdout) for done in (*forked, fresh)]
    assert [done.returncode for done in (*forked, fresh)] == [3, 3, 3]
    for index, each in enumerate(who):
        assert each["argv"] == [str(script), "a", "b"] and each["cwd"] == str(tmp_path), each
        assert each["path0"] == str(tmp_path) and each["main"] == "__main__", each
        assert each["slow"] == (str(index) if index < 2 else None), each
    server_pid = preloaded.Server.get(ENV).process.pid
    assert [each["ppid"] for each in who] == [server_pid, server_pid, os.getpid()]  # forked, forked, a new Python
    assert who[0]["pid"] != who[1]["pid"] and who[0]["draw"] != who[1]["draw"]  # numpy reseeded in each child
    # a traceback ends the child as it ends a new Python
    crash = preloaded.run([sys.executable, "-c", "raise ValueError('the outer step failed')"], 60, ENV)
    assert crash.returncode == 1 and crash.stderr.strip().splitlines()[-1] == "ValueError: the outer step failed"


def test_a_forked_peer_has_its_own_session_files_signals_and_stdin(tmp_path: Path):
    code = f"import sys, time; {WHO}; sys.stdout.flush(); print(sys.stdin.readline().strip(), file=sys.stderr); " \
           "sys.stderr.flush(); time.sleep(60)"
    peer = start_peer("peer", ["-c", code], tmp_path, events=False, stdin=True)
    assert isinstance(peer.process, preloaded.ForkedProcess)
    who = json.loads(peer.wait_for(r"^\{.*\}$", 60, stream="stdout").group(0))
    assert who["pid"] == peer.pid == who["sid"]  # its own session, as PeerProcess asks
    peer.send("a line on stdin")
    peer.wait_for("^a line on stdin$", 60)
    assert peer.returncode is None
    peer.terminate()
    assert peer.wait(30) == -signal.SIGTERM and peer.returncode == -signal.SIGTERM


def test_another_environment_gets_its_own_server_whose_imports_read_it(tmp_path: Path):
    code = "import os, huggingface_hub.constants as c; print(c.ENDPOINT, os.getppid(), flush=True); import time; " \
           "time.sleep(60)"
    hub = dict(ENV, HF_ENDPOINT="http://127.0.0.1:9")  # read when huggingface_hub is imported
    process = preloaded.popen([sys.executable, "-c", code], env=hub, stdout=subprocess.PIPE, text=True)
    assert isinstance(process, preloaded.ForkedProcess)
    with pytest.raises(subprocess.TimeoutExpired):  # it sleeps
        process.communicate(timeout=1)
    process.kill()
    out, _ = process.communicate(timeout=30)
    assert process.returncode == -signal.SIGKILL
    assert out.split() == ["http://127.0.0.1:9", str(preloaded.Server.get(hub).process.pid)]
    assert preloaded.Server.get(hub) is not preloaded.Server.get(ENV)


def test_a_fork_of_the_session_leaves_the_servers_running():
    """A test's in-process hivemind forks the test session; the fork's atexit runs the servers' close() too."""
    server = preloaded.Server.get(ENV)
    pid = os.fork()
    if pid == 0:
        server.close()
        os._exit(0)
    os.waitpid(pid, 0)
    assert server.process.poll() is None
    assert preloaded.run([sys.executable, "-c", "print('alive')"], 60, ENV).stdout == "alive\n"


def test_a_peer_killed_holding_hiveminds_process_wide_locks_blocks_no_other_peer(tmp_path: Path):
    """hivemind makes multiprocessing locks when it is imported; forked peers must not share them with each other."""
    locks = ("from hivemind.utils.asyncio import _AsyncContextWrapper; from hivemind.utils.mpfuture import MPFuture, "
             "SharedBytes; locks = [MPFuture._update_lock, MPFuture._initialization_lock, SharedBytes._lock, "
             "_AsyncContextWrapper.EXECUTOR_LOCK]; ")
    holder = start_peer("holder", ["-c", locks + "import time; print(all(lock.acquire(timeout=5) for lock in locks), "
                                   "flush=True); time.sleep(60)"], tmp_path, events=False)
    holder.wait_for("^True$", 60, stream="stdout")
    holder.kill()
    assert holder.wait(30) == -signal.SIGKILL
    other = preloaded.run([sys.executable, "-c", locks + "print(all(lock.acquire(timeout=5) for lock in locks))"], 60,
                          ENV)
    assert other.stdout == "True\n", other.stderr[-2000:]
