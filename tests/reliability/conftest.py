"""Fixtures of the reliability suite: a ``memory://`` store and tiny extraction inputs on the in-repo
reference target (the S3 endpoint on loopback, ``s3_endpoint`` / ``s3_store``, is tests/conftest.py's).

Every test here is marked ``reliability`` (``pytest -m reliability`` runs the suite alone); the
hook below refuses a test module that forgets the mark, so the selection cannot silently shrink.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import REFERENCE_TARGET  # noqa: F401 (re-used by the suite)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here and "reliability" not in item.keywords:
            raise pytest.UsageError(f"{item.nodeid}: tests/reliability tests must be marked reliability")


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
    """The sample ids a complete extraction of ``recipe`` must hold: its own plan, re-derived by
    the streaming planner (no journal, nothing written)."""
    from pipelines.extract.planner import StreamPlanner
    from pipelines.extract.tokenizer_pool import make_sample_tokenizer

    tokenizer_dir = recipe.tokenizer.path or recipe.target
    planner = StreamPlanner(recipe, make_sample_tokenizer(recipe, tokenizer_dir), tokenizer_dir)
    return {sample_id for window in planner.windows() for sample_id, _ in window.samples}
