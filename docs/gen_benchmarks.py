"""The benchmark pages of the docs, generated from ``benchmarks/results/*.json`` so that no measured number is typed
by hand in the docs.

Every results file has the shape all benchmarks write (see "How the benchmark pages are made" in
``docs/benchmarks/index.md``)::

    {"benchmark": "wan", "command": "python benchmarks/wan.py ...", "machine": "2 CPU cores ...",
     "date": "2026-11-25", "commit": "cfdcdba" or null, "baseline": "what the ratios compare to",
     "tables": [{"title": "...", "columns": [...], "rows": [[...], ...], "notes": "..."}],
     "plots": ["wan.png"], "raw": {...}}

optionally with "title" (the page's title; default: the file's name), "summary" (markdown above the tables),
"notes" (markdown below them) and, per table, "description" (markdown above it). Each file becomes one page,
``benchmarks/<file name>.md``, with no per-file code; ``raw`` is never rendered.

Used two ways: as a mkdocs hook (``hooks:`` in mkdocs.yml: the pages are added to the build and to the nav's
"Benchmarks" section, and ``<!-- benchmark-list -->`` in ``benchmarks/index.md`` becomes the list of pages), and
from the command line: ``python docs/gen_benchmarks.py --check`` validates every results file,
``python docs/gen_benchmarks.py --out DIR`` writes the pages as markdown files, and
``python docs/gen_benchmarks.py --readme`` refills the README's result blocks (``<!-- results NAME INDEX -->`` ...
``<!-- /results -->``: table INDEX of ``NAME.json``), which ``tests/test_docs.py`` checks are up to date. mkdocs-gen-files would do the hook's
part too, but it is one more build dependency for twenty lines.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
PAGES = "benchmarks"  # the pages' folder in the site
LIST_MARKER = "<!-- benchmark-list -->"
REQUIRED = {"benchmark": str, "command": str, "machine": str, "date": str, "baseline": str, "tables": list}
OPTIONAL = {"commit": (str, type(None)), "plots": list, "raw": object, "title": str, "summary": str, "notes": str}


class ResultsError(ValueError):
    """A results file that does not follow the schema; the message names the file and the field."""


def validate(data: Any, where: str, results_dir: Path = RESULTS) -> dict:
    """Check one results file's content against the schema; return it."""
    if not isinstance(data, dict):
        raise ResultsError(f"{where}: expected a JSON object, got {type(data).__name__}")
    for key, kind in REQUIRED.items():
        if not isinstance(data.get(key), kind):
            raise ResultsError(f"{where}: {key!r} must be a {kind.__name__}, got {data.get(key)!r:.60}")
    for key, kind in OPTIONAL.items():
        if key in data and not isinstance(data[key], kind):
            raise ResultsError(f"{where}: {key!r} has the wrong type ({type(data[key]).__name__})")
    unknown = set(data) - set(REQUIRED) - set(OPTIONAL)
    if unknown:
        raise ResultsError(f"{where}: unknown keys {sorted(unknown)} (put anything else under 'raw')")
    try:
        datetime.date.fromisoformat(data["date"])
    except ValueError:
        raise ResultsError(f"{where}: 'date' must be YYYY-MM-DD, got {data['date']!r}") from None
    if not data["tables"]:
        raise ResultsError(f"{where}: 'tables' is empty")
    for i, table in enumerate(data["tables"]):
        at = f"{where}: tables[{i}]"
        if not isinstance(table, dict) or not isinstance(table.get("title"), str):
            raise ResultsError(f"{at}: needs a 'title'")
        columns, rows = table.get("columns"), table.get("rows")
        if not isinstance(columns, list) or not columns or not isinstance(rows, list):
            raise ResultsError(f"{at} ({table['title']!r}): needs 'columns' and 'rows' lists")
        for j, row in enumerate(rows):
            if not isinstance(row, list) or len(row) != len(columns):
                size = len(row) if isinstance(row, list) else "?"
                raise ResultsError(f"{at} ({table['title']!r}): row {j} has {size} cells for {len(columns)} columns")
        extra = set(table) - {"title", "columns", "rows", "notes", "description"}
        if extra:
            raise ResultsError(f"{at}: unknown keys {sorted(extra)}")
    for plot in data.get("plots", []):
        if not isinstance(plot, str) or "/" in plot or not (results_dir / plot).is_file():
            raise ResultsError(f"{where}: plot {plot!r} is not a file beside the results file")
    return data


def load_results(results_dir: Path = RESULTS) -> dict[str, dict]:
    """Every results file, validated, by its name (the page's name)."""
    found = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ResultsError(f"{path.name}: not JSON ({error})") from None
        found[path.stem] = validate(data, path.name, results_dir)
    return found


def title_of(name: str, data: dict) -> str:
    return data.get("title") or name.replace("_", " ").capitalize()


def cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e4 else format(value, ".4g")
    return re.sub(r"\s*\n\s*", " ", str(value)).replace("|", "\\|")


def looks_numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) or cell(value).replace("*", "").strip()[:1].isdigit()


def prose(markdown: str) -> str:
    """Markdown as written for GitHub (CommonMark) made fit for Python-Markdown, which needs a blank line before a
    list that follows a paragraph (fenced code is left as it is)."""
    lines = markdown.split("\n")
    out, fenced = lines[:1], lines[0].lstrip().startswith("```")
    for previous, line in zip(lines, lines[1:]):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif (not fenced and re.match(r"\s*[-*] ", line) and previous.strip()
              and not re.match(r"\s*([-*] |\s)", previous)):
            out.append("")
        out.append(line)
    return "\n".join(out)


def render_table(table: dict) -> str:
    """Columns whose filled cells are mostly numbers are right-aligned."""
    numeric = []
    for i in range(len(table["columns"])):
        filled = [row[i] for row in table["rows"] if cell(row[i])]
        numeric.append(bool(filled) and 2 * sum(map(looks_numeric, filled)) >= len(filled))
    lines = ["| " + " | ".join(cell(c) for c in table["columns"]) + " |",
             "|" + "|".join("---:" if is_number and i else "---" for i, is_number in enumerate(numeric)) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table["rows"]]
    return "\n".join(lines)


def render_page(name: str, data: dict) -> str:
    """One benchmark page in markdown."""
    commit = f"`{data['commit']}`" if data.get("commit") else "not recorded"
    out = [f"# {title_of(name, data)}", ""]
    if data.get("summary"):
        out += [prose(data["summary"]), ""]
    out += ["| | |", "|---|---|",
            f"| command | `{cell(data['command'])}` |",
            f"| machine | {cell(data['machine'])} |",
            f"| date | {data['date']} |",
            f"| commit | {commit} |",
            f"| baseline | {cell(data['baseline'])} |",
            f"| results file | `benchmarks/results/{name}.json` |", ""]
    for table in data["tables"]:
        out += [f"## {table['title']}", ""]
        if table.get("description"):
            out += [prose(table["description"]), ""]
        out += [render_table(table), ""]
        if table.get("notes"):
            out += [prose(table["notes"]), ""]
    for plot in data.get("plots", []):
        out += [f"![{plot}]({plot})", ""]
    if data.get("notes"):
        out += ["## Notes", "", prose(data["notes"]), ""]
    return "\n".join(out)


def render_list(results: dict[str, dict]) -> str:
    """The index's table of every benchmark page."""
    lines = ["| page | machine | date |", "|---|---|---|"]
    lines += [f"| [{cell(title_of(name, data))}]({name}.md) | {cell(data['machine'])} | {data['date']} |"
              for name, data in results.items()]
    return "\n".join(lines)


# --- the mkdocs hook -----------------------------------------------------------------------------------------------

README = REPO / "README.md"
README_BLOCK = re.compile(r"(<!-- results (\w+) (\d+) -->\n).*?(<!-- /results -->)", re.S)


def render_readme(readme: str, results: dict[str, dict]) -> str:
    """``readme`` with each result block refilled: the table, then its file's machine, date and commit."""
    def block(match: re.Match) -> str:
        name, index = match.group(2), int(match.group(3))
        if name not in results or index >= len(results[name]["tables"]):
            raise ResultsError(f"README: no table {index} in {name}.json")
        data = results[name]
        table = data["tables"][index]
        source = f"{data['machine']}, {data['date']}" + (f", commit {data['commit']}" if data.get("commit") else "")
        return (f"{match.group(1)}{table['title']} (`{name}.json`; {source}):\n\n{render_table(table)}\n"
                f"{match.group(4)}")
    return README_BLOCK.sub(block, readme)


def on_config(config):
    """Add one nav entry per results file under the nav's "Benchmarks" section."""
    results = load_results()
    pages = [{title_of(name, data): f"{PAGES}/{name}.md"} for name, data in results.items()]
    for entry in config["nav"] or []:
        if isinstance(entry, dict) and "Benchmarks" in entry:
            entry["Benchmarks"] = [*entry["Benchmarks"], *pages]
            break
    else:
        raise ResultsError("mkdocs.yml's nav needs a 'Benchmarks' section for the generated pages")
    return config


def on_files(files, config):
    from mkdocs.structure.files import File

    for name, data in load_results().items():
        files.append(File.generated(config, f"{PAGES}/{name}.md", content=render_page(name, data)))
        for plot in data.get("plots", []):
            files.append(File.generated(config, f"{PAGES}/{plot}", abs_src_path=str(RESULTS / plot)))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == f"{PAGES}/index.md":
        markdown = markdown.replace(LIST_MARKER, render_list(load_results()))
    return prose(markdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="validate every results file and exit")
    parser.add_argument("--out", type=Path, help="write the pages (markdown) into this folder")
    parser.add_argument("--readme", action="store_true", help="refill the README's result blocks")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results folder (default: %(default)s)")
    args = parser.parse_args()
    try:
        results = load_results(args.results)
    except ResultsError as error:
        sys.exit(f"gen_benchmarks.py: {error}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for name, data in results.items():
            (args.out / f"{name}.md").write_text(render_page(name, data))
    if args.readme:
        try:
            README.write_text(render_readme(README.read_text(), results))
        except ResultsError as error:
            sys.exit(f"gen_benchmarks.py: {error}")
    print(f"{len(results)} results files follow the schema")


if __name__ == "__main__":
    main()
