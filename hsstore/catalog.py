"""Where every sample of a store is: the loader's catalog, built once from the sample tables."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hsstore.store import Store


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
    sample_names: list[str]
    columns: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

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
        columns = (
            ids.values.to_numpy(zero_copy_only=False),
            ids.offsets.to_numpy(),
            mask.values.to_numpy(zero_copy_only=False),
            mask.offsets.to_numpy(),
        )
        with self._lock:
            self.columns[shard] = columns
        return columns

    def sample_tokens(self, sample: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``length`` input ids and loss-mask values of global sample ``sample``."""
        ids, ids_off, mask, mask_off = self._columns(int(self.shard_of[sample]))
        row = int(self.row_of[sample])
        return ids[ids_off[row] : ids_off[row] + length], mask[mask_off[row] : mask_off[row] + length]


def build_catalog(store: Store) -> SampleCatalog:
    """The catalog of every committed sample of ``store`` (reads each shard's sample table)."""
    shard_ids: list[str] = []
    counts: list[int] = []
    shard_of: list[np.ndarray] = []
    row_of: list[np.ndarray] = []
    offsets: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    names: list[str] = []
    for index, shard in enumerate(store.shards):
        table = store.shard_samples(shard.shard_id)
        shard_ids.append(shard.shard_id)
        counts.append(table.num_rows)
        shard_of.append(np.full(table.num_rows, index, dtype=np.int32))
        row_of.append(np.arange(table.num_rows, dtype=np.int32))
        offsets.append(table.column("token_offset").to_numpy().astype(np.int64))
        lengths.append(table.column("num_tokens").to_numpy().astype(np.int64))
        names.extend(f"{sid} (shard {shard.shard_id})" for sid in table.column("sample_id").to_pylist())

    def cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

    return SampleCatalog(
        store=store,
        shard_ids=shard_ids,
        shard_sample_counts=counts,
        shard_of=cat(shard_of, np.int32),
        row_of=cat(row_of, np.int32),
        token_offset=cat(offsets, np.int64),
        num_tokens=cat(lengths, np.int64),
        sample_names=names,
    )
