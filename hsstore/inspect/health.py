"""Which shards of a store can be trusted: :func:`hsstore.verify_store` findings grouped by shard.

Inspection must still show a store with a damaged shard, and say which shard it left out. Every
function of :mod:`hsstore.inspect` takes ``skip_shards`` (a :class:`StoreHealth` or a set of ids) and
also skips, and reports, any shard that raises :class:`~hsstore.ShardCorruptError` while it reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from hsstore.errors import ShardCorruptError
from hsstore.manifest import ShardRecord

if TYPE_CHECKING:
    from hsstore.store import Store


@dataclass
class StoreHealth:
    """What :func:`hsstore.verify_store` found, grouped by shard.

    ``bad_shards`` maps a shard id to its fatal problems; inspection leaves those shards out and says
    so. ``store_problems`` are fatal findings outside one shard's files (manifest, duplicate ids);
    ``unreferenced`` lists garbage files (harmless). ``checked`` is ``checksums``, ``structure`` or
    ``none`` (nothing verified up front; read errors are still caught per shard).
    """

    checked: str
    bad_shards: dict[str, list[str]] = field(default_factory=dict)
    store_problems: list[str] = field(default_factory=list)
    unreferenced: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad_shards and not self.store_problems

    def mark_bad(self, shard_id: str, problem: str) -> None:
        self.bad_shards.setdefault(shard_id, []).append(problem)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked": self.checked,
            "bad_shards": {k: list(v) for k, v in sorted(self.bad_shards.items())},
            "store_problems": list(self.store_problems),
            "num_unreferenced_files": len(self.unreferenced),
        }


def check_health(store: Store, *, checksums: bool = True) -> StoreHealth:
    """Verify ``store`` and attribute each fatal problem to the shard whose files it concerns.

    ``checksums=False`` checks sizes and structure only (no full read): use it for very large stores.
    """
    from hsstore.verify import verify_store

    health = StoreHealth("checksums" if checksums else "structure")
    prefixes = [(shard.path + "/", shard.shard_id) for shard in store.shards]
    for problem in verify_store(store.location, checksums=checksums):
        if not problem.fatal:
            health.unreferenced.append(problem.where)
            continue
        owner = next((sid for prefix, sid in prefixes if problem.where.startswith(prefix)), None)
        if owner is None or problem.kind == "duplicate":
            # A duplicate id is a store-wide fact, not damage to the shard that happens to hold it.
            health.store_problems.append(str(problem))
        else:
            health.mark_bad(owner, str(problem))
    return health


def skip_set(skip_shards: StoreHealth | set[str] | None) -> set[str]:
    if skip_shards is None:
        return set()
    if isinstance(skip_shards, StoreHealth):
        return set(skip_shards.bad_shards)
    return set(skip_shards)


def readable_tables(store: Store, skip: set[str]) -> tuple[list[tuple[ShardRecord, pa.Table]], dict[str, str]]:
    """(shard, sample table) of every shard not in ``skip`` whose table opens; and why others did not."""
    tables, skipped = [], {sid: "listed as damaged" for sid in skip}
    for shard in store.shards:
        if shard.shard_id in skip:
            continue
        try:
            tables.append((shard, store.shard_samples(shard.shard_id)))
        except ShardCorruptError as err:
            skipped[shard.shard_id] = str(err)
    return tables, skipped
