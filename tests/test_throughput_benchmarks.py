"""The GPU-throughput and host-throughput benchmarks run end to end on the CPU (a tiny model, a small working set)
and write results in the benchmarks' JSON shape; the figures themselves are not judged here (timings are noisy)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
KEYS = {"benchmark", "command", "machine", "date", "commit", "baseline", "tables"}


def run(script: str, *args: str, output: Path) -> dict:
    subprocess.run([sys.executable, f"benchmarks/{script}", *args, "--output", str(output)], cwd=REPO, env=ENV,
                   check=True, timeout=240, capture_output=True)
    result = json.loads(output.read_text())
    assert KEYS <= result.keys()
    for table in result["tables"]:
        assert table["rows"] and all(len(row) == len(table["columns"]) for row in table["rows"])
    return result


def test_gpu_throughput_tiny_on_cpu(tmp_path):
    result = run("gpu_throughput.py", "--sizes", "tiny", "--accumulation", "2", "--device_accumulation", "1", "2",
                 output=tmp_path / "gpu.json")
    (table,) = result["tables"]
    assert [row[1] for row in table["rows"]] == ["plain", "trainer", "trainer, device sums of 2"]
    for row in table["rows"]:
        assert row[3] > 0 and row[4] > 0  # micro-batch and whole-step tokens/s
    assert table["rows"][0][6] == "1.00x"


def test_host_throughput_small(tmp_path):
    result = run("host_throughput.py", "--elements", str(2 ** 20), "--threads", "1", "--repeats", "1",
                 "--accumulation", "1", "4", output=tmp_path / "host.json")
    rates = result["raw"]["rates"]["1"]
    assert rates["add_params_per_s"] > 0 and rates["lamb_params_per_s"] > 0
    fastest = [row[-1] for row in result["tables"][1]["rows"] if row[0] == "1.3B"]
    assert fastest[0] < fastest[1]  # a step amortised over more micro-batches leaves the GPU more room


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the GPU sizes run")
def test_gpu_throughput_refuses_gpu_sizes_without_cuda(tmp_path):
    process = subprocess.run([sys.executable, "benchmarks/gpu_throughput.py", "--sizes", "1.3B",
                              "--output", str(tmp_path / "x.json")], cwd=REPO, env=ENV, timeout=120,
                             capture_output=True, text=True)
    assert process.returncode != 0 and "only --sizes tiny" in process.stderr
