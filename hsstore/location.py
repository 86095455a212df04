"""Where a store lives: an fsspec filesystem plus a root, with the few primitives the format needs.

Two kinds of backend behave differently for commits:

* local filesystems have an atomic rename: files are written under a temporary name and renamed;
* object stores (s3, gs, memory) have no rename but a single-object PUT is atomic: objects are
  written under their final (unique, never reused) names and only the manifest PUT publishes them.

Either way the manifest is the only commit point, so a crash leaves unreferenced files, never a
half-visible shard.

Concurrent committers need more than an atomic publish: a read-merge-write of the manifest must not
lose another committer's shards. How each backend serialises that (``StoreLocation.commit_guard``):

* ``local``: an advisory ``flock`` on ``manifest.lock`` (the kernel drops it when the holder dies);
* ``conditional`` (S3 and S3-compatible stores through s3fs): the manifest PUT carries ``If-Match``
  with the ETag that was read, or ``If-None-Match: *`` when creating, so a PUT based on a stale read
  is refused by the server (HTTP 412) and the committer re-reads and merges again;
* ``process`` (``memory://``): the filesystem lives in one process, so a lock in that process is exact;
* ``unguarded`` (other object stores, e.g. gcs through gcsfs): no compare-and-swap is used; the
  committer re-checks the generation just before its PUT, which narrows the race but cannot close it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from hsstore.errors import CommitConflictError, StoreWriteError, botocore_responses
from hsstore.range_reads import remote_range_reader

HASH_BLOCK = 8 << 20
# Reads in flight a loader keeps by default (StoreLocation.read_threads). 4 keep a local disk busy; an
# object store answers each request after a latency of its own, which more requests in flight hide,
# and a thread waiting on a GET costs no CPU: against moto with 100 ms added per request, 8 read
# 1.47x (obstore) / 1.18x (s3fs) what 4 read and 16 read 1.12x what 8 read; on loopback 16 read
# 1.13x (16 cores) / 1.17x (2 cores) what 8 read, 32 no more than 16 (benchmarks/RESULTS.md,
# "Requests in flight" and "The copy without the GIL").
LOCAL_READ_THREADS = 4
REMOTE_READ_THREADS = 16
# Batches a loader reads ahead by default (StoreLocation.prefetch_batches). Reads land straight in
# batch buffers, so the reads in flight are bounded by the batches being read: with 4 (two groups of
# two), 16 read threads on object storage sat idle half the time; 8 read 1.26x what 4 read
# there (16 cores), 16 less than 8 (more fresh buffers to fault in); locally 4 keep the threads busy.
LOCAL_PREFETCH_BATCHES = 4
REMOTE_PREFETCH_BATCHES = 8


class StoreLocation:
    """An fsspec filesystem and a root path inside it."""

    def __init__(self, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None):
        url = os.fspath(url)
        self.url = url
        self.storage_options = dict(storage_options or {})
        fs, root = fsspec.core.url_to_fs(url, **self.storage_options)
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self.is_local = isinstance(fs, LocalFileSystem)
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        if self.is_local:
            self.commit_guard = "local"
        elif protocols & {"s3", "s3a"} and hasattr(fs, "call_s3"):
            self.commit_guard = "conditional"
        elif "memory" in protocols:
            self.commit_guard = "process"
        else:
            self.commit_guard = "unguarded"
        # Ranged reads of shard files: obstore on S3 where it can (hsstore.range_reads), else fsspec's cat_file.
        self._range_reader = None if self.is_local else remote_range_reader(url, self.storage_options, protocols, fs)
        # What reads shard bytes (for logs and tests): "local" (preadv), "obstore" or "fsspec".
        self.range_reader = "local" if self.is_local else "obstore" if self._range_reader is not None else "fsspec"

    def __repr__(self) -> str:
        return f"StoreLocation({self.url!r})"

    @property
    def read_threads(self) -> int:
        """Reads in flight a loader keeps by default for a store here."""
        return LOCAL_READ_THREADS if self.is_local else REMOTE_READ_THREADS

    @property
    def prefetch_batches(self) -> int:
        """Batches a loader reads ahead by default for a store here."""
        return LOCAL_PREFETCH_BATCHES if self.is_local else REMOTE_PREFETCH_BATCHES

    def __getstate__(self) -> dict[str, Any]:
        # Filesystem objects hold sockets and event loops: ship the URL, rebuild on the other side.
        return {"url": self.url, "storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["storage_options"])  # type: ignore[misc]

    def path(self, relative: str = "") -> str:
        return posixpath.join(self.root, relative) if relative else self.root

    def exists(self, relative: str) -> bool:
        return bool(self.fs.exists(self.path(relative)))

    def read_bytes(self, relative: str) -> bytes:
        return bytes(self.fs.cat_file(self.path(relative)))

    def read_range(self, path: str, start: int, end: int) -> bytes | memoryview:
        """Bytes ``[start, end)`` of the file at ``path`` (a full path, as :meth:`path` gives)."""
        if self._range_reader is not None:
            return self._range_reader.read(path, start, end)
        return bytes(self.fs.cat_file(path, start=start, end=end))

    def size(self, relative: str) -> int:
        return int(self.fs.size(self.path(relative)))

    def makedirs(self, relative: str) -> None:
        self.fs.makedirs(self.path(relative), exist_ok=True)

    def write_bytes_atomic(self, relative: str, data: bytes) -> None:
        """Publish ``data`` at ``relative`` in one step: temp + rename locally, one PUT elsewhere."""
        target = self.path(relative)
        if self.is_local:
            directory = os.path.dirname(target)
            os.makedirs(directory, exist_ok=True)
            temp = os.path.join(directory, f".{os.path.basename(target)}.{uuid.uuid4().hex}.tmp")
            try:
                with open(temp, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(temp, target)
            except OSError as err:
                # A full disk or a quota fails the temp file: remove it, leave the target as it was.
                with contextlib.suppress(OSError):
                    os.unlink(temp)
                raise StoreWriteError(
                    err.errno,
                    f"{target}: could not write {len(data):,} bytes ({err.strerror or err}); "
                    "the previous version is untouched",
                ) from err
            _fsync_dir(directory)
        else:
            self.fs.pipe_file(target, data)

    def read_bytes_versioned(self, relative: str) -> tuple[bytes, str | None]:
        """The object's bytes and a version token for :meth:`write_bytes_if` (the S3 ETag).

        The token is None where the backend offers no conditional write. On S3 the bytes are read
        with ``If-Match`` on the ETag from the same HEAD, so bytes and token always agree (a change in
        between fails the read, and the caller retries). Raises FileNotFoundError when absent."""
        if self.commit_guard != "conditional":
            return self.read_bytes(relative), None
        from s3fs.utils import FileExpired

        path = self.path(relative)
        for _ in range(100):
            self.fs.invalidate_cache(path)
            try:
                with self.fs.open(path, "rb", cache_type="none") as handle:
                    etag = handle.details.get("ETag")
                    data = handle.read()
                return bytes(data), etag
            except FileExpired:
                continue  # replaced between the HEAD and the GET: read the newer one
        raise CommitConflictError(f"{path}: kept changing while being read (100 tries)")

    def write_bytes_if(self, relative: str, data: bytes, version: str | None) -> None:
        """Publish ``data`` only if the object is still at ``version`` (None: only if it is absent).

        On the ``conditional`` backend the check is the server's (``If-Match`` / ``If-None-Match: *``)
        and a failed precondition raises :class:`CommitConflictError`; elsewhere this is
        :meth:`write_bytes_atomic` and the caller serialises writers itself."""
        if self.commit_guard != "conditional":
            self.write_bytes_atomic(relative, data)
            return
        path = self.path(relative)
        try:
            if version is None:
                self.fs.pipe_file(path, data, mode="create")
            else:
                self.fs.pipe_file(path, data, IfMatch=version)
        except Exception as err:
            if _precondition_failed(err):
                raise CommitConflictError(
                    f"{path}: changed since it was read (conditional PUT refused)"
                ) from err
            raise
        finally:
            self.fs.invalidate_cache(path)

    def rename_dir(self, source: str, target: str) -> None:
        """Local only: move a finished shard folder into place atomically."""
        assert self.is_local, "rename_dir is only used on local filesystems"
        os.rename(self.path(source), self.path(target))
        _fsync_dir(os.path.dirname(self.path(target)))

    def remove_tree(self, relative: str) -> None:
        if self.fs.exists(self.path(relative)):
            self.fs.rm(self.path(relative), recursive=True)

    def list_files(self, relative: str = "") -> list[str]:
        """Every file under ``relative``, as paths relative to the root."""
        base = self.path(relative)
        if not self.fs.exists(base):
            return []
        prefix = self.root.strip("/") + "/"
        out = []
        for path in self.fs.find(base):
            path = path.lstrip("/")
            out.append(path[len(prefix) :] if path.startswith(prefix) else path)
        return sorted(out)

    def sha256(self, relative: str) -> tuple[int, str]:
        """(size, sha256 hex) of a file, streamed in large blocks (ranged GETs through the range
        reader where there is one: s3fs's one event loop read 0.3 GB/s on 2 cores)."""
        digest = hashlib.sha256()
        if self._range_reader is not None:
            path = self.path(relative)
            size = int(self.fs.size(path))
            for start in range(0, size, HASH_BLOCK):
                digest.update(self._range_reader.read(path, start, min(size, start + HASH_BLOCK)))
            return size, digest.hexdigest()
        size = 0
        with self.fs.open(self.path(relative), "rb", block_size=HASH_BLOCK) as handle:
            while True:
                block = handle.read(HASH_BLOCK)
                if not block:
                    break
                size += len(block)
                digest.update(block)
        return size, digest.hexdigest()

    def zarr_store(self, relative: str, read_only: bool) -> Any:
        """A zarr v3 store rooted at ``relative`` (LocalStore locally, FsspecStore elsewhere)."""
        from zarr.storage import FsspecStore, LocalStore

        if self.is_local:
            return LocalStore(self.path(relative), read_only=read_only)
        # Always from the URL: zarr then builds its own instance, with ``asynchronous=True`` for
        # async filesystems (s3fs, gcsfs) on zarr's event loop, and wraps synchronous ones
        # (memory://). Handing it ``self.fs`` (a synchronous s3fs bound to fsspec's loop) fails with
        # "Future attached to a different loop" as soon as two threads write.
        url = self.fs.unstrip_protocol(self.path(relative))
        return FsspecStore.from_url(url, storage_options=self.storage_options, read_only=read_only)


def _precondition_failed(err: BaseException) -> bool:
    """Whether an s3fs error is a refused precondition (412) or a concurrent conditional write (409)."""
    for response in botocore_responses(err):
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
            return True
    return False


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def as_location(url: str | os.PathLike[str] | StoreLocation, storage_options: dict[str, Any] | None = None) -> StoreLocation:
    """``url`` as a :class:`StoreLocation` (a location is passed through as it is)."""
    return url if isinstance(url, StoreLocation) else StoreLocation(url, storage_options)
