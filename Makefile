PYTHON ?= python3

.PHONY: install test test-fast lint typecheck demo bench-store

install:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test,dev]"

# The README's test command; .ci/run calls exactly this.
test: install
	$(PYTHON) -m pytest -q

test-fast: 
	$(PYTHON) -m pytest -q -m "not slow and not reliability"

lint:
	$(PYTHON) -m ruff check hsstore pipelines tests benchmarks

typecheck:
	$(PYTHON) -m mypy

demo: install
	hsstore demo

bench-store:
	$(PYTHON) benchmarks/bench_store.py
