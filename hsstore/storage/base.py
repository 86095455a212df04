"""The protocol every storage backend implements: what the store asks of the place it lives.

Keys are ``/``-separated paths relative to the store's root (``manifest.json``,
``shards/<id>.<attempt>/samples.arrow``); :meth:`StoreLocation.path` gives a key's full name, for
messages. A backend answers for three things the rest of hsstore never asks about by type:

* **bytes**: whole files, ranges, ranges scattered straight into the caller's buffers, sizes,
  listings, writes, deletes; a missing key raises ``FileNotFoundError`` naming it;
* **publishing**: :meth:`~StoreLocation.write_bytes_atomic` makes a file visible in one step, and
  :meth:`~StoreLocation.read_bytes_versioned` / :meth:`~StoreLocation.write_bytes_if` with
  :meth:`~StoreLocation.commit_lock` let concurrent committers of the manifest lose nothing
  (docs/reliability.md says what each backend guarantees); a shard is written into
  :meth:`~StoreLocation.staging_folder` and moved into place by :meth:`~StoreLocation.publish_folder`;
* **capabilities**: the defaults that depend on where the bytes are (reads in flight, batches read
  ahead, whether threads or a local read cache pay off, a local directory if there is one).

``StoreLocation(url, storage_options)`` returns the backend registered for the URL's scheme, as
``pathlib.Path(...)`` returns a ``PosixPath``: local paths and ``file://`` are :class:`LocalBackend`,
``s3://`` is :class:`S3Backend`, ``memory://`` is :class:`MemoryBackend`, anything else fsspec opens
is :class:`FsspecBackend`. ``hsstore.testing.StoreTests`` is the contract a backend must pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import posixpath
from collections.abc import Iterator
from typing import Any, BinaryIO

from hsstore.read_cache import OnFilled, scatter

HASH_BLOCK = 8 << 20
# Reads in flight a loader keeps by default (StoreLocation.read_threads). 4 keep a local disk busy.
# An object store answers each GET after a first-byte latency L and then streams it at some rate R
# per connection, so reading T bytes/s in GETs of G bytes takes T * (L + G / R) / G reads in flight:
# for 5 GB/s (150k tokens/s of the Qwen3-8B shape's bf16 features, six H200 trainers) at L = 50 ms
# with ~10 MB GETs that is 25 for the latency alone, and S3's ~100 MB/s per connection adds 50
# (AWS: scale connections, fetch byte ranges in parallel). So 64, whatever the latency between
# 10 and 50 ms: a thread waiting on a GET costs no CPU, and its bytes land straight in the batches
# read ahead (no buffer per request). Before: 16, chosen on loopback (no latency). Against moto with
# 10-50 ms per request on 2 cores, where the CPU is the limit, 64 read as much as 16 or more
# (`bench_object_store s3-latency`; benchmarks/RESULTS.md, "Object storage with latency").
LOCAL_READ_THREADS = 4
REMOTE_READ_THREADS = 64
# Shards `hsstore verify` checks at once on object storage (each holds an 8 MB block in flight).
REMOTE_VERIFY_THREADS = 16
# Batches a loader reads ahead by default (StoreLocation.prefetch_batches). Reads land straight in
# batch buffers, so the reads in flight are bounded by the batches being read: with 4 (two groups of
# two), 16 read threads on object storage sat idle half the time; 8 read 1.26x what 4 read
# there (16 cores), 16 less than 8 (more fresh buffers to fault in); locally 4 keep the threads busy.
LOCAL_PREFETCH_BATCHES = 4
REMOTE_PREFETCH_BATCHES = 8

# Which backend serves which URL scheme ("module:Class", imported on first use so that a local store
# never imports s3fs). None stands for a plain path. register_backend adds more.
_BACKENDS: dict[str | None, str | type[StoreLocation]] = {
    None: "hsstore.storage.local:LocalBackend",
    "file": "hsstore.storage.local:LocalBackend",
    "local": "hsstore.storage.local:LocalBackend",
    "memory": "hsstore.storage.fsspec_backend:MemoryBackend",
    "s3": "hsstore.storage.s3:S3Backend",
    "s3a": "hsstore.storage.s3:S3Backend",
}
_DEFAULT_BACKEND = "hsstore.storage.fsspec_backend:FsspecBackend"


def register_backend(scheme: str, backend: type[StoreLocation] | str) -> None:
    """Serve URLs of ``scheme`` with ``backend`` (a class, or ``"module:Class"`` imported on use)."""
    _BACKENDS[scheme] = backend


def backend_class(url: str) -> type[StoreLocation]:
    """The backend class registered for ``url``'s scheme (fsspec's generic one for the others)."""
    if "::" in url:  # a chained URL (simplecache::s3://...): fsspec's generic backend
        spec: str | type[StoreLocation] = _DEFAULT_BACKEND
    else:
        spec = _BACKENDS.get(url.split("://", 1)[0] if "://" in url else None, _DEFAULT_BACKEND)
    if not isinstance(spec, str):
        return spec
    module, _, name = spec.partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, StoreLocation), cls
    return cls


class StoreLocation:
    """Where a store lives and the operations the store needs there (see the module docstring).

    The methods that raise NotImplementedError here are what a backend implements; the others have
    defaults built on them. Not an ``abc.ABC``: ``StoreLocation(url)`` itself must stay callable."""

    url: str
    storage_options: dict[str, Any]
    root: str

    def __new__(cls, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> StoreLocation:
        if cls is StoreLocation:  # called as the protocol: the backend for the URL's scheme
            cls = backend_class(os.fspath(url))
        return super().__new__(cls)

    def __init__(self, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None):
        self.url = os.fspath(url)
        self.storage_options = dict(storage_options or {})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Filesystem clients hold sockets and event loops: ship the URL, rebuild on the other side
        # (Ray workers, DataLoader processes), from that process's environment.
        return (type(self), (self.url, self.storage_options))

    def path(self, key: str = "") -> str:
        """The full name of ``key`` (the root for ``""``), as messages show it."""
        return posixpath.join(self.root, key) if key else self.root

    # -- capabilities: defaults that depend on where the bytes are ----------------------------

    #: Reads in flight a loader keeps by default for a store here.
    read_threads: int = LOCAL_READ_THREADS
    #: Batches a loader reads ahead by default.
    prefetch_batches: int = LOCAL_PREFETCH_BATCHES
    #: Requests wait on a network rather than on this machine, so many in flight pay off (reading
    #: sample tables, opening shards ahead of the reads, verifying).
    prefers_threads: bool = False
    #: A local :class:`~hsstore.read_cache.ReadCache` of the bytes read saves requests here.
    uses_read_cache: bool = False
    #: What reads shard bytes, for logs and tests (``local``, ``obstore``, ``fsspec``).
    range_reader: str = "fsspec"

    @property
    def bodies_arrive_whole(self) -> bool:
        """Whether :meth:`read_range` hands back a body the backend builds anyway (an HTTP response)
        that :meth:`read_range_into` would only copy from, as this class's does. A reader may then
        take the body and copy from it itself: the array reader checks each chunk's crc32c in the
        body and then copies it, which costs less than copying first and checking the copy (issue
        32). False where ``read_range_into`` fills the buffers without a body (local ``preadv``, a
        GET streamed in pieces)."""
        return True

    @property
    def local_directory(self) -> str | None:
        """The store's folder on this machine's file system, if it is on one."""
        return None

    @property
    def verify_threads(self) -> int:
        """Shards ``hsstore verify`` checks at once by default: the cores where hashing is the
        work, :data:`REMOTE_VERIFY_THREADS` where waiting on requests is."""
        return REMOTE_VERIFY_THREADS if self.prefers_threads else os.cpu_count() or 1

    # -- reading ------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def size(self, key: str) -> int:
        """The file's size in bytes; FileNotFoundError naming it when absent."""
        raise NotImplementedError

    def read_bytes(self, key: str, size: int | None = None) -> bytes:
        """The whole file. ``size``: its size if known (the manifest's), which saves an object
        store a HEAD. FileNotFoundError naming the key when absent."""
        raise NotImplementedError

    def read_range(self, key: str, start: int, end: int) -> bytes | memoryview:
        """Bytes ``[start, end)`` (fewer if the file is shorter: the caller checks)."""
        raise NotImplementedError

    def read_range_into(self, key: str, offset: int, buffers: list[Any], on_filled: OnFilled | None = None) -> int:
        """Fill the writable ``buffers`` one after another with the bytes from ``offset``; return
        how many bytes were read (less than asked leaves the buffers unspecified).

        ``on_filled(i)``, if given, is called in order for each buffer ``i`` as soon as it is
        completely filled (never for one a short read left unfilled; what it raises propagates):
        the array reader checks each chunk while its bytes are still in the CPU's cache. A backend
        that fills everything in one call reports each buffer after it
        (:func:`~hsstore.read_cache.report_filled`)."""
        nbytes = sum(memoryview(b).nbytes for b in buffers)
        data = self.read_range(key, offset, offset + nbytes)
        if len(data) == nbytes:
            scatter(data, buffers, on_filled)
        return len(data)

    def file_size(self, key: str, recorded: int | None = None) -> int:
        """The size of a committed file: ``recorded`` (the manifest's) where asking would cost a
        request, else asked. FileNotFoundError when absent and asked."""
        return recorded if recorded is not None else self.size(key)

    def list_files(self, prefix: str = "") -> list[str]:
        """Every file under ``prefix``, as sorted keys; empty when nothing is there."""
        raise NotImplementedError

    def list_dir(self, prefix: str = "") -> list[str]:
        """The names of the entries (files and folders) right under ``prefix``; empty if none."""
        raise NotImplementedError

    def last_modified(self, prefix: str) -> float | None:
        """The newest modification time (Unix seconds) of the files under ``prefix`` (None: none
        found, or the backend does not say)."""
        raise NotImplementedError

    def sha256(self, key: str) -> tuple[int, str]:
        """(size, sha256 hex) of a file, read in large ranged blocks."""
        digest = hashlib.sha256()
        size = self.size(key)
        for start in range(0, size, HASH_BLOCK):
            digest.update(self.read_range(key, start, min(size, start + HASH_BLOCK)))
        return size, digest.hexdigest()

    def zarr_store(self, prefix: str, read_only: bool) -> Any:
        """A zarr v3 store rooted at ``prefix`` (for zarr-python's own reads and writes)."""
        raise NotImplementedError

    # -- writing and publishing ---------------------------------------------------------------

    def makedirs(self, prefix: str) -> None:
        raise NotImplementedError

    def open_write(self, key: str) -> BinaryIO:
        """A binary file to stream a new file into, its folders made as needed (published by the
        manifest, not by closing)."""
        raise NotImplementedError

    def write_bytes(self, key: str, data: bytes) -> None:
        """Write a file that only a later manifest makes visible (no atomicity needed)."""
        with self.open_write(key) as handle:
            handle.write(data)

    def write_bytes_atomic(self, key: str, data: bytes) -> None:
        """Publish ``data`` at ``key`` in one step: readers see the old file or the new, whole."""
        raise NotImplementedError

    def remove_dead_atomic_writes(self, folder: str = "", name: str | None = None) -> list[str]:
        """Remove the temp files that :meth:`write_bytes_atomic` leaves when its process is killed
        before the rename (``.<name>.<hex>.tmp``; a single PUT to an object store leaves none) in
        ``folder``, or only those of ``name``. Call it only while no atomic write there is in
        flight (a job's own folder once it has finished). Returns the keys removed."""
        if folder and not self.exists(folder):
            return []
        stem = f".{name}." if name else "."
        removed = []
        for entry in self.list_dir(folder):
            if entry.startswith(stem) and entry.endswith(".tmp"):
                key = f"{folder}/{entry}" if folder else entry
                self.delete(key)
                removed.append(key)
        return removed

    def read_bytes_versioned(self, key: str) -> tuple[bytes, str | None]:
        """The file's bytes and a version token for :meth:`write_bytes_if` (None where this
        backend serialises committers with :meth:`commit_lock` instead). FileNotFoundError when absent."""
        raise NotImplementedError

    def write_bytes_if(self, key: str, data: bytes, version: str | None) -> None:
        """Publish ``data`` only if the file is still at ``version`` (None: only if absent, where
        the backend checks versions); a moved file raises :class:`~hsstore.errors.CommitConflictError`."""
        raise NotImplementedError

    @contextlib.contextmanager
    def commit_lock(self, timeout_s: float = 60.0) -> Iterator[None]:
        """Hold off the store's other committers where the backend can (a lock timeout raises
        :class:`~hsstore.errors.CommitConflictError`); by default nothing is held and
        :meth:`write_bytes_if` detects the conflicts."""
        yield

    def staging_folder(self, folder: str) -> str:
        """Where a shard ``folder`` is written before :meth:`publish_folder` (by default: in place,
        the manifest being what publishes it)."""
        return folder

    def publish_folder(self, staging: str, folder: str) -> None:
        """Move a finished shard from its staging folder to ``folder`` (by default: already there)."""
        assert staging == folder, (staging, folder)

    def delete(self, key: str) -> None:
        """Remove one file (FileNotFoundError naming it when absent)."""
        raise NotImplementedError

    def remove_tree(self, prefix: str) -> None:
        """Remove everything under ``prefix`` (nothing there is fine)."""
        raise NotImplementedError


def as_location(url: str | os.PathLike[str] | StoreLocation, storage_options: dict[str, Any] | None = None) -> StoreLocation:
    """``url`` as a :class:`StoreLocation` (a location is passed through as it is)."""
    return url if isinstance(url, StoreLocation) else StoreLocation(url, storage_options)
