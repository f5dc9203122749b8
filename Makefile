# Two commands for a newcomer:  `make demo` (the main job) and `make test` (the test suite, the docs' strict build
# included); `make docs` builds the docs site into site/.
# Each one sets up .venv on first use; later runs reuse it (re-installing only when pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test docs bench gpu-check install clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@# keep an existing torch (e.g. a CUDA build on a GPU box); otherwise take the pinned CPU-friendly release
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test,docs]"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m lean_transformer.demo $(ARGS)

# 2 pytest-xdist workers, each a test file at a time; a file marked `alone` runs by itself (tests/conftest.py: BoxShare)
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests $(ARGS)

# the docs site, strictly: a broken link or a results file that does not fit the schema fails the build
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

bench: $(STAMP)
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

# the CUDA tests (pytest -m cuda), the 2-peer swarms (trainers take the GPU by default) and the GPU benchmarks (memory beside
# the estimate, the trainer against plain training, Triton block-sparse, the feed-forward backward); one line and exit 0 without CUDA
gpu-check: $(STAMP)
	@if $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		$(PY) -m pytest -q -m cuda tests && \
		$(PY) -m pytest -q tests/test_trainer_host_gradients.py tests/test_trainer_swarm.py tests/test_diloco_swarm.py && \
		$(PY) benchmarks/gpu_memory.py && \
		$(PY) benchmarks/gpu_throughput.py && \
		$(PY) benchmarks/blocksparse.py && \
		$(PY) benchmarks/ffn_backward.py && \
		$(PY) benchmarks/throughput.py --steps 1; \
	else echo "gpu-check: skipped (no CUDA device: torch.cuda.is_available() is False)"; fi

clean:
	rm -rf $(VENV) build site *.egg-info
