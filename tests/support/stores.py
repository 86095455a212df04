"""The one place tests build stores (paths live in :mod:`tests.support.paths`).

- synthetic stores (:func:`write_store`): random features written through the public writer, for
  store, loader and fault tests;
- stores of real features (:func:`extract_reference_store`): the reference target through the
  project's own extraction; tests/conftest.py builds one per session (``reference_store``);
- :func:`reference_lineage`: the lineage extraction records for the reference target, for tests
  that write small synthetic stores which must pass the trainer's lineage check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import hsstore
from hsstore import Lineage
from hsstore.testing.samples import HIDDEN, NUM_AUX, make_sample, make_specs  # noqa: F401 (re-exported for the tests)
from tests.support.paths import REFERENCE_AUX_LAYER_IDS, REFERENCE_TARGET

# -- synthetic stores (the samples and specs are hsstore.testing's, as the contract suite's) ----------


def make_lineage(**overrides: Any) -> Lineage:
    return Lineage(aux_layer_ids=[2, 4, 5], max_length=512, code_version="test", **overrides)


def write_store(url: str, num_samples: int = 12, shard_max_tokens: int = 200, codec: str = "bf16", compression: str = "none", seed: int = 0, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Write ``num_samples`` random samples (lengths 0..60) and return them."""
    rng = np.random.default_rng(seed)
    samples = [make_sample(i, int(rng.integers(0, 60)), seed=seed) for i in range(num_samples)]
    with hsstore.StoreWriter(url, make_specs(codec, compression), make_lineage(), shard_max_tokens=shard_max_tokens, storage_options=storage_options) as writer:
        for sample in samples:
            writer.add_sample(**sample)
    return samples


# -- stores of real features ---------------------------------------------------------------------


def reference_lineage(target_dir: Path, aux_layer_ids: list[int], max_length: int) -> Any:
    from pipelines import target_identity as ti

    return hsstore.Lineage(
        # float32: CPU bf16 matmuls are ~10x slower than float32 here
        target=ti.identity_model(target_dir, dtype="float32"),
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
    num_records: int = 40,
    max_length: int = 256,
    aux_layer_ids: list[int] | None = None,
    codec: str = "bf16",
    token_budget: int = 2048,
) -> str:
    """Run the project's extraction (in process, no Ray) over the first records, truncated: the
    one way tests build a store of real features."""
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
            "capture": {"aux_layer_ids": aux_layer_ids or REFERENCE_AUX_LAYER_IDS},
            "codecs": {"aux_hidden_states": {"codec": codec}, "final_hidden_state": {"codec": codec}},
            "batching": {"max_length": max_length, "too_long": "truncate", "token_budget": token_budget},
            "units": {"max_tokens": max(token_budget, 2048)},
        },
    )
    run_extraction(recipe)
    return url
