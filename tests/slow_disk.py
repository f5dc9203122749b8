"""Run a Python script on a simulated slow disk: every ``os.fsync`` first sleeps ``SLOW_FSYNC_SECONDS``.

A checkpoint of the tiny test model is written in milliseconds; on this "disk" it takes seconds, so a test can
SIGKILL the writer reliably while a checkpoint is half-written. Usage: python tests/slow_disk.py SCRIPT [ARGS...]
"""
import os
import runpy
import sys
import time

_delay = float(os.environ.get("SLOW_FSYNC_SECONDS", "1"))
_fsync = os.fsync


def _slow_fsync(fd: int) -> None:
    time.sleep(_delay)
    _fsync(fd)


if __name__ == "__main__":
    os.fsync = _slow_fsync
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as if SCRIPT had been run directly
    runpy.run_path(sys.argv[0], run_name="__main__")
