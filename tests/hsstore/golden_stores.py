"""Golden stores: tiny stores kept in ``tests/data/golden/``, one per compression, each holding one
feature per codec. They pin the on-disk format: ``test_golden.py`` reads them bit-exactly with
zarr-python and with hsstore, and writes the same inputs again to check every file comes out
byte-identical.

They were written by the writer of commit 94ed57d (before the format moved into
``hsstore/format/``). Regenerate only for a deliberate format change (and say so in the commit)::

    PYTHONPATH=$PWD python -m tests.hsstore.golden_stores

Next to each store, ``expected.npz`` holds the inputs (``input.<feature>``, float32/int32), the
stored bits of every array over each whole shard (``bits.<shard_id>.<array>``) and the numpy
decoding (``decoded.<shard_id>.<feature>``), as that writer produced them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

import hsstore
from hsstore import FeatureSpec, Lineage
from tests.support.paths import REPO_ROOT

GOLDEN_DIR = REPO_ROOT / "tests" / "data" / "golden"
COMPRESSIONS = ("none", "zstd", "blosc")
SAMPLE_LENGTHS = (7, 0, 13, 1, 19)
SHARD_MAX_TOKENS = 20  # two store shards: [7, 0, 13] and [1, 19]


def golden_specs(compression: str) -> list[FeatureSpec]:
    """One feature per codec; chunking chosen so arrays span several inner chunks and Zarr shards."""
    return [
        FeatureSpec(name="bf16_values", shape=(2, 16), codec="bf16", compression=compression, chunk_tokens=8, shard_chunks=2),
        FeatureSpec(name="fp8_values", shape=(2, 16), codec="fp8_e4m3", compression=compression, chunk_tokens=4),
        FeatureSpec(name="float32_values", shape=(4,), codec="float32", compression=compression, chunk_tokens=8),
        FeatureSpec(name="int32_values", shape=(3,), codec="int32", compression=compression, chunk_tokens=4, shard_chunks=3),
    ]


def golden_lineage() -> Lineage:
    return Lineage(aux_layer_ids=[2, 4, 5], max_length=64, code_version="golden")


def golden_inputs() -> dict[str, np.ndarray]:
    """The values written, concatenated over every sample (token axis first)."""
    rng = np.random.default_rng(20261201)
    num_tokens = sum(SAMPLE_LENGTHS)
    values = rng.standard_normal((num_tokens, 2, 16)).astype(np.float32) * 3
    values[3, 1, 5] = 400.0  # an outlier row for the fp8 scale
    values[5, 0, :] = 0.0  # an all-zero row (fp8 scale 1)
    return {
        "input_ids": rng.integers(0, 50_000, num_tokens).astype(np.int32),
        "loss_mask": (rng.random(num_tokens) < 0.6).astype(np.uint8),
        "bf16_values": values,
        "fp8_values": values[::-1].copy(),
        "float32_values": rng.standard_normal((num_tokens, 4)).astype(np.float32),
        "int32_values": rng.integers(-(2**31), 2**31 - 1, (num_tokens, 3)).astype(np.int32),
    }


def write_golden(url: str | Path, compression: str, inputs: dict[str, np.ndarray] | None = None) -> None:
    """Write the golden store for ``compression`` at ``url`` with the current writer."""
    inputs = golden_inputs() if inputs is None else inputs
    specs = golden_specs(compression)
    with hsstore.StoreWriter(str(url), specs, golden_lineage(), shard_max_tokens=SHARD_MAX_TOKENS) as writer:
        offset = 0
        for index, length in enumerate(SAMPLE_LENGTHS):
            span = slice(offset, offset + length)
            writer.add_sample(
                sample_id=f"golden-{index}",
                source_id=f"record-{index}",
                input_ids=inputs["input_ids"][span],
                loss_mask=inputs["loss_mask"][span],
                features={spec.name: inputs[spec.name][span] for spec in specs},
            )
            offset += length


def store_files(root: Path) -> dict[str, bytes]:
    """Every file of a store keyed by its path with the shard folder's random attempt suffix
    removed (``shards/s-000000.<attempt>/...`` -> ``shards/s-000000/...``); the manifest (it holds
    timestamps and those suffixes, compared by :func:`manifest_essentials`) and its lock excluded."""
    files = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.name in ("manifest.json", "manifest.lock", "expected.npz"):
            continue
        parts = list(path.relative_to(root).parts)
        if parts[0] == "shards":
            parts[1] = parts[1].split(".", 1)[0]
        files["/".join(parts)] = path.read_bytes()
    return files


def manifest_essentials(root: Path) -> dict[str, Any]:
    """The manifest without what differs between two writes of the same data: timestamps, the
    shard folders' random attempt suffixes and the checksums that hash those paths."""
    manifest = json.loads((root / "manifest.json").read_text())
    for key in ("created_at", "updated_at"):
        manifest.pop(key)
    for shard in manifest["shards"]:
        folder = shard.pop("path")
        shard.pop("checksum")
        shard.pop("created_at", None)
        plain = folder.split(".", 1)[0]
        for entry in shard["files"]:
            entry["path"] = entry["path"].replace(folder, plain, 1)
    return manifest


def expected_arrays(url: str | Path) -> dict[str, Any]:
    """The ``expected.npz`` content of a store: inputs, stored bits, numpy decoding."""
    store = hsstore.open_store(str(url))
    result: dict[str, Any] = {f"input.{k}": v for k, v in golden_inputs().items()}
    for shard in store.shards:
        raw = store.read_token_range(shard.shard_id, 0, shard.num_tokens)
        for key, bits in raw.items():
            result[f"bits.{shard.shard_id}.{key}"] = np.asarray(bits)
        for name, spec in store.features.items():
            result[f"decoded.{shard.shard_id}.{name}"] = hsstore.format.codecs.decode_numpy(spec, raw)
    return result


def main() -> None:
    for compression in COMPRESSIONS:
        target = GOLDEN_DIR / compression
        shutil.rmtree(target, ignore_errors=True)
        write_golden(target, compression)
        (target / "manifest.lock").unlink(missing_ok=True)  # the committers' lock, not format
        np.savez_compressed(target / "expected.npz", **expected_arrays(target))
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
