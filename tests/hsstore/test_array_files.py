"""Zarr shard files written as a stream and read straight into buffers (hsstore.format.array_writer,
hsstore.format.array_reader).

The contract: the files are Zarr v3 sharded arrays that zarr-python reads unchanged, our reader reads
zarr-python's own files, every byte read is crc32c-checked, and a read lands exactly the requested
rows in the caller's buffer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsstore.errors import ShardCorruptError
from hsstore.format.array_reader import ArrayReader
from hsstore.format.array_writer import ArrayWriter
from hsstore.format.chunk_layout import ChunkLayout
from hsstore.format.chunk_layout import layout_of as layout_of_metadata
from hsstore.read_cache import Scatter
from hsstore.storage import FsspecBackend, LocalBackend, StoreLocation

TAIL = (3, 5)


def layout_of(array: zarr.Array) -> ChunkLayout | None:
    """The layout hsstore sees in the array's zarr.json (the JSON zarr-python wrote)."""
    return layout_of_metadata(array.metadata.to_dict())


def write_stream(root: Path, rows: np.ndarray, *, chunk_tokens: int, shard_tokens: int | None, compression: str, pieces: int = 7) -> tuple[zarr.Array, int]:
    """Stream ``rows`` in uneven pieces into ``root/g/x``, then declare the array through zarr."""
    location = StoreLocation(str(root))
    group = zarr.open_group(str(root / "g"), mode="w")
    stream = ArrayWriter(location, "g/x", row_shape=rows.shape[1:], dtype=rows.dtype, chunk_tokens=chunk_tokens, shard_tokens=shard_tokens, compression=compression, level=1)
    cuts = np.linspace(0, len(rows), pieces + 1).astype(int)
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        stream.append(rows[a:b])
    layout, written = stream.close()
    shard = layout.shard_tokens
    assert layout == ChunkLayout(rows.shape[1:], rows.dtype, chunk_tokens, shard, compression)
    array = group.create_array(
        "x", shape=rows.shape, dtype=rows.dtype, chunks=(chunk_tokens, *rows.shape[1:]), shards=(shard, *rows.shape[1:]),
        compressors=layout.zarr_compressors(), fill_value=0, chunk_key_encoding={"name": "default", "separator": "/"},
    )
    on_disk = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != "zarr.json"}
    assert {f.path for f in written} == on_disk
    for f in written:
        assert (root / f.path).stat().st_size == f.size
    return array, len(written)


def random_rows(num: int, dtype: str = "uint16", seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 60_000 if dtype == "uint16" else 250, (num, *TAIL)).astype(dtype)


@pytest.mark.parametrize("compression", ["none", "zstd", "blosc"])
@pytest.mark.parametrize("shard_tokens", [None, 16])
def test_zarr_reads_what_the_stream_wrote(tmp_path, compression, shard_tokens):
    rows = random_rows(53)  # not a multiple of the chunk: the last chunk is stored padded
    array, num_files = write_stream(tmp_path, rows, chunk_tokens=4, shard_tokens=shard_tokens, compression=compression)
    assert num_files == (1 if shard_tokens is None else 4)
    np.testing.assert_array_equal(array[:], rows)
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "g" / "x"), mode="r")[10:31], rows[10:31])


@pytest.mark.parametrize("compression", ["none", "zstd", "blosc"])
@pytest.mark.parametrize("dtype", ["uint16", "uint8", "float32"])
def test_our_reader_reads_what_zarr_wrote(tmp_path, compression, dtype):
    rows = random_rows(45, dtype, seed=1)
    layout = ChunkLayout(TAIL, np.dtype(dtype), 4, 12, compression)
    array = zarr.create_array(
        str(tmp_path / "x"), shape=rows.shape, dtype=dtype, chunks=(4, *TAIL), shards=(12, *TAIL),
        compressors=layout.zarr_compressors(), fill_value=0, config={"write_empty_chunks": True},
    )
    array[:] = rows
    assert layout_of(array) == layout
    reader = ArrayReader(StoreLocation(str(tmp_path)), "x", layout, len(rows))
    for start, stop in [(0, 45), (3, 4), (5, 29), (11, 13), (44, 45), (7, 7)]:
        np.testing.assert_array_equal(reader.read(start, stop), rows[start:stop])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_range_lands_exactly_in_the_callers_buffer(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("ranges")
    num = data.draw(st.integers(1, 70))
    chunk = data.draw(st.integers(1, 9))
    shard = data.draw(st.sampled_from([None, chunk, 3 * chunk]))
    compression = data.draw(st.sampled_from(["none", "zstd"]))
    rows = random_rows(num, seed=num)
    array, _ = write_stream(root, rows, chunk_tokens=chunk, shard_tokens=shard, compression=compression, pieces=data.draw(st.integers(1, 5)))
    layout = layout_of(array)
    assert layout is not None
    reader = ArrayReader(StoreLocation(str(root)), "g/x", layout, num)
    start = data.draw(st.integers(0, num))
    stop = data.draw(st.integers(start, num))
    # Into the middle of a larger buffer, as the loader does with a batch row: nothing around it moves.
    big = np.full((stop - start + 4, *TAIL), 7, dtype=np.uint16)
    reader.read(start, stop, out=big[2 : 2 + stop - start])
    np.testing.assert_array_equal(big[2 : 2 + stop - start], rows[start:stop])
    assert (big[:2] == 7).all() and (big[2 + stop - start :] == 7).all()


def test_remote_backends_read_the_same_rows(tmp_path):
    rows = random_rows(40)
    write_stream(tmp_path, rows, chunk_tokens=6, shard_tokens=None, compression="none")
    array = zarr.open_array(str(tmp_path / "g" / "x"), mode="r")
    layout = layout_of(array)
    assert layout is not None
    # fsspec's generic backend over file:// takes the byte-range path that gs:// and memory:// take (no preadv)
    local = ArrayReader(StoreLocation(str(tmp_path)), "g/x", layout, 40)
    remote = ArrayReader(FsspecBackend(f"file://{tmp_path}"), "g/x", layout, 40)
    assert remote.location.range_reader == "fsspec" and local.location.range_reader == "local"
    for start, stop in [(5, 33), (0, 40), (6, 12), (7, 8), (11, 13), (0, 0)]:  # edges inside and on chunk bounds
        np.testing.assert_array_equal(remote.read(start, stop), local.read(start, stop))


def test_a_whole_body_is_checked_chunk_by_chunk_before_its_copy(tmp_path):
    """Issue 32: where bodies arrive whole (an HTTP backend; fsspec's over file:// here) each chunk
    is checked in the body and then copied: a damaged chunk is named, the chunks before it are in
    place, and nothing from it or after it was copied."""
    rows = random_rows(30)
    write_stream(tmp_path, rows, chunk_tokens=5, shard_tokens=None, compression="none")
    path = tmp_path / "g" / "x" / "c" / "0" / "0" / "0"
    path.write_bytes(flip_a_byte(path.read_bytes()))
    layout = layout_of(zarr.open_array(str(tmp_path / "g" / "x"), mode="r"))
    assert layout is not None
    backend = FsspecBackend(f"file://{tmp_path}")
    assert backend.bodies_arrive_whole and not StoreLocation(str(tmp_path)).bodies_arrive_whole
    out = np.full((30, *TAIL), 7, dtype=np.uint16)
    with pytest.raises(ShardCorruptError, match=r"c/0/0/0: chunk 2 fails its crc32c"):
        ArrayReader(backend, "g/x", layout, 30).read(0, 30, out=out)
    np.testing.assert_array_equal(out[:10], rows[:10])
    assert (out[10:] == 7).all()


def damaged_reader(root: Path, compression: str, damage: Any) -> ArrayReader:
    """A reader over 30 streamed rows whose one shard file ``damage(bytes) -> bytes`` rewrote."""
    write_stream(root, random_rows(30), chunk_tokens=5, shard_tokens=None, compression=compression)
    path = root / "g" / "x" / "c" / "0" / "0" / "0"
    path.write_bytes(damage(path.read_bytes()))
    layout = layout_of(zarr.open_array(str(root / "g" / "x"), mode="r"))
    assert layout is not None
    return ArrayReader(StoreLocation(str(root)), "g/x", layout, 30)


def flip_a_byte(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[len(flipped) // 3] ^= 0x10  # inside the chunk data, not the index
    return bytes(flipped)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_flipped_byte_is_caught_and_named(tmp_path, compression):
    reader = damaged_reader(tmp_path, compression, flip_a_byte)
    with pytest.raises(ShardCorruptError, match=r"c/0/0/0: chunk \d+ (fails its crc32c|does not decompress)"):
        reader.read(0, 30)


def test_a_truncated_file_is_caught_and_named(tmp_path):
    reader = damaged_reader(tmp_path, "none", lambda data: data[:-40])
    with pytest.raises(ShardCorruptError, match=r"c/0/0/0: (the shard index fails its crc32c|the shard index points past)"):
        reader.read(0, 30)


class PiecewiseBackend(LocalBackend):
    """A local store whose ranged reads hand the body over in small pieces through Scatter, as
    obstore's streamed GET does (``cut``: the body ends that many bytes early; ``report``: whether
    it passes on_filled on, as every backend must)."""

    piece = 7
    cut = 0
    report = True

    def __init__(self, url: Any, storage_options: Any = None):
        super().__init__(url, storage_options)
        self.pieces: list[int] = []  # where each piece written started

    def read_range_into(self, key: str, offset: int, buffers: list[Any], on_filled: Any = None) -> int:
        nbytes = sum(memoryview(b).nbytes for b in buffers)
        body = bytes(self.read_range(key, offset, offset + nbytes - self.cut))
        filler = Scatter(buffers, on_filled if self.report else None)
        for at in range(0, len(body), self.piece):
            self.pieces.append(at)
            filler.write(body[at : at + self.piece])
        return filler.received


def flip_in_chunk_0(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[10] ^= 0x10
    return bytes(flipped)


@pytest.mark.parametrize(("damage", "chunk"), [(flip_in_chunk_0, 0), (flip_a_byte, 2)])
def test_a_chunk_is_checked_as_its_bytes_land(tmp_path, damage, chunk):
    """Issue 32: the crc32c of a chunk is checked as soon as its last byte is copied, while it is
    still in the CPU's cache, not in a second pass after the whole run (so the copy stops at the
    damaged chunk, the chunks before it having passed); the message names the chunk as before."""
    layout = damaged_reader(tmp_path, "none", damage).layout
    backend = PiecewiseBackend(str(tmp_path))
    with pytest.raises(ShardCorruptError, match=rf"c/0/0/0: chunk {chunk} fails its crc32c"):
        ArrayReader(backend, "g/x", layout, 30).read(0, 30)
    landed = (chunk + 1) * (layout.chunk_bytes + 4)  # up to the damaged chunk's crc32c
    assert len(backend.pieces) == -(-landed // backend.piece)  # of the 6 chunks' 132 pieces


def test_a_backend_that_reports_nothing_still_has_every_chunk_checked(tmp_path):
    layout = damaged_reader(tmp_path, "none", flip_a_byte).layout
    backend = PiecewiseBackend(str(tmp_path))
    backend.report = False
    with pytest.raises(ShardCorruptError, match=r"c/0/0/0: chunk 2 fails its crc32c"):
        ArrayReader(backend, "g/x", layout, 30).read(0, 30)
    rows = random_rows(30)
    write_stream(tmp_path / "ok", rows, chunk_tokens=5, shard_tokens=None, compression="none")
    intact = PiecewiseBackend(str(tmp_path / "ok"))
    intact.report = False
    np.testing.assert_array_equal(ArrayReader(intact, "g/x", layout, 30).read(3, 27), rows[3:27])


@pytest.mark.parametrize("cut", [1, 4, 5, 160])
def test_a_short_body_is_damage_named_by_file(tmp_path, cut):
    """A body that ends early (inside the last chunk's crc32c, at a chunk's end, or chunks early) is
    the same error as before the check moved into the copy: the chunks that did land pass theirs."""
    rows = random_rows(30)
    write_stream(tmp_path, rows, chunk_tokens=5, shard_tokens=None, compression="none")
    layout = layout_of(zarr.open_array(str(tmp_path / "g" / "x"), mode="r"))
    assert layout is not None
    backend = PiecewiseBackend(str(tmp_path))
    backend.cut = cut
    reader = ArrayReader(backend, "g/x", layout, 30)
    with pytest.raises(ShardCorruptError, match=rf"c/0/0/0: {924 - cut} bytes at offset 0, expected 924 \(truncated\?\)"):
        reader.read(0, 30)


def test_out_of_range_and_wrong_buffers_are_refused(tmp_path):
    rows = random_rows(10)
    write_stream(tmp_path, rows, chunk_tokens=4, shard_tokens=None, compression="none")
    layout = layout_of(zarr.open_array(str(tmp_path / "g" / "x"), mode="r"))
    assert layout is not None
    reader = ArrayReader(StoreLocation(str(tmp_path)), "g/x", layout, 10)
    with pytest.raises(IndexError, match=r"rows \[5, 11\) outside \[0, 10\)"):
        reader.read(5, 11)
    with pytest.raises(ValueError, match="out must be C-contiguous uint16 of shape"):
        reader.read(0, 4, out=np.zeros((4, *TAIL), dtype=np.float32))


def test_layouts_of_other_writers_fall_back_to_zarr(tmp_path):
    plain = zarr.create_array(str(tmp_path / "plain"), shape=(10, *TAIL), dtype="uint16", chunks=(5, *TAIL))
    assert layout_of(plain) is None  # no sharding codec: read through zarr


def test_streaming_holds_a_few_chunks_not_the_shard(tmp_path):
    """One file holds the whole array however long it is; the stream keeps at most
    max_in_flight + 1 chunk buffers alive (the one filling and those being written)."""
    location = StoreLocation(str(tmp_path))
    stream = ArrayWriter(location, "x", row_shape=(64,), dtype="uint16", chunk_tokens=8, shard_tokens=None, compression="none", level=1, max_in_flight=2)
    block = np.ones((5, 64), dtype=np.uint16)
    for _ in range(200):
        stream.append(block)
        assert len(stream._in_flight) <= 2
    layout, written = stream.close()
    assert layout.shard_tokens == 1000 and len(written) == 1
    assert written[0].size == 125 * (8 * 64 * 2 + 4) + 125 * 16 + 4


def test_a_default_store_shard_is_two_files_per_array_plus_two(tmp_path):
    """The file-count contract of the default layout (docs/format.md): samples.arrow, the group's
    zarr.json, and per array its zarr.json and one data file, however many chunks the shard holds."""
    import hsstore

    specs = [
        hsstore.FeatureSpec(name="aux_hidden_states", shape=(3, 8), codec="fp8_e4m3", chunk_tokens=4),
        hsstore.FeatureSpec(name="final_hidden_state", shape=(8,), chunk_tokens=4),
    ]
    rng = np.random.default_rng(0)
    with hsstore.StoreWriter(str(tmp_path / "s"), specs, hsstore.Lineage(aux_layer_ids=[1, 2, 3])) as writer:
        for i in range(40):  # 40 samples of 10 tokens: 100 inner chunks per value array
            writer.add_sample(
                sample_id=f"s{i}", source_id="r", input_ids=np.arange(10), loss_mask=np.ones(10),
                features={"aux_hidden_states": rng.standard_normal((10, 3, 8)), "final_hidden_state": rng.standard_normal((10, 8))},
            )
    store = hsstore.open_store(str(tmp_path / "s"))
    (shard,) = store.shards
    assert len(shard.files) == 2 + 2 * 3  # fp8 aux: values + scales; bf16 final: values
    assert store.verify() == []
    np.testing.assert_array_equal(store.read_sample(39, as_numpy=True)["input_ids"], np.arange(10))
