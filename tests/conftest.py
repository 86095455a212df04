"""Shared fixtures: the in-repo reference target, the data, one reference store, one Ray session and
one S3 endpoint on loopback (moto) for the whole test session. Paths, store builders, tiny models and
the S3 server live in tests/support/."""

from __future__ import annotations

import os

# As the CLI does (pipelines/cli.py, OPENMP_DEFAULTS): torch's OpenMP threads must not spin while the
# loader's threads, Ray's workers or xdist's other processes need the same 2 cores. Before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import EXAMPLES_DATA, REFERENCE_TARGET, SHARED_DATA, TRAIN_DATA
from tests.support.ray_cluster import RAY_LEAN_ENV
from tests.support.schedule import longest_modules_first, recorded_seconds
from tests.support.stores import extract_reference_store

# Every Ray the suite starts (its own, the CLI's, a node's) without idle workers started ahead.
for _name, _value in RAY_LEAN_ENV.items():
    os.environ.setdefault(_name, _value)


@pytest.fixture(scope="session")
def reference_target() -> Path:
    """The in-repo copy of the reference target (a fresh clone has it without ../shared)."""
    assert (REFERENCE_TARGET / "config.json").exists(), REFERENCE_TARGET
    return REFERENCE_TARGET


@pytest.fixture(scope="session")
def shared_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A writable copy of ../shared/data (CI mounts shared/ read-only).

    A clone without ../shared beside it uses the slice the repository ships in examples/data, so
    the suite runs (on fewer records) anywhere."""
    target = tmp_path_factory.mktemp("shared-data")
    if SHARED_DATA.exists():
        for name in ("draft_train.jsonl", "eval_prompts.jsonl"):
            shutil.copy(SHARED_DATA / name, target / name)
    else:
        shutil.copy(EXAMPLES_DATA / "draft_train_slice.jsonl", target / "draft_train.jsonl")
        shutil.copy(EXAMPLES_DATA / "eval_prompts.jsonl", target / "eval_prompts.jsonl")
    return target


@pytest.fixture(scope="session")
def records_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The training records the reference store is extracted from (a private copy)."""
    path = tmp_path_factory.mktemp("data") / "draft_train.jsonl"
    shutil.copy(TRAIN_DATA, path)
    return path


@pytest.fixture(scope="session")
def reference_store(tmp_path_factory: pytest.TempPathFactory, records_path: Path) -> str:
    """The session's one store of real features: the reference target through the project's
    extraction, 40 records truncated to 256 tokens, aux layers [2, 4, 5] + final state, bf16.
    Shared: tests read it and never write into it."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return extract_reference_store(str(tmp_path_factory.mktemp("reference-store") / "store"), records_path)
    # Under xdist, one worker extracts it into the run's shared folder (the parent of the workers'
    # own) and the other waits for it and reads it, as xdist's docs share a session fixture.
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / "reference-store"
    with FileLock(f"{shared}.lock"):
        if not (shared / "done").exists():
            shutil.rmtree(shared, ignore_errors=True)
            extract_reference_store(str(shared / "store"), records_path)
            (shared / "done").touch()
    return str(shared / "store")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """The session's one S3 endpoint: moto's server on loopback in its own process
    (tests/support/s3.py), counting the requests it serves. The dummy AWS keys are exported (never a
    real account); the endpoint is not: tests point at it through ``s3_server.environ()`` or
    storage options."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from tests.support.s3 import DUMMY_KEYS, MotoS3

    for key, value in DUMMY_KEYS.items():
        os.environ.setdefault(key, value)
    with MotoS3() as server:
        yield server


@pytest.fixture(scope="session")
def s3_endpoint(s3_server: Any) -> str:
    """The URL of :func:`s3_server` (``http://127.0.0.1:<port>``)."""
    return s3_server.endpoint


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """One local Ray (2 CPUs) for every Ray test; started on first use (~3 s), shut down at the end
    only if this fixture started it."""
    ray = pytest.importorskip("ray")
    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        started = True
    yield ray
    if started:
        ray.shutdown()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The longest modules first, so that xdist's workers finish together (tests/support/schedule.py;
    # `make test` passes --no-loadscope-reorder, else xdist puts the modules with most tests first).
    longest_modules_first(items, recorded_seconds())
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# -- S3: a fresh store on the session's endpoint (s3_endpoint above), reached through s3fs --------


@pytest.fixture
def s3_store(s3_endpoint: str) -> tuple[str, dict[str, Any]]:
    """A fresh ``s3://`` store URL in its own bucket, and the storage options that reach it."""
    import s3fs

    options: dict[str, Any] = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    bucket = f"hsstore-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**options).mkdir(bucket)
    return f"s3://{bucket}/store", options
