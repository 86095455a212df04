"""Committing shards: the manifest read-merge-write that makes written shards visible, atomically.

A shard becomes part of the store only when :func:`commit_shards` writes a manifest naming it. How
concurrent committers are serialised is the backend's (``StoreLocation.commit_lock`` and
``write_bytes_if``): a ``flock`` locally, an in-process lock for ``memory://``, conditional PUTs on
S3; docs/format.md and docs/reliability.md describe the scheme and what each backend guarantees.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Iterable, Sequence
from typing import Any

from hsstore.errors import CommitConflictError, ManifestError, StoreNotFoundError
from hsstore.format.features import FeatureSpec
from hsstore.format.layout import MANIFEST_NAME
from hsstore.lineage import Lineage
from hsstore.manifest import ShardRecord, StoreManifest, now_iso, parse_manifest
from hsstore.storage import StoreLocation, as_location

logger = logging.getLogger(__name__)


def read_manifest(location: StoreLocation) -> StoreManifest | None:
    """The committed manifest, or None for an empty location."""
    try:
        data = location.read_bytes(MANIFEST_NAME)
    except FileNotFoundError:
        return None
    return parse_manifest(data, source=location.path(MANIFEST_NAME))


def committed_shard_ids(
    url: str | os.PathLike[str] | StoreLocation, storage_options: dict[str, Any] | None = None
) -> set[str]:
    """Shard ids already committed (empty for a store that does not exist yet): what a rerun skips."""
    manifest = read_manifest(as_location(url, storage_options))
    return {shard.shard_id for shard in manifest.shards} if manifest else set()


COMMIT_ATTEMPTS = 50


def _read_manifest_versioned(location: StoreLocation) -> tuple[StoreManifest | None, str | None]:
    try:
        data, version = location.read_bytes_versioned(MANIFEST_NAME)
    except FileNotFoundError:
        return None, None
    return parse_manifest(data, source=location.path(MANIFEST_NAME)), version


def commit_shards(
    url: str | os.PathLike[str] | StoreLocation,
    shards: Iterable[ShardRecord],
    *,
    features: Sequence[FeatureSpec],
    lineage: Lineage,
    storage_options: dict[str, Any] | None = None,
) -> StoreManifest:
    """Add shard records to the manifest, atomically. Creates the store on the first commit.

    Records whose shard id is already committed are skipped (a retried unit), so committing is
    idempotent; a commit that adds nothing to an existing store writes nothing. Features and lineage
    must equal the store's: a store holds one extraction.

    Any number of committers may run at once (several drivers, a driver and a retried actor): each
    commit is a read-merge-write serialised by the backend (``StoreLocation.commit_lock``), and a
    publish that lost a race (``write_bytes_if``: S3's conditional PUT) re-reads, merges and tries
    again, so no committed shard is ever lost. Only backends without a lock or a compare-and-swap
    (gs:// ...) keep a small window (docs/reliability.md).
    """
    location = as_location(url, storage_options)
    records = list(shards)
    delay = 0.01
    for attempt in range(1, COMMIT_ATTEMPTS + 1):
        # A lock timeout raises out of commit_lock: retrying would only wait longer. A conflict
        # raised by the publish (the manifest moved since it was read) is merged again.
        with location.commit_lock():
            try:
                return _commit_once(location, records, features, lineage)
            except CommitConflictError as err:
                if attempt == COMMIT_ATTEMPTS:
                    raise
                logger.info("manifest commit conflict (attempt %d): %s; retrying", attempt, err)
        # Jittered backoff so that racing committers spread out instead of colliding again.
        time.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 1.0)
    raise AssertionError("unreachable")


def _commit_once(
    location: StoreLocation,
    records: list[ShardRecord],
    features: Sequence[FeatureSpec],
    lineage: Lineage,
) -> StoreManifest:
    current, version = _read_manifest_versioned(location)
    existing = current is not None
    if current is None:
        current = StoreManifest(features=list(features), lineage=lineage, generation=0)
    else:
        _check_same_contract(location, current, features, lineage)
    committed = {shard.shard_id for shard in current.shards}
    added: list[ShardRecord] = []
    for record in records:
        if record.shard_id in committed:
            logger.info("shard %s already committed; keeping the first attempt", record.shard_id)
            continue
        committed.add(record.shard_id)
        added.append(record)
    if existing and not added:
        return current
    all_shards = sorted([*current.shards, *added], key=lambda s: s.shard_id)
    manifest = StoreManifest(
        format_version=current.format_version,
        generation=current.generation + 1,
        created_at=current.created_at,
        updated_at=now_iso(),
        features=current.features,
        lineage=current.lineage,
        shards=all_shards,
        num_samples=sum(s.num_samples for s in all_shards),
        num_tokens=sum(s.num_tokens for s in all_shards),
    )
    location.write_bytes_if(MANIFEST_NAME, manifest.to_json().encode(), version)
    return manifest


def _check_same_contract(
    location: StoreLocation, current: StoreManifest, features: Sequence[FeatureSpec], lineage: Lineage
) -> None:
    ours = {spec.name: spec for spec in features}
    if ours != current.feature_map:
        raise ManifestError(
            f"{location.url}: features differ from the store's "
            f"(store: {sorted(current.feature_map)}, commit: {sorted(ours)}; codecs/shapes must match too)"
        )
    diffs = current.lineage.diff(lineage)
    if diffs:
        field, stored, given = diffs[0]
        raise ManifestError(
            f"{location.url}: lineage field {field!r} differs from the store's "
            f"(store: {stored!r}, commit: {given!r}); write to a new store"
        )


def ensure_store(
    url: str | os.PathLike[str] | StoreLocation,
    *,
    features: Sequence[FeatureSpec],
    lineage: Lineage,
    storage_options: dict[str, Any] | None = None,
) -> StoreManifest:
    """Create an empty store (or check an existing one against ``features`` and ``lineage``)."""
    return commit_shards(url, [], features=features, lineage=lineage, storage_options=storage_options)


def require_manifest(location: StoreLocation) -> StoreManifest:
    manifest = read_manifest(location)
    if manifest is None:
        raise StoreNotFoundError(
            f"{location.url}: no committed store here ({MANIFEST_NAME} not found)"
        )
    return manifest
