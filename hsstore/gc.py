"""Removing garbage: files under ``shards/`` that no manifest names (crashed or retried writers)."""

from __future__ import annotations

import time

from hsstore.commit import require_manifest
from hsstore.format.layout import SHARDS_DIR
from hsstore.location import StoreLocation


def collect_garbage(location: StoreLocation, *, min_age_s: float = 3600.0, dry_run: bool = False) -> list[str]:
    """Delete unreferenced shard folders older than ``min_age_s`` and return their paths.

    The age guard keeps a writer that is still working (its folder not yet committed) safe."""
    manifest = require_manifest(location)
    named = {shard.path for shard in manifest.shards}
    removed = []
    for entry in location.fs.ls(location.path(SHARDS_DIR), detail=True) if location.exists(SHARDS_DIR) else []:
        folder = f"{SHARDS_DIR}/{entry['name'].rstrip('/').rsplit('/', 1)[-1]}"
        if folder in named:
            continue
        modified = _mtime(location, folder)
        if modified is not None and time.time() - modified < min_age_s:
            continue
        removed.append(folder)
        if not dry_run:
            location.remove_tree(folder)
    return removed


def _mtime(location: StoreLocation, folder: str) -> float | None:
    try:
        files = location.fs.find(location.path(folder), detail=True)
    except FileNotFoundError:
        return None
    times = []
    for info in files.values():
        stamp = info.get("mtime") or info.get("LastModified") or info.get("created")
        if hasattr(stamp, "timestamp"):
            stamp = stamp.timestamp()
        if isinstance(stamp, (int, float)):
            times.append(float(stamp))
    return max(times) if times else None
