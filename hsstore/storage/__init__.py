"""Storage backends: where a store's bytes live, behind one small protocol (:class:`StoreLocation`).

``StoreLocation(url, storage_options)`` picks the backend by the URL's scheme:

| backend | URLs | reads | publishes | committers serialise on |
|---|---|---|---|---|
| :class:`LocalBackend` | paths, ``file://`` | ``preadv`` into the caller's buffers | temp + ``rename``; shard folders renamed into place | ``flock`` on ``manifest.lock`` |
| :class:`S3Backend` | ``s3://`` (s3fs) | obstore ranged GETs, outside the GIL, streamed into the caller's buffers | one PUT | conditional PUTs (``If-Match`` / ``If-None-Match``) |
| :class:`MemoryBackend` | ``memory://`` | fsspec | one write | a lock of the process |
| :class:`FsspecBackend` | anything else fsspec opens (``gs://`` ...) | fsspec ranged reads | one PUT | a re-read just before the PUT |

What differs between them beyond that (reads in flight, read-ahead, whether threads or a local read
cache pay off) is a capability of the backend, never a test of its type elsewhere in hsstore.
``hsstore.testing.StoreTests`` is the contract every backend passes.
"""

from hsstore.storage.base import (
    LOCAL_PREFETCH_BATCHES,
    LOCAL_READ_THREADS,
    REMOTE_PREFETCH_BATCHES,
    REMOTE_READ_THREADS,
    StoreLocation,
    as_location,
    backend_class,
    register_backend,
)
from hsstore.storage.fsspec_backend import FsspecBackend, MemoryBackend
from hsstore.storage.local import LocalBackend
from hsstore.storage.s3 import S3Backend

__all__ = [
    "LOCAL_PREFETCH_BATCHES",
    "LOCAL_READ_THREADS",
    "REMOTE_PREFETCH_BATCHES",
    "REMOTE_READ_THREADS",
    "FsspecBackend",
    "LocalBackend",
    "MemoryBackend",
    "S3Backend",
    "StoreLocation",
    "as_location",
    "backend_class",
    "register_backend",
]
