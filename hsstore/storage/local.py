"""Local paths and ``file://``: direct file reads, rename-based commits, a ``flock`` for committers.

* Reads are ``pread``/``preadv`` straight into the caller's buffers (one syscall per range, no copy
  through Python bytes), sizes come from ``stat`` (cheap here, and exact).
* A file is published by writing a temp file, fsyncing it and renaming it over the target; a shard is
  written under ``shards/.tmp-<name>`` and its folder renamed into place when finished.
* Committers of one store serialise on an advisory ``flock`` on ``manifest.lock``: the kernel drops
  it when its holder dies, so a killed committer never leaves a stale lock and a slow live one is
  never robbed of it (a lock file judged stale by its age can be both). The file stays; it holds the
  last holder's pid.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO

from hsstore.errors import CommitConflictError, StoreWriteError
from hsstore.format.layout import LOCK_NAME, SHARDS_DIR
from hsstore.read_cache import OnFilled, report_filled
from hsstore.storage.base import LOCAL_PREFETCH_BATCHES, LOCAL_READ_THREADS
from hsstore.storage.fsspec_backend import FsspecBackend


class LocalBackend(FsspecBackend):
    """A store in a folder of this machine's file system."""

    read_threads = LOCAL_READ_THREADS
    prefetch_batches = LOCAL_PREFETCH_BATCHES
    prefers_threads = False
    uses_read_cache = False  # the page cache already keeps what was read
    range_reader = "local"

    def _open_range_reader(self) -> None:
        return None  # whatever HSSTORE_RANGE_READER says: local files are read directly

    @property
    def local_directory(self) -> str | None:
        return self.root

    @property
    def bodies_arrive_whole(self) -> bool:
        return False  # preadv reads straight into the caller's buffers: no body to copy from

    # -- reading: straight from the file ------------------------------------------------------

    def read_bytes(self, key: str, size: int | None = None) -> bytes:
        with open(self.path(key), "rb") as handle:  # whole, whatever was recorded: damage shows
            return handle.read()

    def read_range(self, key: str, start: int, end: int) -> bytes:
        fd = os.open(self.path(key), os.O_RDONLY)
        try:
            return os.pread(fd, end - start, start)
        finally:
            os.close(fd)

    def read_range_into(self, key: str, offset: int, buffers: list[Any], on_filled: OnFilled | None = None) -> int:
        fd = os.open(self.path(key), os.O_RDONLY)
        try:
            got = os.preadv(fd, buffers, offset)
        finally:
            os.close(fd)
        report_filled(buffers, got, on_filled)  # one syscall filled them all: report each after it
        return got

    def file_size(self, key: str, recorded: int | None = None) -> int:
        return os.stat(self.path(key)).st_size  # a stat costs nothing here and sees a truncated file

    def zarr_store(self, prefix: str, read_only: bool) -> Any:
        from zarr.storage import LocalStore

        return LocalStore(self.path(prefix), read_only=read_only)

    # -- writing and publishing: temp + rename ------------------------------------------------

    def open_write(self, key: str) -> BinaryIO:
        os.makedirs(os.path.dirname(self.path(key)), exist_ok=True)  # as object stores need no folders
        return super().open_write(key)

    def write_bytes_atomic(self, key: str, data: bytes) -> None:
        target = self.path(key)
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

    def read_bytes_versioned(self, key: str) -> tuple[bytes, str | None]:
        return self.read_bytes(key), None  # committers hold commit_lock: no version to compare

    def write_bytes_if(self, key: str, data: bytes, version: str | None) -> None:
        self.write_bytes_atomic(key, data)

    def staging_folder(self, folder: str) -> str:
        return f"{SHARDS_DIR}/.tmp-{folder.rsplit('/', 1)[-1]}"

    def publish_folder(self, staging: str, folder: str) -> None:
        os.rename(self.path(staging), self.path(folder))
        _fsync_dir(os.path.dirname(self.path(folder)))

    @contextlib.contextmanager
    def commit_lock(self, timeout_s: float = 60.0) -> Iterator[None]:
        import fcntl

        self.makedirs("")
        lock_path = self.path(LOCK_NAME)
        deadline = time.monotonic() + timeout_s
        while True:
            fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise CommitConflictError(
                                f"{lock_path}: another process has been committing for over "
                                f"{timeout_s:.0f}s (holder pid in the file)"
                            ) from None
                        time.sleep(0.005)
                # The file may have been replaced while we waited (an older hsstore unlinked its lock
                # file on release): hold the lock of the file that is at the path now, or try again.
                try:
                    current = os.stat(lock_path).st_ino
                except FileNotFoundError:
                    current = None
                if current != os.fstat(fd).st_ino:
                    os.close(fd)
                    continue
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                try:
                    yield
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                return
            finally:
                with contextlib.suppress(OSError):
                    os.close(fd)


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
