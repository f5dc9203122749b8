"""Runs a peer script the moment a file appears, with the script's imports (torch, hivemind, transformers: ~7 s of CPU)
done while it waits: a swarm test starts the process early and the peer itself (the real script, run as __main__)
starts when the test's event happens, not seconds later on a busy 2-core machine.

Usage: python tests/start_when.py GO_FILE TIMEOUT SCRIPT [ARGS...]
The lines of GO_FILE (written atomically by the test) are appended to ARGS. Without GO_FILE after TIMEOUT seconds:
one line and exit code 1.
"""
import importlib
import runpy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    go_file, timeout, script, args = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4:]
    sys.path.insert(0, str(REPO))
    importlib.import_module(Path(script).stem)  # run_trainer / run_aux_peer: imported, its main() not called
    print(f"start_when.py: imported, waiting for {go_file}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout
    while not go_file.exists():
        if time.monotonic() > deadline:
            sys.exit(f"start_when.py: error: {go_file} did not appear within {timeout:g} s")
        time.sleep(0.05)
    sys.argv = [script, *args, *go_file.read_text().splitlines()]
    runpy.run_path(str(REPO / script), run_name="__main__")
