PYTHON ?= python3

.PHONY: install peers test test-fast lint typecheck demo bench-store

# Everything a user runs ([all]: every job, s3://, plots) plus the test and lint tools. torch first,
# pinned: its CPU wheel is on CI's disk, and a looser pin pulls CUDA. `pip install hsstore` alone is
# the store library (tests/test_base_install.py checks it in a fresh venv).
install:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[all,test,dev]"

# The peers the tests check hsstore against, so that CI runs those tests instead of skipping them:
# speculators 0.9.0 (tests/pipelines/export/test_speculators.py), eagle-harness 0.1.3's validator
# (test_eagle4_harness.py) and SpecForge 0.2.0's offline trainer (tests/benchmarks/
# test_specforge_peer.py). Their import-time dependencies come from the extra (and accelerate for
# SpecForge); the packages themselves without their pins (CUDA torch, sglang, vLLM).
peers: install
	$(PYTHON) -m pip install -q -e ".[peers]"
	$(PYTHON) -m pip install -q --no-deps speculators==0.9.0 eagle-harness==0.1.3 specforge==0.2.0

# The README's test command; .ci/run calls exactly this. Two pytest-xdist workers, a test file each
# (--dist loadfile: a module's fixtures are built once): most of the suite's time is waiting on
# subprocesses, Ray and servers, so two workers on CI's 2 cores take ~0.6x the time of one
# (benchmarks/LOG.md). The modules go out longest first (tests/support/schedule.py), not xdist's
# most-tests-first. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: peers
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-fast: 
	$(PYTHON) -m pytest -q -m "not slow and not reliability"

lint:
	$(PYTHON) -m ruff check hsstore pipelines tests benchmarks

typecheck:
	$(PYTHON) -m mypy

demo: install
	hsstore demo

bench-store:
	$(PYTHON) -m benchmarks.bench_store
