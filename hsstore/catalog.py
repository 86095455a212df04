"""Where every sample of a store is: the loader's catalog, built from the manifest (the sample
tables of stores written before ``ShardRecord.sample_tokens``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np

from hsstore.errors import ShardCorruptError
from hsstore.manifest import decode_sample_tokens
from hsstore.store import Store

logger = logging.getLogger(__name__)


@dataclass
class SampleCatalog:
    """Per-sample locations in manifest order (global sample index -> shard, row, token range),
    plus each shard's token and loss-mask columns, opened on first use."""

    store: Store = field(repr=False)
    shard_ids: list[str]
    shard_sample_counts: list[int]
    shard_of: np.ndarray  # int32 [N]
    row_of: np.ndarray  # int32 [N]
    token_offset: np.ndarray  # int64 [N]
    num_tokens: np.ndarray  # int64 [N]
    sample_names: Sequence[str]
    columns: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    opened: set[str] = field(default_factory=set, repr=False)  # shards whose first fetches were sent

    def locate(self, sample: int) -> tuple[str, int]:
        """(shard id, first token) of global sample ``sample``."""
        return self.shard_ids[int(self.shard_of[sample])], int(self.token_offset[sample])

    def _columns(self, shard: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(input_ids values, offsets, loss_mask values, offsets) of a shard's Arrow table."""
        with self._lock:
            cached = self.columns.get(shard)
        if cached is not None:
            return cached
        table = self.store.shard_samples(self.shard_ids[shard])
        ids = table.column("input_ids").combine_chunks()
        mask = table.column("loss_mask").combine_chunks()
        columns = (_as_numpy(ids.values), _as_numpy(ids.offsets), _as_numpy(mask.values), _as_numpy(mask.offsets))
        with self._lock:
            self.columns[shard] = columns
        return columns

    def open_ahead(
        self, samples: Iterable[int], features: Sequence[str], layers: Mapping[str, Sequence[int]], pool: ThreadPoolExecutor
    ) -> None:
        """Submit to ``pool`` the first-use fetches (sample table; per array its zarr.json and index)
        of the shards of ``samples`` not opened yet. On object storage each is a round trip that a
        shard's first read would otherwise wait for, one after another. Errors are left to the
        sample read that needs the same file (it raises with the shard named, or skips)."""
        shard_ids = {self.locate(s)[0] for s in samples}
        with self._lock:
            new = sorted(shard_ids - self.opened)
            self.opened.update(new)
        for shard_id in new:
            pool.submit(_quietly, self.store.open_ahead, shard_id)
            for name in features:
                for array_name in self.store.files_to_read(name, layers):
                    pool.submit(_quietly, self.store.open_ahead, shard_id, array_name)

    def sample_tokens(self, sample: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``length`` input ids and loss-mask values of global sample ``sample``."""
        ids, ids_off, mask, mask_off = self._columns(int(self.shard_of[sample]))
        row = int(self.row_of[sample])
        return ids[ids_off[row] : ids_off[row] + length], mask[mask_off[row] : mask_off[row] + length]


# Shards' first-use files (table, zarr.json, index) fetched at once ahead of their reads (remote).
OPEN_AHEAD_THREADS = 16


def _quietly(function: Callable[..., None], *args: Any) -> None:
    try:
        function(*args)
    except Exception:  # noqa: BLE001 - the sample read that needs the file raises it
        logger.debug("open-ahead %s failed", args, exc_info=True)


# Sample tables fetched at once when a manifest lacks per-sample lengths (stores written before
# ShardRecord.sample_tokens): on object storage each is a GET with a round trip of milliseconds.
CATALOG_READS_IN_FLIGHT = 32


def build_catalog(store: Store) -> SampleCatalog:
    """The catalog of every committed sample of ``store``, from the manifest alone
    (``ShardRecord.sample_tokens``; offsets are the running sums, as the format requires), so that
    planning an epoch costs no request per shard: on object storage, 1,000 shards read one by one
    would take seconds before step 1. Shards recorded without the lengths (older stores) have their
    sample tables read, many in flight."""
    shards = store.shards
    lengths: list[np.ndarray | None] = [
        None if shard.sample_tokens is None else decode_sample_tokens(shard.sample_tokens) for shard in shards
    ]
    missing = [i for i, found in enumerate(lengths) if found is None]
    if missing:
        threads = min(CATALOG_READS_IN_FLIGHT, len(missing)) if store.location.prefers_threads else 1
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hsstore-catalog") as pool:
            tables = list(pool.map(store.shard_samples, [shards[i].shard_id for i in missing]))
        for i, table in zip(missing, tables, strict=True):
            lengths[i] = table.column("num_tokens").to_numpy().astype(np.int64)
    known = [found for found in lengths if found is not None]
    counts = [len(found) for found in known]
    num_tokens = np.concatenate(known).astype(np.int64) if known else np.zeros(0, np.int64)
    shard_of = np.repeat(np.arange(len(shards), dtype=np.int32), counts)
    starts = (np.cumsum(counts) - counts).astype(np.int64)
    row_of = (np.arange(len(num_tokens)) - starts[shard_of]).astype(np.int32)
    # token_offset: the running sum of the lengths within each shard (checked by hsstore verify).
    before = np.cumsum(num_tokens) - num_tokens
    token_offset = before - before[starts[shard_of]] if len(num_tokens) else np.zeros(0, np.int64)
    shard_ids = [shard.shard_id for shard in shards]
    return SampleCatalog(
        store=store,
        shard_ids=shard_ids,
        shard_sample_counts=counts,
        shard_of=shard_of,
        row_of=row_of,
        token_offset=token_offset.astype(np.int64),
        num_tokens=num_tokens,
        sample_names=SampleNames(store, shard_ids, shard_of, row_of),
    )


class SampleNames(Sequence[str]):
    """``"<sample_id> (shard <id>)"`` of a global sample index, for error messages: read from the
    shard's sample table only when a message needs it (planning needs no table)."""

    def __init__(self, store: Store, shard_ids: list[str], shard_of: np.ndarray, row_of: np.ndarray):
        self._store, self._shard_ids, self._shard_of, self._row_of = store, shard_ids, shard_of, row_of

    def __len__(self) -> int:
        return len(self._shard_of)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        shard_id = self._shard_ids[int(self._shard_of[index])]
        try:
            sample_id = self._store.shard_samples(shard_id).column("sample_id")[int(self._row_of[index])].as_py()
        except (ShardCorruptError, OSError):
            sample_id = f"#{int(self._row_of[index])}"
        return f"{sample_id} (shard {shard_id})"


def _as_numpy(array: Any) -> np.ndarray:
    """A primitive Arrow array without nulls as a numpy view of its data buffer. (pyarrow's
    ``to_numpy`` imports pandas on first use: ~1 s before the first batch of every process.)"""
    if array.null_count:
        raise ShardCorruptError(f"unexpected nulls in a sample table column ({array.type})")
    dtype = np.dtype(str(array.type))  # int32 / int64 / uint8: arrow and numpy names agree
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)
