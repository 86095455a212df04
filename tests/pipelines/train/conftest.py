"""A real store from the reference target, built once per session for the trainer's tests.

``pipelines.extract.run_extraction`` (in process, no Ray) over the first 40 records of the shared
training data, truncated to 256 tokens: 27 samples, ~6.7k tokens (chats whose assistant turn starts
after 256 tokens are rejected by extraction). ``reference_lineage`` builds the lineage extraction
records, from the same identity functions, for tests that write small synthetic stores.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
REFERENCE_TARGET = REPO / "examples" / "reference-target"
TRAIN_DATA = REPO.parent / "shared" / "data" / "draft_train.jsonl"
if not TRAIN_DATA.exists():  # a clone without ../shared: the slice the repository ships
    TRAIN_DATA = REPO / "examples" / "data" / "draft_train_slice.jsonl"
AUX_LAYER_IDS = [2, 4, 5]
NUM_RECORDS = 40
MAX_LENGTH = 256


def reference_lineage(target_dir: Path, aux_layer_ids: list[int], max_length: int) -> Any:
    import hsstore
    from pipelines import target_identity as ti

    found = ti.target_identity(target_dir)
    return hsstore.Lineage(
        target=hsstore.TargetIdentity(
            name_or_path=str(target_dir),
            architecture=found["architecture"],
            model_type=found["model_type"],
            config_sha256=found["config_sha256"],
            weights_sha256=found["weight_files"],
            num_hidden_layers=found["num_hidden_layers"],
            hidden_size=found["hidden_size"],
            vocab_size=found["vocab_size"],
            dtype="float32",  # CPU bf16 matmuls are ~10x slower than float32 here
        ),
        tokenizer_sha256=ti.tokenizer_sha256(target_dir),
        chat_template_sha256=ti.chat_template_sha256(ti.read_chat_template(target_dir)),
        aux_layer_ids=aux_layer_ids,
        max_length=max_length,
        data_fingerprint="tests:draft_train.jsonl",
    )


def extract_reference_store(
    url: str,
    records_path: Path,
    *,
    num_records: int = NUM_RECORDS,
    max_length: int = MAX_LENGTH,
    aux_layer_ids: list[int] | None = None,
    codec: str = "bf16",
) -> str:
    """Run the project's extraction (in process, no Ray) over the first records, truncated."""
    from pipelines.extract import ExtractRecipe, run_extraction
    from pipelines.recipe import build_recipe

    recipe = build_recipe(
        ExtractRecipe,
        {
            "target": str(REFERENCE_TARGET),
            "data": [str(records_path)],
            "store": url,
            "limit": num_records,
            "executor": "local",
            # CPU bf16 matmuls are several times slower than float32 on these machines.
            "model": {"dtype": "float32", "device": "cpu"},
            "capture": {"aux_layer_ids": aux_layer_ids or AUX_LAYER_IDS},
            "codecs": {"aux_hidden_states": {"codec": codec}, "final_hidden_state": {"codec": codec}},
            "batching": {"max_length": max_length, "too_long": "truncate", "token_budget": 2048},
            "units": {"max_tokens": 2048},
        },
    )
    run_extraction(recipe)
    return url


@pytest.fixture(scope="session")
def records_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "draft_train.jsonl"
    shutil.copy(TRAIN_DATA, path)
    return path


@pytest.fixture(scope="session")
def reference_store(tmp_path_factory: pytest.TempPathFactory, records_path: Path) -> str:
    """The reference target's store: 40 records, aux layers [2, 4, 5] + final state, bf16."""
    url = str(tmp_path_factory.mktemp("ref-store") / "store")
    return extract_reference_store(url, records_path)


@pytest.fixture(scope="session")
def reference_target() -> Path:
    return REFERENCE_TARGET
