"""Reading a committed store: the sample table, single samples and token ranges.

Only what the manifest names is ever opened. A :class:`Store` is cheap to create and safe to send to
another process (it re-opens its filesystem there), which is what loader workers do.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import threading
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from hsstore import codecs
from hsstore.commit import require_manifest
from hsstore.errors import ShardCorruptError
from hsstore.features import TABLE_FEATURES, FeatureSpec
from hsstore.lineage import Lineage
from hsstore.location import StoreLocation
from hsstore.manifest import ShardRecord, StoreManifest
from hsstore.shardfile import ArrayReader, layout_of
from hsstore.writer import FEATURES_DIR, SAMPLES_FILE

if TYPE_CHECKING:
    import torch


class Store:
    """A committed store, pinned to the manifest read at open time."""

    def __init__(self, location: StoreLocation, manifest: StoreManifest):
        self.location = location
        self.manifest = manifest
        self._features = manifest.feature_map  # pinned with the manifest; looked up on every read
        self._shard_index = {shard.shard_id: i for i, shard in enumerate(manifest.shards)}
        self._tables: dict[str, pa.Table] = {}
        self._arrays: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()
        starts = [0]
        for shard in manifest.shards:
            starts.append(starts[-1] + shard.num_samples)
        self._sample_starts = starts

    def __repr__(self) -> str:
        return (
            f"Store({self.url!r}, samples={self.num_samples}, tokens={self.num_tokens}, "
            f"shards={len(self.shards)}, features={sorted(self.features)})"
        )

    def __getstate__(self) -> dict[str, Any]:
        return {"location": self.location, "manifest": self.manifest}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["location"], state["manifest"])  # type: ignore[misc]

    # -- what the manifest says ---------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.location.url

    @property
    def num_samples(self) -> int:
        return self.manifest.num_samples

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    @property
    def lineage(self) -> Lineage:
        return self.manifest.lineage

    @property
    def features(self) -> dict[str, FeatureSpec]:
        return self._features

    @property
    def shards(self) -> list[ShardRecord]:
        return self.manifest.shards

    def shard(self, shard_id: str) -> ShardRecord:
        try:
            return self.manifest.shards[self._shard_index[shard_id]]
        except KeyError:
            raise KeyError(f"{self.url}: no committed shard {shard_id!r}") from None

    # -- the sample table ---------------------------------------------------------------------

    def shard_samples(self, shard_id: str) -> pa.Table:
        """One shard's sample table, checked against the manifest's sha256 on first use."""
        with self._lock:
            table = self._tables.get(shard_id)
        if table is not None:
            return table
        shard = self.shard(shard_id)
        path = f"{shard.path}/{SAMPLES_FILE}"
        entry = next((f for f in shard.files if f.path == path), None)
        try:
            # The table is small (ids and masks): read it whole and check it against the manifest
            # before trusting a single offset. Feature chunks carry their own crc32c, checked on every read (hsstore.shardfile).
            data = self.location.read_bytes(path)
            if entry is not None and (len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256):
                raise ShardCorruptError(
                    f"shard {shard_id}: {self.location.path(path)}: size or sha256 differs from the "
                    "manifest (the shard is damaged; run hsstore verify)"
                )
            table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
        except ShardCorruptError:
            raise
        except (OSError, pa.ArrowInvalid) as err:
            raise ShardCorruptError(f"shard {shard_id}: {self.location.path(path)}: cannot read the sample table: {err}") from err
        if table.num_rows != shard.num_samples:
            raise ShardCorruptError(
                f"{self.location.path(path)}: {table.num_rows} rows, manifest says {shard.num_samples}"
            )
        with self._lock:
            self._tables[shard_id] = table
        return table

    @cached_property
    def samples(self) -> pa.Table:
        """Every committed sample, in manifest order, with ``shard_id`` and ``row`` columns added.

        ``store.samples.to_pandas()`` gives a DataFrame."""
        tables = []
        for shard in self.shards:
            table = self.shard_samples(shard.shard_id)
            table = table.add_column(0, "shard_id", pa.array([shard.shard_id] * table.num_rows, pa.string()))
            table = table.add_column(1, "row", pa.array(np.arange(table.num_rows, dtype=np.int32)))
            tables.append(table)
        if not tables:
            from hsstore.writer import SAMPLE_SCHEMA

            schema = pa.schema([pa.field("shard_id", pa.string()), pa.field("row", pa.int32()), *SAMPLE_SCHEMA])
            return schema.empty_table()
        return pa.concat_tables(tables)

    def locate(self, index: int) -> tuple[ShardRecord, int]:
        """(shard, row) of the global sample index ``index``."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample index {index} out of range for {self.num_samples} samples")
        position = bisect.bisect_right(self._sample_starts, index) - 1
        return self.shards[position], index - self._sample_starts[position]

    # -- features -----------------------------------------------------------------------------

    def _array(self, shard: ShardRecord, array_name: str) -> Any:
        """A reader for one array of one shard: :class:`hsstore.shardfile.ArrayReader` for the layouts
        hsstore writes, the zarr array itself for any other (both have ``read``-able rows)."""
        key = (shard.shard_id, array_name)
        with self._lock:
            array = self._arrays.get(key)
        if array is not None:
            return array
        import zarr

        array_dir = f"{shard.path}/{FEATURES_DIR}/{array_name}"
        try:
            zstore = self.location.zarr_store(f"{shard.path}/{FEATURES_DIR}", read_only=True)
            array = zarr.open_array(zstore, path=array_name, mode="r")
        except Exception as err:
            raise ShardCorruptError(
                f"shard {shard.shard_id}: {self.location.path(array_dir)}: cannot open: {err}"
            ) from err
        if array.shape[0] != shard.num_tokens:
            raise ShardCorruptError(
                f"{self.location.path(array_dir)}: {array.shape[0]} tokens, manifest says {shard.num_tokens}"
            )
        layout = layout_of(array)
        reader = ArrayReader(self.location, array_dir, layout, shard.num_tokens) if layout else _ZarrRows(array)
        with self._lock:
            self._arrays[key] = reader
        return reader

    def read_token_range(
        self,
        shard_id: str,
        start: int,
        stop: int,
        features: list[str] | None = None,
        *,
        out: dict[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Stored bits of tokens ``[start, stop)`` of one shard, undecoded.

        Keys are feature names (plus ``<name>.scale`` for fp8); ``input_ids``/``loss_mask`` come from
        the Arrow table. ``out`` may give, per array name, a C-contiguous destination of shape
        ``[stop - start, ...]`` and the stored dtype (e.g. a slice of a batch buffer): the rows are
        read straight into it. Decode with :func:`hsstore.codecs.decode_torch` (on the GPU) or
        :func:`hsstore.codecs.decode_numpy`.
        """
        shard = self.shard(shard_id)
        if not 0 <= start <= stop <= shard.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside shard {shard_id} ({shard.num_tokens} tokens)")
        names = list(self.features) if features is None else features
        result: dict[str, np.ndarray] = {}
        for name in names:
            if name in TABLE_FEATURES:
                values = self.shard_samples(shard_id).column(name).combine_chunks().values
                result[name] = values.slice(start, stop - start).to_numpy(zero_copy_only=False)
                continue
            if name not in self.features:
                raise KeyError(f"{self.url}: no feature {name!r} (has {sorted(self.features)})")
            for array_name in self.features[name].array_names():
                target = None if out is None else out.get(array_name)
                try:
                    result[array_name] = self._array(shard, array_name).read(start, stop, target)
                except (ShardCorruptError, ValueError):
                    raise
                except Exception as err:
                    raise ShardCorruptError(
                        f"shard {shard.shard_id}: {self.location.path(shard.path)}/{FEATURES_DIR}/"
                        f"{array_name}: read of tokens [{start}, {stop}) failed ({err}); "
                        "run hsstore verify"
                    ) from err
        return result

    def read_sample(
        self,
        index: int,
        features: list[str] | None = None,
        *,
        as_numpy: bool = False,
        device: str | torch.device | None = None,
    ) -> dict[str, Any]:
        """One sample, decoded to its logical dtype.

        Torch tensors by default (bf16 stays bf16); ``as_numpy=True`` gives numpy arrays with bf16/fp8
        decoded to float32 and needs no torch. Also carries ``sample_id``, ``source_id``, ``input_ids``
        and ``loss_mask``.
        """
        shard, row = self.locate(index)
        table = self.shard_samples(shard.shard_id)
        offset = table.column("token_offset")[row].as_py()
        num_tokens = table.column("num_tokens")[row].as_py()
        names = [n for n in (list(self.features) if features is None else features) if n not in TABLE_FEATURES]
        raw = self.read_token_range(shard.shard_id, offset, offset + num_tokens, names)
        sample: dict[str, Any] = {
            "sample_id": table.column("sample_id")[row].as_py(),
            "source_id": table.column("source_id")[row].as_py(),
        }
        ids = np.asarray(table.column("input_ids")[row].values.to_numpy(zero_copy_only=False), dtype=np.int32)
        mask = np.asarray(table.column("loss_mask")[row].values.to_numpy(zero_copy_only=False), dtype=np.uint8)
        if as_numpy:
            sample["input_ids"], sample["loss_mask"] = ids, mask
            for name in names:
                sample[name] = codecs.decode_numpy(self.features[name], raw)
            return sample
        import torch

        sample["input_ids"] = torch.from_numpy(ids.astype(np.int64)).to(device)
        sample["loss_mask"] = torch.from_numpy(mask.astype(bool)).to(device)
        for name in names:
            sample[name] = codecs.decode_torch(self.features[name], raw, device=device)
        return sample

    def __len__(self) -> int:
        return self.num_samples

    def verify(self, checksums: bool = True) -> list[str]:
        """Problems found (empty when sound); see :func:`hsstore.verify.verify_store`."""
        from hsstore.verify import verify_store

        return [str(p) for p in verify_store(self.location, checksums=checksums)]

    def info(self) -> dict[str, Any]:
        from hsstore.info import store_info

        return store_info(self)


class _ZarrRows:
    """Rows of a zarr array in a layout :mod:`hsstore.shardfile` does not handle (written by another
    tool): read through zarr, then copied into ``out``."""

    def __init__(self, array: Any):
        self.array = array

    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        rows = self.array[start:stop]
        if out is None:
            return rows
        out[...] = rows
        return out


def open_store(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> Store:
    """Open the committed store at ``url`` (any fsspec URL). Raises StoreNotFoundError/ManifestError."""
    location = StoreLocation(url, storage_options)
    return Store(location, require_manifest(location))


__all__ = ["Store", "open_store"]
