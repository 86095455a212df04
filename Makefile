PYTHON ?= python3

.PHONY: install peers test test-fast lint typecheck demo bench-store

install:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test,dev]"

# speculators 0.9.0 for the export tests (tests/pipelines/export/test_speculators.py): its
# import-time dependencies from the extra, the package itself without its CUDA-torch pins.
peers: install
	$(PYTHON) -m pip install -q -e ".[peers]"
	$(PYTHON) -m pip install -q --no-deps speculators==0.9.0

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
