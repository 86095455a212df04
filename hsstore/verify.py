"""``hsstore verify``: check every committed file against the manifest, and list garbage.

Checks, per shard: each named file exists with the recorded size and sha256; the sample table opens,
has the recorded rows, contiguous token offsets summing to the recorded tokens and equal-length
ids/masks; every feature array has the recorded token count and per-token shape. Store-wide:
duplicate sample ids, and files no manifest names (left by crashed or retried writers).

Shards are checked ``threads`` at a time (hashlib and the reads release the GIL): hashing is
CPU-bound on a local disk (one thread hashes ~1-2 GB/s) and latency-bound on object storage, where
a shard's files are read one after another. Findings come back in the manifest's shard order
whatever the number of threads.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from hsstore.commit import read_manifest
from hsstore.errors import HsstoreError
from hsstore.format.layout import LOCK_NAME, MANIFEST_NAME, features_root, samples_path
from hsstore.manifest import ShardRecord, StoreManifest
from hsstore.storage import StoreLocation

# Files a store may hold besides shards; never reported as garbage.
KNOWN_TOP_LEVEL = {MANIFEST_NAME, LOCK_NAME}
KNOWN_DIRS = ("rejects/", "plan/")  # the extraction's rejects and plan journal


@dataclass(frozen=True)
class Problem:
    """One finding; ``where`` is a path relative to the store root (or the shard id)."""

    kind: str
    where: str
    detail: str
    fatal: bool = True

    def __str__(self) -> str:
        return f"{self.kind}: {self.where}: {self.detail}"


def verify_store(location: StoreLocation, *, checksums: bool = True, threads: int | None = None) -> list[Problem]:
    """Every problem found; an empty list means the store is sound. Garbage files are non-fatal.

    ``threads``: shards checked at once (default: the cores for a local store, where hashing is the
    work; the location's read threads on object storage, where waiting on requests is)."""
    try:
        manifest = read_manifest(location)
    except HsstoreError as err:
        return [Problem("manifest", MANIFEST_NAME, str(err))]
    if manifest is None:
        return [Problem("manifest", MANIFEST_NAME, f"not found under {location.url}")]
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    threads = threads or location.verify_threads

    def check(shard: ShardRecord) -> tuple[list[Problem], list[str]]:
        ids: list[str] = []
        return verify_shard(location, manifest, shard, checksums=checksums, sample_ids=ids), ids

    problems: list[Problem] = []
    seen_ids: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=min(threads, max(1, len(manifest.shards))), thread_name_prefix="hsstore-verify") as pool:
        for shard, (found, ids) in zip(manifest.shards, pool.map(check, manifest.shards), strict=True):
            problems.extend(found)
            # Duplicates across shards, in shard order: the first shard to hold an id owns it.
            for sample_id in ids:
                other = seen_ids.get(sample_id)  # an earlier shard, or earlier in this one
                if other is not None:
                    problems.append(Problem("duplicate", samples_path(shard.path), f"sample_id {sample_id!r} also in shard {other}"))
                else:
                    seen_ids[sample_id] = shard.shard_id
    named = {entry.path for shard in manifest.shards for entry in shard.files}
    for path in location.list_files():
        if path in named or path in KNOWN_TOP_LEVEL or path.startswith(KNOWN_DIRS):
            continue
        problems.append(Problem("unreferenced", path, "not named by the manifest (garbage from an uncommitted writer)", fatal=False))
    return problems


def verify_shard(
    location: StoreLocation,
    manifest: StoreManifest,
    shard: ShardRecord,
    *,
    checksums: bool = True,
    sample_ids: list[str] | None = None,
) -> list[Problem]:
    """The shard's findings; its sample ids are appended to ``sample_ids`` (for the store-wide
    duplicate check) once its table reads."""
    problems: list[Problem] = []
    files_ok = True
    for entry in shard.files:
        try:
            if checksums:
                size, digest = location.sha256(entry.path)
            else:
                size, digest = location.size(entry.path), entry.sha256
        except FileNotFoundError:
            problems.append(Problem("missing", entry.path, f"file of shard {shard.shard_id} is gone"))
            files_ok = False
            continue
        if size != entry.size:
            problems.append(Problem("size", entry.path, f"{size} bytes, manifest says {entry.size} (truncated or rewritten)"))
            files_ok = False
        elif digest != entry.sha256:
            problems.append(Problem("checksum", entry.path, f"sha256 {digest[:16]}... != manifest {entry.sha256[:16]}..."))
            files_ok = False
    if not files_ok:
        return problems  # structure checks on damaged files would only repeat the finding
    problems.extend(_check_table(location, shard, sample_ids))
    problems.extend(_check_arrays(location, manifest, shard))
    return problems


def _check_table(location: StoreLocation, shard: ShardRecord, sample_ids: list[str] | None) -> list[Problem]:
    path = samples_path(shard.path)
    try:
        table = pa.ipc.open_file(pa.BufferReader(location.read_bytes(path))).read_all()
    except (OSError, pa.ArrowInvalid) as err:
        return [Problem("table", path, f"cannot read: {err}")]
    problems = []
    if table.num_rows != shard.num_samples:
        problems.append(Problem("rows", path, f"{table.num_rows} rows, manifest says {shard.num_samples}"))
    lengths = np.asarray(table.column("num_tokens").to_numpy(), dtype=np.int64)
    offsets = np.asarray(table.column("token_offset").to_numpy(), dtype=np.int64)
    if int(lengths.sum()) != shard.num_tokens:
        problems.append(Problem("tokens", path, f"{int(lengths.sum())} tokens, manifest says {shard.num_tokens}"))
    expected_offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else lengths
    if not np.array_equal(offsets, expected_offsets):
        problems.append(Problem("offsets", path, "token_offset is not the running sum of num_tokens"))
    for column in ("input_ids", "loss_mask"):
        list_lengths = np.asarray(pa.compute.list_value_length(table.column(column)).to_numpy(zero_copy_only=False))
        if not np.array_equal(list_lengths, lengths):
            problems.append(Problem("lengths", path, f"{column} lengths disagree with num_tokens"))
    if sample_ids is not None:
        sample_ids.extend(table.column("sample_id").to_pylist())
    return problems


def _check_arrays(location: StoreLocation, manifest: StoreManifest, shard: ShardRecord) -> list[Problem]:
    import zarr

    problems = []
    root = features_root(shard.path)
    for spec in manifest.features:
        for array_name, tail, _, _, _ in spec.file_arrays():
            where = f"{root}/{array_name}"
            try:
                # zarr_format=3: hsstore writes v3 only; unspecified, zarr also probes for v2's
                # .zarray/.zattrs, requests that cost as much as the open itself on object storage.
                array: Any = zarr.open_array(
                    location.zarr_store(root, read_only=True), path=array_name, mode="r", zarr_format=3
                )
            except Exception as err:
                problems.append(Problem("array", where, f"cannot open: {err}"))
                continue
            if tuple(array.shape) != (shard.num_tokens, *tail):
                problems.append(
                    Problem("shape", where, f"shape {tuple(array.shape)}, expected {(shard.num_tokens, *tail)}")
                )
    return problems
