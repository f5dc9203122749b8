"""The package stands alone: it never imports the application (``tasks``, ``arguments``, the ``run_*`` scripts),
its modules import each other without circles, and a wheel installed elsewhere runs a swarm from any directory."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lean_transformer.swarm.monitoring.events import read_events

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "lean_transformer"
APPLICATION = {"tasks", "arguments", "run_trainer", "run_aux_peer"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, *, runtime_only: bool) -> set[str]:
    """Absolute names of the modules ``path`` imports, anywhere in the file (functions included); with
    ``runtime_only``, imports under ``if TYPE_CHECKING:`` are left out."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = set()
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped.update(id(child) for child in ast.walk(node))
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def project_modules() -> dict[str, Path]:
    """The package's and the application's modules, by name."""
    paths = [*PACKAGE.rglob("*.py"), *(REPO / "tasks").rglob("*.py"), *(REPO / f"{name}.py" for name in
                                                                    ("arguments", "run_trainer", "run_aux_peer"))]
    return {module_name(path): path for path in paths}


def package_graph(modules: dict[str, Path] | None = None, *, runtime_only: bool = True) -> dict[str, set[str]]:
    """Module -> the modules it runs on import (a module also runs its parent packages' __init__); by default the
    package's modules and their imports at run time."""
    modules = modules or {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for imported in imports(path, runtime_only=runtime_only):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            parts = imported.split(".")
            edges.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules)
        edges.discard(name)
        edges -= {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}  # its own parents
        graph[name] = edges
    return graph


def test_the_package_never_imports_the_application():
    offenders = {module_name(path): sorted(name for name in imports(path, runtime_only=False)
                                           if name.split(".")[0] in APPLICATION)
                 for path in PACKAGE.rglob("*.py")}
    assert {name: found for name, found in offenders.items() if found} == {}
    texts = {module_name(path): path.read_text() for path in PACKAGE.rglob("*.py")}
    assert not [name for name, text in texts.items() if "parents[" in text], "no path tricks to reach the checkout"


def test_no_import_circles():
    """Neither in the package nor with the application, type-checking imports included."""
    graph = package_graph(project_modules(), runtime_only=False)
    assert "lean_transformer.modules.blocksparse" in graph["lean_transformer.modules.linear"]  # edges are seen
    assert "tasks.settings" in graph["arguments"]
    state, stack, cycles = {}, [], []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for successor in sorted(graph[node]):
            if state.get(successor) == "open":
                cycles.append(stack[stack.index(successor):] + [successor])
            elif successor not in state:
                visit(successor)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert cycles == []


@pytest.mark.swarm
def test_wheel_runs_a_one_peer_swarm_from_another_directory(tmp_path: Path):
    """Build a wheel, install it (not editable) into a fresh directory, and train a 1-peer swarm from elsewhere."""
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(REPO)], check=True, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("lean_transformer-*.whl")
    target = tmp_path / "installed"  # the dependencies come from this environment, the project from the wheel only
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, timeout=300, capture_output=True)
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = dict(os.environ, PYTHONPATH=str(target), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    top_level = {path.name for path in target.iterdir() if not path.name.endswith(".dist-info")}
    assert top_level == {"lean_transformer", "lean_transformer_app", "bin"}, "no other top-level module is installed"
    located = subprocess.run([sys.executable, "-c", "import lean_transformer, lean_transformer_app.tasks as t; "
                                                    "print(lean_transformer.__file__, t.__file__)"],
                             cwd=workdir, env=env, check=True, text=True, capture_output=True).stdout.split()
    assert all(path.startswith(str(target)) for path in located), located
    for script in ("lean-aux-peer", "lean-demo"):
        shown = subprocess.run([target / "bin" / script, "--help"], cwd=workdir, env=env, text=True,
                               capture_output=True, timeout=120)
        assert shown.returncode == 0 and ("--run_id" in shown.stdout or "--num_trainers" in shown.stdout), shown
    trainer = subprocess.run(
        [target / "bin" / "lean-trainer", "--run_id", "wheel", "--host_maddrs", "/ip4/127.0.0.1/tcp/0",
         "--target_batch_size", "16", "--per_device_batch_size", "4", "--max_sequence_length", "32",
         "--matchmaking_time", "0.5", "--max_epochs", "3", "--output_dir", "out", "--shutdown_timeout", "20"],
        cwd=workdir, env=env, text=True, capture_output=True, timeout=240)
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    events = read_events(workdir / "out" / "events.jsonl")  # the default --events_path, in --output_dir
    assert [event["epoch"] for event in events if event["event"] == "epoch"][-1] == 3, trainer.stderr[-3000:]
    assert (events[-1]["event"], events[-1]["reason"], events[-1]["clean"]) == ("shutdown", "finished", True)
    assert (workdir / "out" / "backups").is_dir()


def test_the_wheel_lists_every_package_of_the_tree():
    """pyproject.toml names the packages one by one (the application is mapped under ``lean_transformer_app``): a
    new subpackage must be added there, or the wheel would lack it."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    tree = {module_name(path.parent / "__init__.py") for path in PACKAGE.rglob("__init__.py")}
    assert listed == tree | {"lean_transformer_app", "lean_transformer_app.tasks"}


def test_the_config_stands_below_the_models_parts():
    """config.py (floor 1) reaches for nothing above it, not even inside a function: the block layouts it checks
    live in lean_transformer/layouts.py, below both."""
    above = ("lean_transformer.modules", "lean_transformer.models", "lean_transformer.optim", "lean_transformer.swarm")
    found = imports(PACKAGE / "config.py", runtime_only=False)
    assert "lean_transformer.layouts" in found and not [name for name in found if name.startswith(above)], found
