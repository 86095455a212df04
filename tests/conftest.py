"""Shared fixtures: the in-repo reference target and helpers to build small stores."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
REFERENCE_TARGET = REPO_ROOT / "examples" / "reference-target"
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
EXAMPLES_DATA = REPO_ROOT / "examples" / "data"


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
