"""Any filesystem fsspec opens (``gs://``, ``az://``, ``memory://``, chained URLs ...), and the base
the local and S3 backends refine.

Object stores have no rename but a single-object PUT is atomic: files are written under their final
(unique, never reused) names and only the manifest PUT publishes them, so a crash leaves unreferenced
files, never a half-visible shard. Without a compare-and-swap, :meth:`FsspecBackend.write_bytes_if`
re-reads the file just before its PUT and refuses if it moved: that narrows the window between two
committers' read and write to one round trip but cannot close it (docs/reliability.md). ``memory://``
lives in this process, so :class:`MemoryBackend` holds a lock of the process and has no window.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

import fsspec

from hsstore.errors import CommitConflictError
from hsstore.storage.base import (
    HASH_BLOCK,
    REMOTE_PREFETCH_BATCHES,
    REMOTE_READ_THREADS,
    StoreLocation,
)
from hsstore.storage.s3_reads import ObstoreRangeReader, remote_range_reader


class FsspecBackend(StoreLocation):
    """A store on an fsspec filesystem: ``fs`` (the filesystem) and ``root`` (a path inside it)."""

    read_threads = REMOTE_READ_THREADS
    prefetch_batches = REMOTE_PREFETCH_BATCHES
    prefers_threads = True
    uses_read_cache = True

    def __init__(self, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None):
        super().__init__(url, storage_options)
        fs, root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        # Ranged reads of shard files through obstore where the backend has them (S3Backend).
        self._range_reader = self._open_range_reader()

    def _open_range_reader(self) -> ObstoreRangeReader | None:
        # Not S3: only checks HSSTORE_RANGE_READER (an unknown value, or obstore asked for, is refused).
        return remote_range_reader(self.url, self.storage_options, on_s3=False, fs=self.fs)

    # -- reading ------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self.path(key)))

    def size(self, key: str) -> int:
        return int(self.fs.size(self.path(key)))

    def read_bytes(self, key: str, size: int | None = None) -> bytes:
        if size is None:
            return bytes(self.fs.cat_file(self.path(key)))
        # Ranged to the known size: s3fs sends a HEAD first otherwise.
        return bytes(self.fs.cat_file(self.path(key), start=0, end=size)) if size else b""

    def read_range(self, key: str, start: int, end: int) -> bytes | memoryview:
        return bytes(self.fs.cat_file(self.path(key), start=start, end=end))

    def list_files(self, prefix: str = "") -> list[str]:
        base = self.path(prefix)
        if not self.fs.exists(base):
            return []
        root = self.root.strip("/") + "/"
        out = []
        for path in self.fs.find(base):
            path = path.lstrip("/")
            out.append(path[len(root) :] if path.startswith(root) else path)
        return sorted(out)

    def list_dir(self, prefix: str = "") -> list[str]:
        if not self.exists(prefix):
            return []
        return sorted(str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(self.path(prefix), detail=False))

    def last_modified(self, prefix: str) -> float | None:
        try:
            files = self.fs.find(self.path(prefix), detail=True)
        except FileNotFoundError:
            return None
        times = []
        for info in files.values():
            stamp = info.get("mtime") or info.get("LastModified") or info.get("created")
            if hasattr(stamp, "timestamp"):
                stamp = stamp.timestamp()
            if isinstance(stamp, int | float):
                times.append(float(stamp))
        return max(times) if times else None

    def sha256(self, key: str) -> tuple[int, str]:
        """Streamed through one open file in large blocks (fewer requests than ranged reads)."""
        digest = hashlib.sha256()
        size = 0
        with self.fs.open(self.path(key), "rb", block_size=HASH_BLOCK) as handle:
            while block := handle.read(HASH_BLOCK):
                size += len(block)
                digest.update(block)
        return size, digest.hexdigest()

    def zarr_store(self, prefix: str, read_only: bool) -> Any:
        from zarr.storage import FsspecStore

        # Always from the URL: zarr then builds its own instance, with ``asynchronous=True`` for
        # async filesystems (s3fs, gcsfs) on zarr's event loop, and wraps synchronous ones
        # (memory://). Handing it ``self.fs`` (a synchronous s3fs bound to fsspec's loop) fails with
        # "Future attached to a different loop" as soon as two threads write.
        url = self.fs.unstrip_protocol(self.path(prefix))
        return FsspecStore.from_url(url, storage_options=self.storage_options, read_only=read_only)

    # -- writing and publishing ---------------------------------------------------------------

    def makedirs(self, prefix: str) -> None:
        self.fs.makedirs(self.path(prefix), exist_ok=True)

    def open_write(self, key: str) -> BinaryIO:
        handle: BinaryIO = self.fs.open(self.path(key), "wb")
        return handle

    def write_bytes_atomic(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self.path(key), data)  # a single PUT is atomic on object stores

    def read_bytes_versioned(self, key: str) -> tuple[bytes, str | None]:
        data = self.read_bytes(key)
        return data, _digest(data)

    def write_bytes_if(self, key: str, data: bytes, version: str | None) -> None:
        """Re-read just before the PUT and refuse if the file moved (no compare-and-swap here)."""
        try:
            current: str | None = _digest(self.read_bytes(key))
        except FileNotFoundError:
            current = None
        if current != version:
            raise CommitConflictError(f"{self.path(key)}: changed since it was read (re-checked before the PUT)")
        self.write_bytes_atomic(key, data)

    def delete(self, key: str) -> None:
        self.fs.rm(self.path(key))

    def remove_tree(self, prefix: str) -> None:
        if self.fs.exists(self.path(prefix)):
            self.fs.rm(self.path(prefix), recursive=True)


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# In-process locks for memory:// stores, one per store root: the filesystem is this process's memory.
_PROCESS_LOCKS: dict[str, threading.Lock] = {}
_PROCESS_LOCKS_GUARD = threading.Lock()


class MemoryBackend(FsspecBackend):
    """``memory://``: fsspec's in-process filesystem; committers serialise on a lock of the process."""

    @contextlib.contextmanager
    def commit_lock(self, timeout_s: float = 60.0) -> Iterator[None]:
        with _PROCESS_LOCKS_GUARD:
            lock = _PROCESS_LOCKS.setdefault(self.fs.unstrip_protocol(self.root), threading.Lock())
        if not lock.acquire(timeout=timeout_s):
            raise CommitConflictError(
                f"{self.url}: another committer in this process held the store for over {timeout_s:.0f}s"
            )
        try:
            yield
        finally:
            lock.release()
