"""A real store from the reference target, built once per session for the trainer's tests.

Uses ``pipelines.extract.run_extraction`` when it exists (the project's extraction, in process);
until then a plain transformers forward with ``output_hidden_states`` written with ``StoreWriter``,
following the DESIGN.md conventions (aux id i = hidden_states[i]; final state post-norm) and
recording the same lineage extraction records (pipelines.target_identity).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[3]
REFERENCE_TARGET = REPO / "examples" / "reference-target"
TRAIN_DATA = REPO.parent / "shared" / "data" / "draft_train.jsonl"
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


def build_reference_store(
    url: str,
    records_path: Path,
    *,
    target_dir: Path = REFERENCE_TARGET,
    num_records: int = NUM_RECORDS,
    max_length: int = MAX_LENGTH,
    aux_layer_ids: list[int] | None = None,
    codec: str = "bf16",
    lineage: Any = None,
) -> str:
    """Run the reference target over the first ``num_records`` records (truncated to ``max_length``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hsstore

    aux_layer_ids = aux_layer_ids or AUX_LAYER_IDS
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    hidden = model.config.hidden_size
    specs = [
        hsstore.FeatureSpec(name="aux_hidden_states", shape=(len(aux_layer_ids), hidden), codec=codec),
        hsstore.FeatureSpec(name="final_hidden_state", shape=(hidden,), codec=codec),
    ]
    lineage = lineage or reference_lineage(target_dir, aux_layer_ids, max_length)
    records = [json.loads(line) for line in records_path.read_text().splitlines()[:num_records]]
    with hsstore.StoreWriter(url, specs, lineage, shard_max_tokens=2048) as writer:
        for record in records:
            if "messages" in record:
                out = tokenizer.apply_chat_template(
                    record["messages"], tokenize=True, return_assistant_tokens_mask=True, return_dict=True
                )
                ids, mask = out["input_ids"], out["assistant_masks"]
            else:
                ids = tokenizer(record["text"])["input_ids"]
                mask = [1] * len(ids)
            ids, mask = ids[:max_length], mask[:max_length]
            if sum(mask) == 0:
                continue
            with torch.no_grad():
                states = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
            writer.add_sample(
                sample_id=f"ref-{record['id']}",
                source_id=record["id"],
                input_ids=np.asarray(ids),
                loss_mask=np.asarray(mask),
                features={
                    "aux_hidden_states": torch.stack([states[i][0] for i in aux_layer_ids], dim=1),
                    "final_hidden_state": states[-1][0],  # post-norm (transformers applies the norm)
                },
            )
    return url


def _extraction_available() -> bool:
    try:
        from pipelines.extract import run_extraction  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="session")
def records_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "draft_train.jsonl"
    shutil.copy(TRAIN_DATA, path)
    return path


@pytest.fixture(scope="session")
def reference_store(tmp_path_factory: pytest.TempPathFactory, records_path: Path) -> str:
    """The reference target's store: 40 records, aux layers [2, 4, 5] + final state, bf16."""
    url = str(tmp_path_factory.mktemp("ref-store") / "store")
    return build_reference_store(url, records_path)


@pytest.fixture(scope="session")
def reference_target() -> Path:
    return REFERENCE_TARGET
