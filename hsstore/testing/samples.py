"""Tiny features, lineage and random samples for the contract suites (numpy only, no torch)."""

from __future__ import annotations

from typing import Any

import numpy as np

from hsstore.format import codecs
from hsstore.format.features import Compression, FeatureSpec
from hsstore.lineage import Lineage
from hsstore.storage import StoreLocation
from hsstore.store_writer import StoreWriter

HIDDEN = 16
NUM_AUX = 3


def make_specs(codec: str = "bf16", compression: Compression = "none", hidden: int = HIDDEN) -> list[FeatureSpec]:
    """Two features with tiny chunks, so that a few hundred tokens span several inner chunks and
    Zarr shard files."""
    return [
        FeatureSpec(name="aux_hidden_states", shape=(NUM_AUX, hidden), codec=codec, compression=compression, chunk_bytes=1024, shard_chunks=2),
        FeatureSpec(name="final_hidden_state", shape=(hidden,), codec=codec, compression=compression, chunk_bytes=1024, shard_chunks=3),
    ]


def make_lineage(**overrides: Any) -> Lineage:
    return Lineage(aux_layer_ids=[2, 4, 5], max_length=512, code_version="hsstore.testing", **overrides)


def make_sample(index: int, num_tokens: int, hidden: int = HIDDEN, seed: int = 0) -> dict[str, Any]:
    """The keyword arguments of ``ShardWriter.add_sample`` for one random sample."""
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


def write_samples(
    location: StoreLocation, num_samples: int, *, shard_max_tokens: int = 200, codec: str = "bf16", compression: Compression = "none"
) -> list[dict[str, Any]]:
    """Write and commit ``num_samples`` random samples (0 to 59 tokens each); return them."""
    rng = np.random.default_rng(num_samples)
    samples = [make_sample(i, int(rng.integers(0, 60))) for i in range(num_samples)]
    with StoreWriter(location, make_specs(codec, compression), make_lineage(), shard_max_tokens=shard_max_tokens) as writer:
        for sample in samples:
            writer.add_sample(**sample)
    return samples


def stored_values(spec: FeatureSpec, values: np.ndarray) -> np.ndarray:
    """What a reader must return for ``values`` written with ``spec``: the codec's round trip."""
    return codecs.decode_numpy(spec, codecs.encode(spec, values))
