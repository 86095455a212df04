"""The on-disk format is pinned by the golden stores in tests/data/golden (see golden_stores.py):
zarr-python and hsstore read them bit-exactly, and the writer reproduces them byte for byte."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import hsstore
from hsstore.manifest import decode_sample_tokens
from tests.hsstore.golden_stores import (
    COMPRESSIONS,
    GOLDEN_DIR,
    SAMPLE_LENGTHS,
    golden_inputs,
    manifest_essentials,
    store_files,
    write_golden,
)


def _expected(compression: str) -> dict[str, np.ndarray]:
    with np.load(GOLDEN_DIR / compression / "expected.npz") as data:
        return {key: data[key] for key in data.files}


def _bytes_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_zarr_python_reads_golden_bit_exactly(compression: str) -> None:
    import zarr
    from zarr.storage import LocalStore

    store = hsstore.open_store(str(GOLDEN_DIR / compression))
    expected = _expected(compression)
    checked = 0
    for shard in store.shards:
        group = zarr.open_group(LocalStore(GOLDEN_DIR / compression / shard.path / "features.zarr", read_only=True), mode="r")
        for spec in store.features.values():
            for array_name in spec.array_names():
                array = group[array_name]
                assert isinstance(array, zarr.Array)
                assert _bytes_equal(array[:], expected[f"bits.{shard.shard_id}.{array_name}"]), array_name
                checked += 1
    assert checked == 2 * 5  # two shards, four features, fp8's scales


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_hsstore_reads_golden_bit_exactly(compression: str) -> None:
    store = hsstore.open_store(str(GOLDEN_DIR / compression))
    expected = _expected(compression)
    inputs = golden_inputs()
    assert store.num_samples == len(SAMPLE_LENGTHS) and store.num_tokens == sum(SAMPLE_LENGTHS)
    for key, values in inputs.items():  # the inputs are regenerated the same way
        assert _bytes_equal(values, expected[f"input.{key}"]), key
    for shard in store.shards:
        raw = store.read_token_range(shard.shard_id, 0, shard.num_tokens)
        for key, bits in raw.items():
            assert _bytes_equal(bits, expected[f"bits.{shard.shard_id}.{key}"]), key
        # Sub-ranges cross inner chunk and Zarr shard boundaries.
        for start, stop in ((1, 6), (3, 17), (shard.num_tokens - 1, shard.num_tokens)):
            part = store.read_token_range(shard.shard_id, start, stop)
            for key, bits in part.items():
                assert _bytes_equal(bits, expected[f"bits.{shard.shard_id}.{key}"][start:stop]), key
        for name, spec in store.features.items():
            decoded = hsstore.format.codecs.decode_numpy(spec, raw)
            assert _bytes_equal(decoded, expected[f"decoded.{shard.shard_id}.{name}"]), name
    # Sample rows: ids and masks as written, features decoded from the same bits.
    offset = 0
    for index, length in enumerate(SAMPLE_LENGTHS):
        sample = store.read_sample(index, as_numpy=True)
        assert sample["sample_id"] == f"golden-{index}"
        np.testing.assert_array_equal(sample["input_ids"], inputs["input_ids"][offset : offset + length])
        np.testing.assert_array_equal(sample["loss_mask"], inputs["loss_mask"][offset : offset + length])
        np.testing.assert_array_equal(sample["int32_values"], inputs["int32_values"][offset : offset + length])
        np.testing.assert_array_equal(sample["float32_values"], inputs["float32_values"][offset : offset + length])
        offset += length


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_writer_reproduces_golden_byte_for_byte(compression: str, tmp_path: Path) -> None:
    write_golden(tmp_path / "store", compression)
    golden, written = store_files(GOLDEN_DIR / compression), store_files(tmp_path / "store")
    assert sorted(written) == sorted(golden)
    different = [path for path in golden if golden[path] != written[path]]
    assert different == []
    # The golden manifests predate ShardRecord.sample_tokens (so test_golden_reads proves such
    # stores still read); today's writer adds the lengths, which must be the tables' own.
    written_manifest = manifest_essentials(tmp_path / "store")
    for shard in written_manifest["shards"]:
        lengths = decode_sample_tokens(shard.pop("sample_tokens"))
        assert int(lengths.sum()) == shard["num_tokens"] and len(lengths) == shard["num_samples"]
    assert [int(n) for n in hsstore.open_store(str(tmp_path / "store")).samples.column("num_tokens").to_pylist()] == list(SAMPLE_LENGTHS)
    assert written_manifest == manifest_essentials(GOLDEN_DIR / compression)
