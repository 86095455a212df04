"""Writing shards and committing them.

A :class:`ShardWriter` owns one store shard: it streams encoded samples into each feature array's
Zarr shard files chunk by chunk (:mod:`hsstore.format.array_writer`; a few chunks of memory per array, whatever the shard
size), writes the arrays' ``zarr.json`` and the Arrow sample table last, and returns a
:class:`ShardRecord` with every file's size and sha256. Nothing it writes is visible until :func:`hsstore.commit.commit_shards`
adds the record to the manifest (:class:`hsstore.store_writer.StoreWriter` does both for a single process).

Each attempt at a shard writes into its own folder ``shards/<shard_id>.<attempt>``: Ray may run a
unit twice (retries, restarted actors) and two attempts must never interleave files. The shard id is
deterministic (from the work unit); the attempt suffix is random. The committer keeps the first
record per shard id; later attempts are garbage, listed by ``verify`` and removed by ``gc``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from hsstore.errors import StoreWriteError
from hsstore.format import codecs
from hsstore.format.array_writer import ArrayWriter, WrittenFile
from hsstore.format.chunk_layout import ChunkLayout
from hsstore.format.features import FeatureSpec
from hsstore.format.layout import (
    SAMPLE_SCHEMA,
    SCALE_GROUPING,
    array_dir,
    feature_of_array,
    features_root,
    samples_path,
    shard_folder,
)
from hsstore.manifest import (
    FileEntry,
    ShardRecord,
    check_shard_id,
    encode_sample_tokens,
    shard_checksum,
)
from hsstore.storage import StoreLocation, as_location

logger = logging.getLogger(__name__)


def _to_numpy_1d(values: Any, dtype: Any, what: str) -> np.ndarray:
    if type(values).__module__.startswith("torch"):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.ndim != 1:
        raise StoreWriteError(f"{what} must be 1-D, got shape {array.shape}")
    return array.astype(dtype, copy=False)


class ShardWriter:
    """Writes one shard. Not thread-safe; one process (one writer) per shard, as Zarr requires."""

    def __init__(
        self,
        url: str | os.PathLike[str] | StoreLocation,
        shard_id: str,
        features: Sequence[FeatureSpec],
        *,
        storage_options: dict[str, Any] | None = None,
    ):
        import zarr

        self.location = as_location(url, storage_options)
        self.shard_id = check_shard_id(shard_id)
        self.features = {spec.name: spec for spec in features}
        self.folder = shard_folder(shard_id, uuid.uuid4().hex[:12])
        # Where the backend wants the shard written until it is finished (locally: a dot-name that
        # finish() renames into place; on object stores: the folder itself).
        self._work = self.location.staging_folder(self.folder)
        self.location.makedirs(self._work)
        self._group = zarr.open_group(
            self.location.zarr_store(features_root(self._work), read_only=False), mode="w"
        )
        # Each array streams its chunks to its own files from its own thread (ArrayWriter);
        # the arrays' zarr.json is written by zarr in finish(), once the token count is known.
        self._streams: dict[str, ArrayWriter] = {}
        # The arrays written (per aux layer with layer_arrays) and which encoded array each is cut from.
        self._file_arrays = [array for spec in features for array in spec.file_arrays()]
        self._logical = {name: (tuple(shape), dtype) for spec in features for name, shape, dtype in spec.stored_arrays()}
        for spec in features:
            for array_name, row_shape, dtype, logical, _ in spec.file_arrays():
                chunk_tokens = spec.chunk_tokens or 1
                shard_tokens = spec.shard_tokens
                if logical != spec.name:  # a codec's extra array (fp8 scales): a few bytes per token
                    chunk_tokens *= SCALE_GROUPING
                    shard_tokens = None if shard_tokens is None else SCALE_GROUPING * shard_tokens
                self._streams[array_name] = ArrayWriter(
                    self.location,
                    array_dir(self._work, array_name),
                    row_shape=row_shape,
                    dtype=dtype,
                    chunk_tokens=chunk_tokens,
                    shard_tokens=shard_tokens,
                    compression=spec.compression,
                    level=spec.compression_level,
                )
        self._written: list[WrittenFile] = []
        self._rows: dict[str, list[Any]] = {field.name: [] for field in SAMPLE_SCHEMA}
        self._sample_ids: set[str] = set()
        self.num_samples = 0
        self.num_tokens = 0
        self._finished = False
        self._append_pool: ThreadPoolExecutor | None = None  # add_encoded_samples' per-array threads

    def add_sample(
        self,
        *,
        sample_id: str,
        source_id: str,
        input_ids: Any,
        loss_mask: Any,
        features: dict[str, Any],
    ) -> None:
        """Append one sample. ``features`` maps every feature name to an array ``[T, *shape]``."""
        ids, mask = self._check_sample(sample_id, input_ids, loss_mask)
        num_tokens = len(ids)
        missing = set(self.features) - set(features)
        extra = set(features) - set(self.features)
        if missing or extra:
            raise StoreWriteError(
                f"sample {sample_id}: features must be exactly {sorted(self.features)}; "
                f"missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        encoded: dict[str, np.ndarray] = {}
        for name, spec in self.features.items():
            values = features[name]
            if values.shape[0] != num_tokens:
                raise StoreWriteError(
                    f"sample {sample_id}: feature {name!r} has {values.shape[0]} tokens, input_ids {num_tokens}"
                )
            encoded.update(codecs.encode(spec, values))
        self._append_arrays(self._cut(encoded), parallel=False)
        self._add_row(sample_id, source_id, ids, mask)

    def add_encoded_samples(
        self, rows: Sequence[tuple[str, str, Any, Any]], arrays: dict[str, np.ndarray]
    ) -> None:
        """Append samples whose features are already encoded, e.g. on a GPU by
        :func:`hsstore.format.codecs.encode_torch` and copied to the host (the extraction worker's path:
        the host does no codec work).

        ``rows``: ``(sample_id, source_id, input_ids, loss_mask)`` per sample, in the order their
        tokens are packed; ``arrays``: every stored array (``FeatureSpec.stored_arrays``, fp8 scales
        included) as ``[sum of the samples' tokens, ...]``, bits in the stored dtype. The arrays are
        checked (names, dtypes, shapes, fp8 scales finite) before anything is appended, and each is
        appended from its own thread (the copies into the chunk buffers release the GIL).
        """
        if self._finished:
            raise StoreWriteError(f"shard {self.shard_id}: add_encoded_samples after finish()")
        checked = [self._check_sample(sample_id, ids, mask) for sample_id, _, ids, mask in rows]
        num_tokens = sum(len(ids) for ids, _ in checked)
        if set(arrays) != set(self._logical):
            raise StoreWriteError(
                f"shard {self.shard_id}: encoded arrays must be exactly {sorted(self._logical)}, "
                f"got {sorted(arrays)}"
            )
        for name, (row_shape, dtype) in self._logical.items():
            array = arrays[name]
            if array.shape != (num_tokens, *row_shape) or array.dtype != np.dtype(dtype):
                raise StoreWriteError(
                    f"shard {self.shard_id}: encoded array {name!r} is {array.dtype} "
                    f"{tuple(array.shape)}; expected {dtype} {(num_tokens, *row_shape)} "
                    f"for {len(rows)} samples"
                )
        for spec in self.features.values():
            codecs.check_encoded(spec, arrays)
        self._append_arrays(self._cut(arrays), parallel=True)
        for (sample_id, source_id, _, _), (ids, mask) in zip(rows, checked, strict=True):
            self._add_row(sample_id, source_id, ids, mask)

    def _check_sample(self, sample_id: str, input_ids: Any, loss_mask: Any) -> tuple[np.ndarray, np.ndarray]:
        if self._finished:
            raise StoreWriteError(f"shard {self.shard_id}: add_sample after finish()")
        ids = _to_numpy_1d(input_ids, np.int32, f"sample {sample_id}: input_ids")
        mask = _to_numpy_1d(loss_mask, np.uint8, f"sample {sample_id}: loss_mask")
        if len(mask) != len(ids):
            raise StoreWriteError(
                f"sample {sample_id}: loss_mask has {len(mask)} tokens, input_ids {len(ids)}"
            )
        if sample_id in self._sample_ids:
            raise StoreWriteError(f"shard {self.shard_id}: duplicate sample_id {sample_id!r}")
        return ids, mask

    def _cut(self, encoded: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The encoded (logical) arrays as the arrays written: a layer_arrays feature's values and
        scales cut into one array per leading index (strided views; the streams copy them)."""
        return {
            array.name: encoded[array.logical] if array.layer is None else encoded[array.logical][:, array.layer]
            for array in self._file_arrays
        }

    def _append_arrays(self, encoded: dict[str, np.ndarray], *, parallel: bool) -> None:
        try:
            if parallel and len(encoded) > 1:
                if self._append_pool is None:
                    self._append_pool = ThreadPoolExecutor(len(self._streams), thread_name_prefix="hsstore-append")
                futures = [
                    self._append_pool.submit(self._streams[name].append, rows)
                    for name, rows in encoded.items()
                ]
                for future in futures:
                    future.result()
            else:
                for array_name, rows in encoded.items():
                    self._streams[array_name].append(rows)
        except OSError as err:
            self.abort()  # a half-flushed buffer cannot be resumed; free the space it took
            raise self._write_error(err) from err

    def _add_row(self, sample_id: str, source_id: str, ids: np.ndarray, mask: np.ndarray) -> None:
        num_tokens = len(ids)
        row = self._rows
        row["sample_id"].append(sample_id)
        row["source_id"].append(source_id)
        row["num_tokens"].append(num_tokens)
        row["token_offset"].append(self.num_tokens)
        row["num_loss_tokens"].append(int(mask.astype(bool).sum()))
        row["input_ids"].append(ids)
        row["loss_mask"].append(mask)
        self._sample_ids.add(sample_id)
        self.num_samples += 1
        self.num_tokens += num_tokens

    def finish(self) -> ShardRecord:
        """Flush everything, checksum the files and return the record to commit. Idempotent-safe:
        calling it twice is an error, not a second shard."""
        if self._finished:
            raise StoreWriteError(f"shard {self.shard_id}: finish() called twice")
        self._finished = True
        self._shutdown_append_pool()
        try:
            for array_name, stream in self._streams.items():
                layout, written = stream.close()
                self._written.extend(written)
                self._write_array_metadata(array_name, stream.num_tokens, layout)
            self._write_samples_table()
            self.location.publish_folder(self._work, self.folder)
            return self._describe()
        except OSError as err:
            self.abort()
            raise self._write_error(err) from err
        except Exception:
            self.abort()
            raise

    def _shutdown_append_pool(self) -> None:
        if self._append_pool is not None:
            self._append_pool.shutdown(wait=True)
            self._append_pool = None

    def _write_error(self, err: OSError) -> StoreWriteError:
        if isinstance(err, StoreWriteError):
            return err
        where = err.filename or self.location.path(self._work)
        return StoreWriteError(
            err.errno,
            f"shard {self.shard_id}: writing {where} failed ({err.strerror or err}); "
            "nothing was committed, rerun once the cause is fixed",
        )

    def abort(self) -> None:
        """Remove this attempt's files (best effort; leftovers are garbage the manifest never names)."""
        self._finished = True
        self._shutdown_append_pool()
        for stream in self._streams.values():
            with contextlib.suppress(Exception):
                stream.abort()
        with contextlib.suppress(Exception):
            self.location.remove_tree(self._work)

    def _write_samples_table(self) -> None:
        rows = self._rows
        columns = {
            "sample_id": pa.array(rows["sample_id"], pa.string()),
            "source_id": pa.array(rows["source_id"], pa.string()),
            "num_tokens": pa.array(rows["num_tokens"], pa.int32()),
            "token_offset": pa.array(rows["token_offset"], pa.int64()),
            "num_loss_tokens": pa.array(rows["num_loss_tokens"], pa.int32()),
            "input_ids": _list_array(rows["input_ids"], pa.int32(), np.int32),
            "loss_mask": _list_array(rows["loss_mask"], pa.uint8(), np.uint8),
        }
        table = pa.table(columns, schema=SAMPLE_SCHEMA)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as ipc:
            ipc.write_table(table)
        data = sink.getvalue().to_pybytes()
        self.location.write_bytes(samples_path(self._work), data)

    def _write_array_metadata(self, array_name: str, num_tokens: int, layout: ChunkLayout) -> None:
        """``zarr.json`` of one array, by zarr itself, declaring exactly the layout the stream wrote."""
        spec = self.features[feature_of_array(array_name)]
        self._group.create_array(
            array_name,
            shape=(num_tokens, *layout.row_shape),
            dtype=layout.dtype,
            chunks=(layout.chunk_tokens, *layout.row_shape),
            shards=(layout.shard_tokens, *layout.row_shape),
            compressors=layout.zarr_compressors(),
            fill_value=0,
            chunk_key_encoding={"name": "default", "separator": "/"},
            attributes={"hsstore_feature": spec.name, "logical_dtype": spec.logical_dtype, "codec": spec.codec},
        )

    def _describe(self) -> ShardRecord:
        # The data files were hashed while they were written; hash the rest (tables, zarr.json).
        prefix = self._work + "/"
        streamed = {self.folder + "/" + f.path.removeprefix(prefix): f for f in self._written}
        all_paths = self.location.list_files(self.folder)
        paths = [p for p in all_paths if p not in streamed]
        # hashlib releases the GIL on large blocks: hash the files side by side.
        with ThreadPoolExecutor(max_workers=min(8, len(paths) or 1)) as pool:
            digests = dict(zip(paths, pool.map(self.location.sha256, paths), strict=True))
        files = []
        for path in all_paths:
            if path in streamed:
                files.append(FileEntry(path=path, size=streamed[path].size, sha256=streamed[path].sha256))
            else:
                size, digest = digests[path]
                files.append(FileEntry(path=path, size=size, sha256=digest))
        return ShardRecord(
            shard_id=self.shard_id,
            path=self.folder,
            num_samples=self.num_samples,
            num_tokens=self.num_tokens,
            num_bytes=sum(f.size for f in files),
            checksum=shard_checksum(files),
            files=files,
            sample_tokens=encode_sample_tokens(self._rows["num_tokens"]),
        )


def _list_array(values: list[np.ndarray], value_type: pa.DataType, dtype: Any) -> pa.Array:
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    if values:
        np.cumsum([len(v) for v in values], out=offsets[1:])
    flat = np.concatenate(values).astype(dtype, copy=False) if values else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat, value_type))
