"""The suite on pytest-xdist's 2 workers (tests/conftest.py): a file marked ``alone`` runs with no other file beside
it, and the case report gathers the lines that the workers' tests recorded."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

TEST_FILE = '''
import json, os, time
import pytest
{marker}

@pytest.mark.parametrize("case", [0, 1])
def test_case(case, report):
    start = time.time()
    time.sleep(0.5)
    with open(os.environ["INTERVALS"], "a") as log:
        log.write(json.dumps([__name__, start, time.time()]) + "\\n")
    report(f"{{__name__}} case {{case}} held")
'''


def test_a_file_marked_alone_runs_beside_no_other_and_every_worker_reports(tmp_path: Path):
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), suite / "conftest.py")
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: see conftest\n")
    names = ["test_a", "test_b", "test_c", "test_d", "test_e"]
    for name in names:
        marker = "pytestmark = pytest.mark.alone" if name in ("test_b", "test_d") else ""
        (suite / f"{name}.py").write_text(TEST_FILE.format(marker=marker))
    intervals = tmp_path / "intervals.jsonl"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p",
                           "no:cacheprovider", "-c", str(suite / "pytest.ini"), str(suite)],
                          capture_output=True, text=True, timeout=180, cwd=suite,
                          env=dict(os.environ, INTERVALS=str(intervals)))
    assert done.returncode == 0 and "10 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    spans: dict = {}
    for name, start, end in map(json.loads, intervals.read_text().splitlines()):
        first, last = spans.get(name, (start, end))
        spans[name] = (min(first, start), max(last, end))
    assert sorted(spans) == names, spans
    for alone in ("test_b", "test_d"):
        for other in set(names) - {alone}:
            (a_start, a_end), (o_start, o_end) = spans[alone], spans[other]
            assert a_end <= o_start or o_end <= a_start, (alone, other, spans)
    # every test's line, from both workers, under the report's heading
    report = done.stdout.split("case report: what each case tried, what held")[-1]
    assert all(f"{name} case {case} held" in report for name in names for case in (0, 1)), done.stdout[-3000:]
