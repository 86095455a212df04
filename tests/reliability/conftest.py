"""Fixtures of the reliability suite: an S3-compatible endpoint (moto's server on loopback), a Ray
session, and tiny extraction inputs on the in-repo reference target.

Every test here is marked ``reliability`` (``pytest -m reliability`` runs the suite alone); the
hook below refuses a test module that forgets the mark, so the selection cannot silently shrink.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.factories import REFERENCE_TARGET  # noqa: F401 (re-used by the suite)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here and "reliability" not in item.keywords:
            raise pytest.UsageError(f"{item.nodeid}: tests/reliability tests must be marked reliability")


# -- S3: moto's server mode on 127.0.0.1, reached through s3fs as any S3-compatible store -------


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """An S3-compatible endpoint on loopback (moto's ThreadedMotoServer, as s3fs's own tests use)."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    # Dummy credentials for the local endpoint only; never a real account.
    for key, value in {
        "AWS_ACCESS_KEY_ID": "hsstore-test",
        "AWS_SECRET_ACCESS_KEY": "hsstore-test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(key, value)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_store(s3_endpoint: str) -> tuple[str, dict[str, Any]]:
    """A fresh ``s3://`` store URL in its own bucket, and the storage options that reach it."""
    import s3fs

    options: dict[str, Any] = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    bucket = f"hsstore-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**options).mkdir(bucket)
    return f"s3://{bucket}/store", options


@pytest.fixture
def memory_url() -> Iterator[str]:
    import fsspec

    url = f"memory://hsstore-reliability-{uuid.uuid4().hex}"
    yield url
    memory = fsspec.filesystem("memory")
    if memory.exists(url):
        memory.rm(url, recursive=True)


# -- extraction inputs ---------------------------------------------------------------------------


def write_text_records(path: Path, num_records: int, *, words: int = 12, start: int = 0) -> Path:
    """Short, distinct plain-text records (ids ``r<n>``): a few dozen tokens each."""
    with path.open("w", encoding="utf-8") as handle:
        for n in range(start, start + num_records):
            text = " ".join(f"word{(n * 7 + k) % 97}" for k in range(words)) + f" record {n}."
            handle.write(json.dumps({"id": f"r{n}", "text": text}) + "\n")
    return path


def extract_overrides(store: str, data: Path, **extra: Any) -> list[str]:
    """``--set`` overrides for a fast CPU extraction of the reference target (float32: CPU bf16
    matmuls are several times slower)."""
    settings: dict[str, Any] = {
        "target": str(REFERENCE_TARGET),
        "data": f"[{data}]",
        "store": store,
        "model.dtype": "float32",
        "model.device": "cpu",
        "batching.max_length": 64,
        "batching.token_budget": 256,
        "units.max_tokens": 160,
        "codecs.chunk_bytes": 65536,
        "ray.num_workers": 2,
        "ray.num_cpus_per_worker": 1,
    }
    settings.update(extra)
    return [f"{key}={value}" for key, value in settings.items()]


def load_extract_recipe(store: str, data: Path, **extra: Any) -> Any:
    from pipelines.extract.recipe import ExtractRecipe
    from pipelines.recipe import build_recipe

    return build_recipe(ExtractRecipe, {}, extract_overrides(store, data, **extra))


def expected_sample_ids(recipe: Any) -> set[str]:
    """The sample ids a complete extraction of ``recipe`` must hold: its own plan, re-derived."""
    from pipelines.extract.driver import make_sample_tokenizer
    from pipelines.extract.plan import read_samples

    tokenizer = make_sample_tokenizer(recipe, recipe.tokenizer.path or recipe.target)
    return {s.sample_id for s in read_samples(recipe, tokenizer).samples}
