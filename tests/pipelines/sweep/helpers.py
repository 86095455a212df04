"""A tiny real store of the reference target (through the extraction pipeline) and a tiny training
recipe over it, shared by the sweep and notebook tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
REFERENCE_TARGET = REPO / "examples" / "reference-target"
TRAIN_SLICE = REPO / "examples" / "data" / "draft_train_slice.jsonl"


def extract_tiny_store(url: str, *, limit: int = 6, max_length: int = 128) -> str:
    """Run the real extraction, in process, over the first ``limit`` records of the in-repo slice."""
    from pipelines.extract import ExtractRecipe, run_extraction
    from pipelines.recipe import build_recipe

    recipe = build_recipe(ExtractRecipe, {
        "target": str(REFERENCE_TARGET), "data": [str(TRAIN_SLICE)], "store": url, "limit": limit,
        "executor": "local", "model": {"dtype": "float32", "device": "cpu"},
        "batching": {"max_length": max_length, "too_long": "truncate", "token_budget": 1024},
    })
    run_extraction(recipe)
    return url


def shared_tiny_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One tiny store per test session, wherever it is asked for first (sweep or notebook tests)."""
    path = tmp_path_factory.getbasetemp() / "tiny-reference-store"
    if not (path / "manifest.json").exists():
        extract_tiny_store(str(path))
    return str(path)


def tiny_train_base(store: str, **extra: Any) -> dict[str, Any]:
    """An EAGLE-4 training recipe small enough that one point trains in a few seconds on a CPU."""
    base: dict[str, Any] = {
        "store": store,
        "target": str(REFERENCE_TARGET),
        "output_dir": "set-by-the-sweep",
        "model": "eagle4",
        "max_steps": 1,
        "ttt_length": 2,
        "verify_weights": False,
        "device": "cpu",
        "draft": {"intermediate_size": 128, "sliding_window": 8, "vocab": {"draft_vocab_size": 256}},
        "loader": {"token_budget": 128, "shuffle_window": 16, "long_samples": "truncate", "read_threads": 1},
        "schedule": {"warmup_steps": 1},
        "log_every": 1,
    }
    base.update(extra)
    return base
