"""Small builders for store tests: synthetic features written through the public API."""

from __future__ import annotations

from typing import Any

import numpy as np

import hsstore
from hsstore import FeatureSpec, Lineage

HIDDEN = 16
NUM_AUX = 3


def make_specs(codec: str = "bf16", compression: str = "none", hidden: int = HIDDEN) -> list[FeatureSpec]:
    # Tiny chunks so that a few hundred tokens span several inner chunks and Zarr shard files.
    return [
        FeatureSpec(name="aux_hidden_states", shape=(NUM_AUX, hidden), codec=codec, compression=compression, chunk_bytes=1024, shard_chunks=2),
        FeatureSpec(name="final_hidden_state", shape=(hidden,), codec=codec, compression=compression, chunk_bytes=1024, shard_chunks=3),
    ]


def make_lineage(**overrides: Any) -> Lineage:
    return Lineage(aux_layer_ids=[2, 4, 5], max_length=512, code_version="test", **overrides)


def make_sample(index: int, num_tokens: int, hidden: int = HIDDEN, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed * 100_003 + index)
    return {
        "sample_id": f"sample-{index:05d}",
        "source_id": f"record-{index}",
        "input_ids": rng.integers(0, 1000, num_tokens).astype(np.int32),
        "loss_mask": (rng.random(num_tokens) < 0.7).astype(np.uint8),
        "features": {
            "aux_hidden_states": rng.standard_normal((num_tokens, NUM_AUX, hidden)).astype(np.float32),
            "final_hidden_state": rng.standard_normal((num_tokens, hidden)).astype(np.float32),
        },
    }


def write_store(url: str, num_samples: int = 12, shard_max_tokens: int = 200, codec: str = "bf16", compression: str = "none", seed: int = 0, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Write ``num_samples`` random samples (lengths 0..60) and return them."""
    rng = np.random.default_rng(seed)
    samples = [make_sample(i, int(rng.integers(0, 60)), seed=seed) for i in range(num_samples)]
    with hsstore.StoreWriter(url, make_specs(codec, compression), make_lineage(), shard_max_tokens=shard_max_tokens, storage_options=storage_options) as writer:
        for sample in samples:
            writer.add_sample(**sample)
    return samples
