"""The docs: the README stays a short way in whose layout section matches the tree, every results file follows the
schema the benchmark pages are generated from, and the site builds with ``mkdocs build --strict`` (a broken link or
anchor fails), offline, with one page per results file carrying that file's numbers."""
from __future__ import annotations

import copy
import fnmatch
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_benchmarks", REPO / "docs" / "gen_benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = load_generator()


def test_readme_is_a_short_way_in():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    for command in ("make demo", "make test", "run_trainer.py", "run_aux_peer.py", "--resume_from", "--initial_peers"):
        assert command in text, command
    for target in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (REPO / target).is_file(), f"README links to {target}, which does not exist"


def test_readme_result_tables_are_those_of_the_results_files():
    """The README's tables are generated (``python docs/gen_benchmarks.py --readme``), so they match the results."""
    text = README.read_text()
    assert gen.README_BLOCK.search(text), "the README shows no result table"
    assert gen.render_readme(text, gen.load_results()) == text, "stale: run python docs/gen_benchmarks.py --readme"


def test_readme_layout_matches_the_tree():
    """Every path the layout block names exists, and every package folder and top-level folder is named there."""
    block = re.search(r"## Layout\n.*?```\n(.*?)```", README.read_text(), re.S).group(1)
    named, stack = set(), []
    for line in block.splitlines():
        match = re.match(r"( {0,4})(\S+)", line)  # names sit at depth 0-2; descriptions continue further right
        if not match:
            continue
        depth = len(match.group(1)) // 2
        stack[depth:] = [match.group(2).rstrip("/")]
        path = "/".join(stack)
        assert (REPO / path).exists(), f"the README's layout names {path}, which is not in the tree"
        named.add(path)
    packages = {str(init.parent.relative_to(REPO)) for init in (REPO / "lean_transformer").rglob("__init__.py")
                if init.parent.parent.name != "modules"}  # modules/blocksparse/ is named on modules/'s line
    assert not sorted(packages - named), f"packages missing from the README's layout: {sorted(packages - named)}"
    ignored = [line.strip().rstrip("/") for line in (REPO / ".gitignore").read_text().splitlines() if line.strip()]
    folders = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
               and not any(fnmatch.fnmatch(p.name, pattern) for pattern in ignored)}  # build outputs, venvs
    assert not sorted(folders - named), f"folders missing from the README's layout: {sorted(folders - named)}"


def test_every_results_file_follows_the_schema():
    results = gen.load_results()
    assert {"wan", "byzantine", "gpu_memory_h100", "gpu_throughput", "internet"} <= set(results)
    for name, data in results.items():
        page = gen.render_page(name, data)
        assert page.startswith(f"# {gen.title_of(name, data)}\n") and data["machine"] in page, name
        for table in data["tables"]:  # every cell reaches the page as it is in the file
            assert all(gen.cell(value) in page for row in table["rows"] for value in row), (name, table["title"])


@pytest.mark.parametrize("change,message", [
    (lambda d: d.pop("machine"), "'machine' must be a str"),
    (lambda d: d.update(date="25.11.2026"), "'date' must be YYYY-MM-DD"),
    (lambda d: d["tables"][0]["rows"].append([1]), "row 1 has 1 cells for 2 columns"),
    (lambda d: d.update(plots=["missing.png"]), "plot 'missing.png' is not a file beside the results file"),
    (lambda d: d.update(resluts={}), "unknown keys ['resluts'] (put anything else under 'raw')"),
    (lambda d: d.update(tables=[]), "'tables' is empty"),
])
def test_a_results_file_that_does_not_fit_is_named_with_its_field(tmp_path, change, message):
    good = {"benchmark": "x", "command": "python benchmarks/x.py", "machine": "m", "date": "2026-11-25",
            "commit": None, "baseline": "b", "tables": [{"title": "t", "columns": ["a", "b"], "rows": [["r", 1.5]]}]}
    gen.validate(copy.deepcopy(good), "x.json", tmp_path)
    bad = copy.deepcopy(good)
    change(bad)
    with pytest.raises(gen.ResultsError) as caught:
        gen.validate(bad, "x.json", tmp_path)
    assert str(caught.value).startswith("x.json: ") and message in str(caught.value)


def test_the_site_builds_strictly_with_a_page_per_results_file(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=180)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    for name, data in gen.load_results().items():
        html = (site / "benchmarks" / name / "index.html").read_text()
        first = data["tables"][0]["rows"][0]
        assert gen.cell(data["date"]) in html and data["tables"][0]["title"].split()[0] in html, name
        number = next((value for value in first if isinstance(value, (int, float))), None)
        if number is not None:
            assert gen.cell(number) in html, (name, number)
        for plot in data.get("plots", []):
            assert (site / "benchmarks" / plot).is_file() and f'src="../{plot}"' in html, (name, plot)
    listing = (site / "benchmarks" / "index.html").read_text()
    assert gen.LIST_MARKER not in listing and all(f'href="{name}/"' in listing for name in gen.load_results())
    assert "fonts.googleapis.com" not in (site / "index.html").read_text(), "theme.font: false keeps it offline"


def test_a_broken_link_fails_the_build(tmp_path):
    """Strict mode is on: the check above would notice a page that links to a results file that is gone."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# x\n\n[gone](benchmarks/gone.md)\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text((REPO / "mkdocs.yml").read_text().replace("docs/gen_benchmarks.py",
                                                                 str(REPO / "docs" / "gen_benchmarks.py")))
    (docs / "benchmarks").mkdir()
    (docs / "benchmarks" / "index.md").write_text("# b\n")
    for page in re.findall(r": (\w+\.md)$", config.read_text(), re.M):
        if not (docs / page).exists():
            (docs / page).write_text(f"# {page}\n")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "--site-dir",
                            str(tmp_path / "site")], cwd=tmp_path, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
                           capture_output=True, text=True, timeout=180)
    assert built.returncode != 0 and "benchmarks/gone.md" in built.stdout + built.stderr


def test_check_command_names_the_bad_file(tmp_path):
    """`python docs/gen_benchmarks.py --check` passes on the repository's files, and on a bad file says which file
    and which field in one line, with a non-zero exit."""
    script = [sys.executable, str(REPO / "docs" / "gen_benchmarks.py"), "--check"]
    ok = subprocess.run(script, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "follow the schema" in ok.stdout, ok.stderr
    (tmp_path / "gpu_throughput.json").write_text(json.dumps({"benchmark": "gpu_throughput", "tables": []}))
    bad = subprocess.run(script + ["--results", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and bad.stderr.strip().splitlines() == [
        "gen_benchmarks.py: gpu_throughput.json: 'command' must be a str, got None"], bad.stderr
