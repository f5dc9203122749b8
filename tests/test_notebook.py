"""The volunteer notebook (notebooks/join_swarm.ipynb) run as a volunteer runs it, offline: a real Jupyter kernel
(nbclient) executes its cells against a local aux peer started here, with the parameters cell replaced (no install;
the trainer from this checkout; the tiny model). Once the trainer has trained a few epochs the test interrupts the
kernel, as the notebook's stop button does: the cell must stop the trainer with SIGTERM and the trainer must leave
the swarm cleanly (its events say so) while the cell ends without an error."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from aux_utils import REPO, wait_until
from test_client_mode import ENV, start_assisting_aux_peer, swarm_args

from lean_transformer.swarm.monitoring.events import read_events

nbformat = pytest.importorskip("nbformat", reason="pip install -e '.[test]'")
nbclient = pytest.importorskip("nbclient", reason="pip install -e '.[test]'")

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]

NOTEBOOK = REPO / "notebooks" / "join_swarm.ipynb"
EPOCHS_BEFORE_STOP = 3


def parameters_cell(notebook) -> int:
    (index,) = [i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", [])]
    return index


def test_the_notebook_has_one_cell_to_install_and_one_to_join():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    assert len(code) == 3 and parameters_cell(notebook) == 1
    assert "CLIENT_MODE = True" in code[0] and "INSTALL = True" in code[0], "client mode and the install by default"
    assert "pip" in code[1] and "if INSTALL" in code[1]
    assert "KeyboardInterrupt" in code[2] and "SIGTERM" in code[2]
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), "saved without outputs"


def test_a_volunteer_joins_trains_and_leaves_cleanly(tmp_path: Path):
    run = swarm_args("notebook")
    aux = start_assisting_aux_peer(tmp_path, run)
    try:
        initial_peers = aux.initial_peers()
        output_dir = tmp_path / "volunteer"
        shared = [arg for i, arg in enumerate(run) if arg != "--run_id" and (i == 0 or run[i - 1] != "--run_id")]
        extra = [*shared, "--output_dir", str(output_dir), "--backup_every_epochs", "0", "--progress_every", "2"]
        notebook = nbformat.read(NOTEBOOK, as_version=4)
        notebook.cells[parameters_cell(notebook)].source = "\n".join([
            f"INITIAL_PEERS = {' '.join(initial_peers)!r}",
            "RUN_ID = 'notebook'",
            f"EXTRA_ARGS = {' '.join(extra)!r}",
            "CLIENT_MODE = True",
            "PACKAGE = None",
            "INSTALL = False  # offline: the project is this checkout",
            f"TRAINER = [{sys.executable!r}, {str(REPO / 'run_trainer.py')!r}]",
            "SHUTDOWN_TIMEOUT = 60",
            "import os; os.environ.update(" + json.dumps(ENV) + ")",
        ])
        client = nbclient.NotebookClient(notebook, timeout=150, kernel_name="python3",
                                         resources={"metadata": {"path": str(REPO)}})
        failure = []

        def execute() -> None:
            try:
                client.execute()
            except BaseException as error:  # noqa: BLE001 (reported by the main thread)
                failure.append(error)

        runner = threading.Thread(target=execute, daemon=True)
        runner.start()
        events_path = output_dir / "events.jsonl"

        def trained() -> bool:
            assert runner.is_alive(), f"the notebook ended before the trainer trained: {failure or notebook.cells[-1]}"
            epochs = [e for e in read_events(events_path) if e["event"] == "epoch"] if events_path.exists() else []
            return len(epochs) >= EPOCHS_BEFORE_STOP

        wait_until(trained, timeout=120, what=f"the notebook's trainer to reach {EPOCHS_BEFORE_STOP} epochs",
                   interval=0.5)
        kernel = client.km.provisioner.process  # the kernel's process: interrupt it as Jupyter's stop button does
        os.kill(kernel.pid, signal.SIGINT)
        runner.join(timeout=90)
        assert not runner.is_alive(), "the cell did not end after the interrupt"
        assert not failure, failure
    finally:
        aux.stop()

    printed = "".join(output.get("text", "") for output in notebook.cells[-1].outputs)
    assert "Joined the swarm at epoch" in printed and "Leaving the swarm: SIGTERM" in printed, printed[-3000:]
    assert printed.rstrip().endswith("trainer exited with code 0"), printed[-3000:]
    events = read_events(events_path)
    joined = [e for e in events if e["event"] == "joined"]
    assert joined and joined[0]["client_mode"], events[:3]
    assert sum(e["event"] == "epoch" for e in events) >= EPOCHS_BEFORE_STOP
    assert (events[-1]["event"], events[-1]["reason"], events[-1]["clean"]) == ("shutdown", "signal", True), events[-1]
