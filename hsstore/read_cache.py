"""A bounded local cache of bytes read from a remote store (s3://, gs://, ...).

Training reads the same byte ranges every epoch: a sample's token range maps to the same chunks of
the same immutable files. From object storage each of those reads is a request with a latency and
a price; with a cache on local disk (or in memory) the second epoch reads them locally. The cache
is bounded: past ``max_bytes`` the least recently used entries are evicted, so it never fills the
disk of a training node.

Keys are content-derived: the sha256 of the file (from the manifest) plus the byte range, so an
entry can never be stale (a committed file is immutable, and a different file has another sha256)
and several stores, runs or processes may share one folder. Entries are written to a temporary
name and renamed, so a reader never sees half an entry; an entry that fails to read is treated
as a miss, and so is one whose crc32c (kept at its end) does not match: a damaged cache disk
costs a refetch, never wrong bytes. Other processes' entries are found on disk; eviction accounts only for the entries this
process knows (it scans the folder once when it opens), which is what a bound per node needs when
one process per GPU shares a folder: each keeps within ``max_bytes / num_processes`` if so set.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from hsstore.checksum import CRC_BYTES, crc32c_bytes

# Called with a buffer's index as soon as a read has filled it (see Scatter).
OnFilled = Callable[[int], None]


class ReadCache:
    """Bytes by key, bounded by ``max_bytes``; on disk under ``directory`` (or in memory if None)."""

    def __init__(self, directory: str | os.PathLike[str] | None, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.directory = None if directory is None else os.fspath(directory)
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[str, int] = OrderedDict()  # file name -> size, oldest use first
        self._memory: dict[str, bytes] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        if self.directory is not None:
            os.makedirs(self.directory, exist_ok=True)
            found = []
            for entry in os.scandir(self.directory):
                if entry.is_file() and entry.name.endswith(".bin"):
                    stat = entry.stat()
                    found.append((stat.st_atime, entry.name, stat.st_size))
            for _, name, size in sorted(found):
                self._entries[name] = size
                self._bytes += size
            self._evict()

    def __repr__(self) -> str:
        where = self.directory or "memory"
        return f"ReadCache({where!r}, {self._bytes:,}/{self.max_bytes:,} bytes, {len(self._entries)} entries)"

    def __getstate__(self) -> dict[str, Any]:
        # A worker process gets its own view of the same folder (an in-memory cache starts empty).
        return {"directory": self.directory, "max_bytes": self.max_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["directory"], state["max_bytes"])  # type: ignore[misc]

    @property
    def num_bytes(self) -> int:
        return self._bytes

    @staticmethod
    def key(*parts: object) -> str:
        """A file-name-safe key from its parts (e.g. a file's sha256 and a byte range)."""
        return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:40] + ".bin"

    def _touch(self, key: str) -> tuple[bool, bytes | None]:
        """Mark ``key`` as just used: (whether this process knows it, and for an in-memory cache
        its bytes, the hit or miss counted)."""
        with self._lock:
            known = key in self._entries
            if known:
                self._entries.move_to_end(key)
            if self.directory is not None:
                return known, None
            data = self._memory.get(key)
            self.hits += data is not None
            self.misses += data is None
            return known, data

    def get(self, key: str) -> bytes | None:
        known, data = self._touch(key)
        if self.directory is None:
            return data
        try:
            with open(os.path.join(self.directory, key), "rb") as handle:
                data = _checked(handle.read())
        except OSError:
            data = None
        self._count(key, known, None if data is None else len(data))
        return data

    def read_into(self, key: str, parts: list[Any], on_filled: OnFilled | None = None) -> bool:
        """Scatter the entry over ``parts`` (writable buffers whose sizes add up to the entry's):
        True on a hit. On disk the entry is read straight into them (one ``preadv``, as a local
        store reads its chunks) and its crc32c checked over them, so a hit copies nothing more;
        a miss, or an entry that fails its check, leaves ``parts`` to be overwritten by a fetch.
        ``on_filled(i)``: as a backend's ``read_range_into`` calls it, on a hit only."""
        nbytes = sum(memoryview(part).nbytes for part in parts)
        known, data = self._touch(key)
        if self.directory is None:
            if data is None or len(data) != nbytes:
                return False
            scatter(data, parts, on_filled)
            return True
        stored = bytearray(CRC_BYTES)
        try:
            fd = os.open(os.path.join(self.directory, key), os.O_RDONLY)
            try:
                got = os.preadv(fd, [*parts, stored], 0)
            finally:
                os.close(fd)
        except OSError:
            got = -1
        ok = got == nbytes + CRC_BYTES and crc32c_bytes(parts) == bytes(stored)
        self._count(key, known, nbytes if ok else None)
        if ok:
            report_filled(parts, nbytes, on_filled)
        return ok

    def _count(self, key: str, known: bool, size: int | None) -> None:
        """Book a disk hit (``size``: the entry's data bytes) or a miss (None)."""
        with self._lock:
            if size is None:
                self.misses += 1
                if known:  # evicted by another process sharing the folder
                    self._bytes -= self._entries.pop(key, 0)
            else:
                self.hits += 1
                if not known:  # written by another process sharing the folder
                    self._entries[key] = size + CRC_BYTES
                    self._bytes += size + CRC_BYTES
                    self._evict()

    def put(self, key: str, data: bytes | memoryview) -> None:
        size = len(data) + (CRC_BYTES if self.directory is not None else 0)  # what it takes on disk
        if size > self.max_bytes:
            return  # would evict everything else and still not fit
        if self.directory is not None:
            path = os.path.join(self.directory, key)
            temp = os.path.join(self.directory, f".{key}.{uuid.uuid4().hex[:8]}.tmp")
            try:
                with open(temp, "wb") as handle:
                    handle.write(data)
                    handle.write(crc32c_bytes([data]))
                os.replace(temp, path)
            except OSError:
                # A full or read-only cache disk costs only the caching, never the read.
                with contextlib.suppress(OSError):
                    os.unlink(temp)
                return
        with self._lock:
            if key in self._entries:
                self._bytes -= self._entries.pop(key)
            self._entries[key] = size
            self._bytes += size
            if self.directory is None:
                self._memory[key] = bytes(data)
            self._evict()

    def _evict(self) -> None:
        """Drop the least recently used entries until within the bound (caller holds the lock)."""
        while self._bytes > self.max_bytes and self._entries:
            name, size = self._entries.popitem(last=False)
            self._bytes -= size
            if self.directory is None:
                self._memory.pop(name, None)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.directory, name))


def scatter(data: bytes | memoryview, parts: list[Any], on_filled: OnFilled | None = None) -> None:
    """Copy ``data`` over the writable buffers ``parts``, one after another (``on_filled``: see
    :class:`Scatter`).

    Through numpy, which copies without the GIL; a memoryview slice assignment holds it, and the
    loader's other read threads (a ranged GET of ~10 MB returns every few ms per thread) waited
    behind every copy."""
    Scatter(parts, on_filled).write(data)


def report_filled(parts: list[Any], got: int, on_filled: OnFilled | None) -> None:
    """Call ``on_filled(i)``, in order, for every buffer of ``parts`` that the first ``got`` bytes of
    one read filled completely: what a backend that fills them all in one call (``preadv``) does."""
    if on_filled is None:
        return
    end = 0
    for i, part in enumerate(parts):
        end += memoryview(part).nbytes
        if end > got:
            return
        on_filled(i)


class Scatter:
    """Copies the successive pieces of one byte stream over writable buffers, one after another:
    a response body lands in its final places as it arrives, whatever the pieces' sizes.

    ``on_filled(i)`` is called, in order, as soon as buffer ``i`` is completely filled (a buffer of
    no bytes when the copy reaches it), from inside :meth:`write`: the array reader checks each
    chunk's crc32c right after its bytes were copied, while they are still in the CPU's cache,
    rather than in a second pass over the whole body (issue 32). What it raises propagates.

    :attr:`received` counts every byte written, also those past the buffers' end (dropped), so a
    caller compares it with :attr:`nbytes` to find a short or long body."""

    def __init__(self, parts: list[Any], on_filled: OnFilled | None = None):
        self._targets = [np.frombuffer(part, dtype=np.uint8) for part in parts]  # a writable part gives a writable view
        self._on_filled = on_filled
        self.nbytes = sum(target.nbytes for target in self._targets)
        self.received = 0
        self._index = 0  # the target being filled
        self._offset = 0  # bytes of it already filled

    def write(self, data: bytes | memoryview) -> None:
        source = np.frombuffer(data, dtype=np.uint8)
        self.received += source.nbytes
        at = 0
        while self._index < len(self._targets):
            target = self._targets[self._index]
            count = min(target.nbytes - self._offset, source.nbytes - at)
            if count:
                np.copyto(target[self._offset : self._offset + count], source[at : at + count])
                at += count
                self._offset += count
            if self._offset < target.nbytes:
                return  # this piece is used up: the rest of the target comes with the next
            if self._on_filled is not None:
                self._on_filled(self._index)
            self._index, self._offset = self._index + 1, 0


def _checked(entry: bytes) -> bytes | None:
    """An entry's data if its trailing crc32c matches, else None (a miss)."""
    if len(entry) < CRC_BYTES:
        return None
    data = entry[:-CRC_BYTES]
    return data if crc32c_bytes([data]) == entry[-CRC_BYTES:] else None


__all__ = ["OnFilled", "ReadCache", "Scatter", "report_filled", "scatter"]
