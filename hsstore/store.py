"""Reading a committed store: the sample table, single samples and token ranges.

Only what the manifest names is ever opened. A :class:`Store` is cheap to create and safe to send to
another process (it re-opens its filesystem there), which is what loader workers do.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import threading
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from hsstore.commit import require_manifest
from hsstore.errors import ShardCorruptError
from hsstore.extras import import_optional
from hsstore.format import codecs
from hsstore.format.array_reader import ArrayReader
from hsstore.format.chunk_layout import layout_of
from hsstore.format.features import FeatureSpec
from hsstore.format.layout import (
    SAMPLE_SCHEMA,
    TABLE_FEATURES,
    ZARR_METADATA_FILE,
    array_dir,
    samples_path,
)
from hsstore.format.zarr_rows import ZarrRows
from hsstore.info import store_info
from hsstore.layer_read import read_layers
from hsstore.lineage import Lineage
from hsstore.manifest import FileEntry, ShardRecord, StoreManifest
from hsstore.read_cache import ReadCache
from hsstore.storage import StoreLocation, as_location

if TYPE_CHECKING:
    import torch


class Store:
    """A committed store, pinned to the manifest read at open time."""

    def __init__(self, location: StoreLocation, manifest: StoreManifest, cache: ReadCache | None = None):
        self.location = location
        self.manifest = manifest
        # Remote stores only: bytes already fetched, kept locally (hsstore.read_cache).
        self.cache = cache
        self._features = manifest.feature_map  # pinned with the manifest; looked up on every read
        self._shard_index = {shard.shard_id: i for i, shard in enumerate(manifest.shards)}
        self._tables: dict[str, pa.Table] = {}
        self._arrays: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()
        # One lock per table/array being opened: the loader's read threads often want the same
        # shard at once, and each would otherwise send its own GETs for the same bytes.
        self._opening: dict[Any, threading.Lock] = {}
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
        return {"location": self.location, "manifest": self.manifest, "cache": self.cache}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["location"], state["manifest"], state.get("cache"))  # type: ignore[misc]

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

    def _opening_lock(self, key: Any) -> threading.Lock:
        with self._lock:
            return self._opening.setdefault(key, threading.Lock())

    def _read_small_file(self, path: str, entry: FileEntry | None) -> bytes:
        """A small file's bytes (a sample table, an array's zarr.json): from the read cache when a
        remote store has one (keyed by the manifest's sha256, so a cached copy is the committed
        one), else one GET (ranged to the manifest's size: s3fs sends a HEAD first otherwise)."""
        cache = self.cache if self.location.uses_read_cache else None
        if entry is None:
            return self.location.read_bytes(path)
        key = None
        if cache is not None:
            key = cache.key(entry.sha256, "file")
            data = cache.get(key)
            if data is not None and hashlib.sha256(data).hexdigest() == entry.sha256:
                return data
        data = self.location.read_bytes(path, size=entry.size)
        if cache is not None and key is not None:
            cache.put(key, data)
        return data

    def shard_samples(self, shard_id: str) -> pa.Table:
        """One shard's sample table, checked against the manifest's sha256 on first use."""
        with self._lock:
            table = self._tables.get(shard_id)
        if table is not None:
            return table
        with self._opening_lock(("table", shard_id)):
            with self._lock:
                table = self._tables.get(shard_id)
            return table if table is not None else self._open_samples(shard_id)

    def _open_samples(self, shard_id: str) -> pa.Table:
        shard = self.shard(shard_id)
        path = samples_path(shard.path)
        entry = next((f for f in shard.files if f.path == path), None)
        try:
            # The table is small (ids and masks): read it whole and check it against the manifest
            # before trusting a single offset. Feature chunks carry their own crc32c, checked on every
            # read (hsstore.format.array_reader).
            data = self._read_small_file(path, entry)
            if entry is not None and (len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256):
                raise ShardCorruptError(
                    f"shard {shard_id}: {self.location.path(path)}: size or sha256 differs from the "
                    "manifest (the shard is damaged; run hsstore verify)"
                )
            table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
        except FileNotFoundError as err:
            raise ShardCorruptError(f"shard {shard_id}: {self.location.path(path)}: cannot read the sample table: the file is missing") from err
        except pa.ArrowInvalid as err:  # not an Arrow IPC file (an I/O error stays an OSError)
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
        """A reader for one array of one shard: :class:`~hsstore.format.array_reader.ArrayReader` for
        the layouts hsstore writes, the zarr array itself for any other (both have ``read``-able rows)."""
        key = (shard.shard_id, array_name)
        with self._lock:
            array = self._arrays.get(key)
        if array is not None:
            return array
        with self._opening_lock(key):
            with self._lock:
                array = self._arrays.get(key)
            return array if array is not None else self._open_array(shard, array_name)

    def _open_array(self, shard: ShardRecord, array_name: str) -> Any:
        key = (shard.shard_id, array_name)
        where = self.location.path(array_dir(shard.path, array_name))
        try:
            path = f"{array_dir(shard.path, array_name)}/{ZARR_METADATA_FILE}"
            metadata = json.loads(self._read_small_file(path, next((f for f in shard.files if f.path == path), None)))
        except FileNotFoundError as err:
            raise ShardCorruptError(f"shard {shard.shard_id}: {where}: {ZARR_METADATA_FILE} is missing") from err
        except ValueError as err:  # not JSON (or not UTF-8)
            raise ShardCorruptError(f"shard {shard.shard_id}: {where}/{ZARR_METADATA_FILE}: not valid JSON ({err})") from err
        layout = layout_of(metadata) if isinstance(metadata, dict) else None
        if layout is not None:
            num_rows = int(metadata["shape"][0])
            folder = array_dir(shard.path, array_name)
            files = {f.path: (f.size, f.sha256) for f in shard.files if f.path.startswith(folder + "/")}
            reader: Any = ArrayReader(self.location, folder, layout, shard.num_tokens, files=files, cache=self.cache)
        else:
            reader = ZarrRows.open(self.location, shard.shard_id, shard.path, array_name)
            num_rows = reader.array.shape[0]
        if num_rows != shard.num_tokens:
            raise ShardCorruptError(f"{where}: {num_rows} tokens, manifest says {shard.num_tokens}")
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
        layers: Mapping[str, Sequence[int]] | None = None,
    ) -> dict[str, np.ndarray]:
        """Stored bits of tokens ``[start, stop)`` of one shard, undecoded.

        Keys are feature names (plus ``<name>.scale`` for fp8); ``input_ids``/``loss_mask`` come from
        the Arrow table. ``out`` may give, per array name, a C-contiguous destination of shape
        ``[stop - start, ...]`` and the stored dtype (e.g. a slice of a batch buffer): the rows are
        read straight into it. Decode with :func:`hsstore.format.codecs.decode_torch` (on the GPU) or
        :func:`hsstore.format.codecs.decode_numpy`, with the spec ``self.feature_spec(name, layers)``.

        ``layers`` picks indices of a feature's leading axis (aux layers, in the order given): the
        result holds ``[stop - start, len(indices), ...]``. A feature written with
        ``layer_arrays`` reads only those layers' arrays; any other reads its rows whole and keeps
        the chosen layers (same result, no saving: stores written before layer_arrays).
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
            spec = self.features[name]
            chosen = None if layers is None else layers.get(name)
            if chosen is not None or spec.layer_arrays:
                result.update(read_layers(lambda array_name: self._array(shard, array_name), spec, chosen, start, stop, out))
                continue
            for array_name in spec.array_names():
                # Damage raises ShardCorruptError naming the file, an I/O failure OSError; anything
                # else is a bug and must not be mistaken for (and skipped as) corruption.
                target = None if out is None else out.get(array_name)
                result[array_name] = self._array(shard, array_name).read(start, stop, target)
        return result

    def files_to_read(self, name: str, layers: Mapping[str, Sequence[int]] | None = None) -> list[str]:
        """The arrays :meth:`read_token_range` opens for feature ``name`` with ``layers``."""
        spec = self.features[name]
        chosen = None if layers is None else layers.get(name)
        if spec.layer_arrays:
            return [array.name for array in spec.file_arrays(None if chosen is None else list(chosen))]
        return spec.array_names()

    def open_ahead(self, shard_id: str, array_name: str | None = None) -> None:
        """Fetch what a first read of a shard waits for (its sample table, or one array's
        ``zarr.json`` and first index) now, e.g. from a pool while earlier batches are read: on
        object storage these are round trips that would otherwise run one after another."""
        if array_name is None:
            self.shard_samples(shard_id)
            return
        reader = self._array(self.shard(shard_id), array_name)
        if isinstance(reader, ArrayReader):
            reader.warm()

    def feature_spec(self, name: str, layers: Mapping[str, Sequence[int]] | None = None) -> FeatureSpec:
        """The spec of feature ``name`` as :meth:`read_token_range` hands it out with ``layers``."""
        spec = self.features[name]
        chosen = None if layers is None else layers.get(name)
        if chosen is None:
            return spec.select(range(spec.shape[0])) if spec.layer_arrays else spec
        return spec.select(list(chosen))

    def read_sample(
        self,
        index: int,
        features: list[str] | None = None,
        *,
        as_numpy: bool = False,
        device: str | torch.device | None = None,
        layers: Mapping[str, Sequence[int]] | None = None,
    ) -> dict[str, Any]:
        """One sample, decoded to its logical dtype.

        Torch tensors by default (bf16 stays bf16); ``as_numpy=True`` gives numpy arrays with bf16/fp8
        decoded to float32 and needs no torch. Also carries ``sample_id``, ``source_id``, ``input_ids``
        and ``loss_mask``. ``layers``: as in :meth:`read_token_range`.
        """
        shard, row = self.locate(index)
        table = self.shard_samples(shard.shard_id)
        offset = table.column("token_offset")[row].as_py()
        num_tokens = table.column("num_tokens")[row].as_py()
        names = [n for n in (list(self.features) if features is None else features) if n not in TABLE_FEATURES]
        raw = self.read_token_range(shard.shard_id, offset, offset + num_tokens, names, layers=layers)
        sample: dict[str, Any] = {
            "sample_id": table.column("sample_id")[row].as_py(),
            "source_id": table.column("source_id")[row].as_py(),
        }
        ids = np.asarray(table.column("input_ids")[row].values.to_numpy(zero_copy_only=False), dtype=np.int32)
        mask = np.asarray(table.column("loss_mask")[row].values.to_numpy(zero_copy_only=False), dtype=np.uint8)
        if as_numpy:
            sample["input_ids"], sample["loss_mask"] = ids, mask
            for name in names:
                sample[name] = codecs.decode_numpy(self.feature_spec(name, layers), raw)
            return sample
        torch = import_optional("torch", "read_sample (torch tensors; as_numpy=True needs no torch)")
        sample["input_ids"] = torch.from_numpy(ids.astype(np.int64)).to(device)
        sample["loss_mask"] = torch.from_numpy(mask.astype(bool)).to(device)
        for name in names:
            sample[name] = codecs.decode_torch(self.feature_spec(name, layers), raw, device=device)
        return sample

    def __len__(self) -> int:
        return self.num_samples

    def verify(self, checksums: bool = True) -> list[str]:
        """Problems found (empty when sound); see :func:`hsstore.verify.verify_store`."""
        from hsstore.verify import verify_store

        return [str(p) for p in verify_store(self.location, checksums=checksums)]

    def info(self) -> dict[str, Any]:
        """What :func:`hsstore.info.store_info` says about this store."""
        return store_info(self.manifest, self.url)


def open_store(
    url: str | os.PathLike[str] | StoreLocation,
    *,
    storage_options: dict[str, Any] | None = None,
    cache: ReadCache | None = None,
) -> Store:
    """Open the committed store at ``url`` (any fsspec URL, or a :class:`~hsstore.storage.StoreLocation`).
    Raises StoreNotFoundError/ManifestError.

    ``storage_options`` go to fsspec (e.g. ``{"client_kwargs": {"endpoint_url": ...}}`` for s3fs;
    by default s3fs reads ``AWS_ENDPOINT_URL`` and the keys from the environment). ``cache`` keeps
    the bytes read from a remote store on local disk (:class:`hsstore.read_cache.ReadCache`)."""
    location = as_location(url, storage_options)
    return Store(location, require_manifest(location), cache)


__all__ = ["Store", "open_store"]
