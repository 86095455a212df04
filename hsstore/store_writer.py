"""Writing a store from a single process: shards rolled by size, each committed when full."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from hsstore.commit import commit_shards, ensure_store
from hsstore.format.features import FeatureSpec
from hsstore.lineage import Lineage
from hsstore.manifest import ShardRecord
from hsstore.storage import StoreLocation, as_location
from hsstore.writer import ShardWriter


class StoreWriter:
    """Single-process convenience: rolls shards at ``shard_max_tokens`` and commits each one.

    Committing per shard bounds what a crash can lose to the shard in progress.
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | StoreLocation,
        features: Sequence[FeatureSpec],
        lineage: Lineage,
        *,
        shard_max_tokens: int = 1 << 20,
        shard_prefix: str = "s",
        storage_options: dict[str, Any] | None = None,
    ):
        self.location = as_location(url, storage_options)
        self.features = list(features)
        self.lineage = lineage
        self.shard_max_tokens = shard_max_tokens
        self.shard_prefix = shard_prefix
        manifest = ensure_store(self.location, features=self.features, lineage=lineage)
        self._next_index = len(
            [s for s in manifest.shards if s.shard_id.startswith(f"{shard_prefix}-")]
        )
        self._shard: ShardWriter | None = None
        self.records: list[ShardRecord] = []

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        elif self._shard is not None:
            self._shard.abort()
            self._shard = None

    def add_sample(self, **sample: Any) -> None:
        if self._shard is None:
            shard_id = f"{self.shard_prefix}-{self._next_index:06d}"
            self._next_index += 1
            self._shard = ShardWriter(self.location, shard_id, self.features)
        self._shard.add_sample(**sample)
        if self._shard.num_tokens >= self.shard_max_tokens:
            self._commit_current()

    def _commit_current(self) -> None:
        if self._shard is None:
            return
        record = self._shard.finish()
        self._shard = None
        commit_shards(self.location, [record], features=self.features, lineage=self.lineage)
        self.records.append(record)

    def close(self) -> None:
        """Commit the shard in progress (if it holds samples)."""
        if self._shard is not None and self._shard.num_samples == 0:
            self._shard.abort()
            self._shard = None
        self._commit_current()
