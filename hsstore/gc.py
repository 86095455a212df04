"""Removing garbage: files under ``shards/`` that no manifest names (crashed or retried writers)."""

from __future__ import annotations

import time

from hsstore.commit import require_manifest
from hsstore.format.layout import SHARDS_DIR
from hsstore.storage import StoreLocation


def collect_garbage(location: StoreLocation, *, min_age_s: float = 3600.0, dry_run: bool = False) -> list[str]:
    """Delete unreferenced shard folders older than ``min_age_s`` and return their paths.

    The age guard keeps a writer that is still working (its folder not yet committed) safe."""
    manifest = require_manifest(location)
    named = {shard.path for shard in manifest.shards}
    removed = []
    for name in location.list_dir(SHARDS_DIR):
        folder = f"{SHARDS_DIR}/{name}"
        if folder in named:
            continue
        modified = location.last_modified(folder)
        if modified is not None and time.time() - modified < min_age_s:
            continue
        removed.append(folder)
        if not dry_run:
            location.remove_tree(folder)
    return removed

