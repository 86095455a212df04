"""Reading token ranges of one feature array of a committed store shard, straight into the
caller's buffer.

zarr-python opens, reads and closes a Zarr shard file once per inner chunk, through an asyncio
pipeline, and copies each chunk three times (bytes, decoded chunk, output array); the loader reads
about one sample per request. :class:`ArrayReader` caches each file's index (files are immutable
once committed) and reads a token range with one ``preadv`` straight into the destination (the
loader's batch buffer), checking every chunk's crc32c on the way: one copy, one syscall per range.
Where a read is an HTTP response that arrives whole (``StoreLocation.bodies_arrive_whole``), each
chunk is checked in the body and then copied into place: still one copy.
Layouts it does not know (:func:`hsstore.format.chunk_layout.layout_of` says None) are read through
zarr-python by the store instead.

Errors: damage found in the files (short files, failed crc32c, an index pointing past the data, a
frame that does not decompress) raises :class:`ShardCorruptError`; I/O errors are ``OSError`` as the
filesystem raised them; anything else is a bug and propagates as it is.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from hsstore.checksum import crc32c_bytes
from hsstore.errors import ShardCorruptError
from hsstore.format.chunk_layout import CRC_BYTES, MISSING, ChunkLayout
from hsstore.read_cache import OnFilled, ReadCache, scatter
from hsstore.storage.base import StoreLocation

# preadv takes at most IOV_MAX (1024 on Linux) buffers; a chunk needs up to four.
MAX_CHUNKS_PER_PREADV = 250


def copy_rows(dest: np.ndarray, source: np.ndarray) -> None:
    """Bytes of checked chunks into place (numpy copies without the GIL); a function of its own so
    that ``benchmarks/object_store/profile_reads.py`` times it as the copy phase."""
    np.copyto(dest, source)


class _Scratch(threading.local):
    """Per-thread buffers for the parts of edge chunks outside the requested range."""

    def __init__(self) -> None:
        self.buffer = np.empty(0, dtype=np.uint8)

    def get(self, nbytes: int) -> np.ndarray:
        if len(self.buffer) < nbytes:
            self.buffer = np.empty(max(nbytes, 2 * len(self.buffer)), dtype=np.uint8)
        return self.buffer[:nbytes]


_SCRATCH = _Scratch()


class ArrayReader:
    """Reads token ranges of one array of one (immutable, committed) store shard. Thread-safe."""

    def __init__(
        self,
        location: StoreLocation,
        array_dir: str,
        layout: ChunkLayout,
        num_tokens: int,
        *,
        files: dict[str, tuple[int, str]] | None = None,
        cache: ReadCache | None = None,
    ):
        """``files``: (size, sha256) by store-relative path, from the manifest: an object store's
        read then needs no HEAD for a file's size, and ``cache`` (used where the backend's
        ``uses_read_cache`` says it pays) keys ranges by content."""
        self.location = location
        self.array_dir = array_dir
        self.layout = layout
        self.num_tokens = num_tokens
        self.files = files or {}
        self.cache = cache if location.uses_read_cache else None
        self._indexes: dict[int, np.ndarray] = {}
        self._opening: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()
        self._decompressor = layout.numcodecs_compressor()

    def _relative(self, zarr_shard: int) -> str:
        return f"{self.array_dir}/{self.layout.shard_key(zarr_shard)}"

    def _path(self, zarr_shard: int) -> str:
        return self.location.path(self._relative(zarr_shard))

    def _fetch(
        self, zarr_shard: int, offset: int, nbytes: int, into: list[Any] | None = None, on_filled: OnFilled | None = None
    ) -> bytes | memoryview | None:
        """One ranged read through the cache. None: a cache hit was read straight into ``into``
        (``on_filled`` called as by :meth:`_read_bytes`)."""
        entry = self.files.get(self._relative(zarr_shard))
        key = None
        if self.cache is not None and entry is not None:
            key = self.cache.key(entry[1], offset, nbytes)
            if into is not None:
                if self.cache.read_into(key, into, on_filled):
                    return None
            else:
                cached = self.cache.get(key)
                if cached is not None and len(cached) == nbytes:
                    return cached
        data = self.location.read_range(self._relative(zarr_shard), offset, offset + nbytes)
        if key is not None and self.cache is not None and len(data) == nbytes:
            self.cache.put(key, data)
        return data

    def _corrupt(self, zarr_shard: int, detail: str) -> ShardCorruptError:
        return ShardCorruptError(f"{self._path(zarr_shard)}: {detail} (the file is damaged; run hsstore verify)")

    def _read_bytes(
        self, shard: int, offset: int, nbytes: int, into: list[Any] | None = None, on_filled: OnFilled | None = None
    ) -> bytes | memoryview | None:
        """``nbytes`` at ``offset`` of a shard file: returned, or scattered over ``into`` with
        ``on_filled(i)`` called as each buffer of it is filled (see
        :meth:`~hsstore.storage.StoreLocation.read_range_into`); a short read raises after it."""
        data: bytes | memoryview | None
        if self.cache is None:  # straight from the backend (locally: one preadv into the buffers)
            if into is None:
                data = self.location.read_range(self._relative(shard), offset, offset + nbytes)
                got = len(data)
            else:
                data, got = None, self.location.read_range_into(self._relative(shard), offset, into, on_filled)
        else:
            data = self._fetch(shard, offset, nbytes, into, on_filled)
            got = nbytes if data is None else len(data)
            if into is not None and data is not None and got == nbytes:  # a short body is damage, below
                scatter(data, into, on_filled)
                data = None
        if got != nbytes:
            raise self._corrupt(shard, f"{got} bytes at offset {offset}, expected {nbytes} (truncated?)")
        return data

    def _index(self, shard: int) -> np.ndarray:
        with self._lock:
            index = self._indexes.get(shard)
            opening = self._opening.setdefault(shard, threading.Lock())
        if index is not None:
            return index
        with opening:  # concurrent first reads of a file fetch its index once
            with self._lock:
                index = self._indexes.get(shard)
            return index if index is not None else self._read_index(shard)

    def _read_index(self, shard: int) -> np.ndarray:
        count = self.layout.chunks_per_shard
        nbytes = self.layout.index_bytes
        recorded = self.files.get(self._relative(shard))  # the manifest's: saves a HEAD per file
        try:
            size = self.location.file_size(self._relative(shard), recorded[0] if recorded else None)
        except FileNotFoundError:
            raise self._corrupt(shard, "missing") from None
        if size < nbytes:
            raise self._corrupt(shard, f"{size} bytes, too short for an index of {count} chunks")
        data = self._read_bytes(shard, size - nbytes, nbytes)
        assert data is not None
        if crc32c_bytes([memoryview(data)[:-CRC_BYTES]]) != data[-CRC_BYTES:]:
            raise self._corrupt(shard, "the shard index fails its crc32c")
        index = np.frombuffer(data[:-CRC_BYTES], dtype="<u8").reshape(count, 2)
        present = index[:, 0] != MISSING
        if np.any(index[present, 0] + index[present, 1] > size - nbytes):
            raise self._corrupt(shard, "the shard index points past the end of the chunks")
        with self._lock:
            self._indexes[shard] = index
        return index

    def warm(self) -> None:
        """Fetch the first Zarr shard file's index now: a round trip a first read would wait for."""
        if self.num_tokens:
            self._index(0)

    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[start, stop)``, into ``out`` (C-contiguous, shape ``[stop-start, *row_shape]``) if given."""
        layout = self.layout
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"{self.array_dir}: rows [{start}, {stop}) outside [0, {self.num_tokens})")
        shape = (stop - start, *layout.row_shape)
        if out is None:
            out = np.empty(shape, dtype=layout.dtype)
        elif out.shape != shape or out.dtype != layout.dtype or not out.flags.c_contiguous:
            raise ValueError(
                f"{self.array_dir}: out must be C-contiguous {layout.dtype} of shape {shape}, "
                f"got {out.dtype} {out.shape}"
            )
        dest = out.reshape(-1).view(np.uint8)
        pos = start
        while pos < stop:
            shard = pos // layout.shard_tokens
            shard_stop = min(stop, (shard + 1) * layout.shard_tokens)
            self._read_shard(shard, pos, shard_stop, dest, start)
            pos = shard_stop
        return out

    def _read_shard(self, shard: int, start: int, stop: int, dest: np.ndarray, dest_start: int) -> None:
        """Rows ``[start, stop)`` (all in Zarr shard ``shard``) into ``dest`` (bytes from ``dest_start``)."""
        layout = self.layout
        index = self._index(shard)
        base = shard * layout.shard_tokens
        first = (start - base) // layout.chunk_tokens
        last = (stop - 1 - base) // layout.chunk_tokens
        run: list[int] = []
        for chunk in range(first, last + 1):
            offset, nbytes = int(index[chunk, 0]), int(index[chunk, 1])
            if offset == MISSING:
                self._flush_run(shard, run, index, start, stop, dest, dest_start)
                run = []
                lo, hi = self._clip(shard, chunk, start, stop)
                dest[(lo - dest_start) * layout.row_bytes : (hi - dest_start) * layout.row_bytes] = 0
                continue
            if run and (
                len(run) >= MAX_CHUNKS_PER_PREADV
                or int(index[run[-1], 0]) + int(index[run[-1], 1]) != offset
            ):
                self._flush_run(shard, run, index, start, stop, dest, dest_start)
                run = []
            if layout.compression == "none" and nbytes != layout.chunk_bytes + CRC_BYTES:
                raise self._corrupt(shard, f"chunk {chunk} is {nbytes} bytes, expected {layout.chunk_bytes + CRC_BYTES}")
            run.append(chunk)
        self._flush_run(shard, run, index, start, stop, dest, dest_start)

    def _clip(self, shard: int, chunk: int, start: int, stop: int) -> tuple[int, int]:
        """The rows of ``chunk`` (of Zarr shard ``shard``) that are inside ``[start, stop)``."""
        first_row = self.layout.first_row(shard, chunk)
        return max(start, first_row), min(stop, first_row + self.layout.chunk_tokens)

    def _flush_run(
        self, shard: int, run: list[int], index: np.ndarray, start: int, stop: int, dest: np.ndarray, dest_start: int
    ) -> None:
        """Read chunks ``run`` (contiguous in the file) and put their rows inside the range in place.

        Uncompressed chunks are read straight into place (:meth:`_read_run_into`) unless the read
        is a response body that arrives whole (``StoreLocation.bodies_arrive_whole``, no cache):
        then, as compressed chunks are, each is checked in the body and its rows copied from it
        while they are still in the CPU's cache. Against scattering such a body over the batch and
        checking the copy: on the VM 5-14% less CPU per GB through ``read_token_range`` (15-17% for
        the copy and checks alone), and on the 16-core host the loader read 1.05x the tokens/s
        from S3 at 20 ms (benchmarks/LOG.md, issue 32)."""
        if not run:
            return
        layout = self.layout
        row = layout.row_bytes
        offset = int(index[run[0], 0])
        nbytes = int(index[run[-1], 0]) + int(index[run[-1], 1]) - offset
        if layout.compression == "none" and not (self.cache is None and self.location.bodies_arrive_whole):
            self._read_run_into(shard, run, start, stop, dest, dest_start, offset, nbytes)
            return
        data = self._read_bytes(shard, offset, nbytes)
        assert data is not None
        view = np.frombuffer(data, dtype=np.uint8)
        for chunk in run:
            at = int(index[chunk, 0]) - offset
            size = int(index[chunk, 1])
            payload = view[at : at + size - CRC_BYTES]
            self._check_chunk(shard, chunk, [payload, view[at + size - CRC_BYTES : at + size]])
            lo, hi = self._clip(shard, chunk, start, stop)
            chunk_first = layout.first_row(shard, chunk)
            target = dest[(lo - dest_start) * row : (hi - dest_start) * row]
            if layout.compression == "none":
                copy_rows(target, payload[(lo - chunk_first) * row : (hi - chunk_first) * row])
                continue
            try:
                if hi - lo == layout.chunk_tokens:
                    self._decompressor.decode(payload, out=target)
                else:
                    whole = _SCRATCH.get(layout.chunk_bytes)
                    self._decompressor.decode(payload, out=whole)
                    target[:] = whole[(lo - chunk_first) * row : (hi - chunk_first) * row]
            except (RuntimeError, ValueError) as err:  # what numcodecs raises on a bad frame
                raise self._corrupt(shard, f"chunk {chunk} does not decompress ({err})") from err

    def _read_run_into(
        self, shard: int, run: list[int], start: int, stop: int, dest: np.ndarray, dest_start: int, offset: int, nbytes: int
    ) -> None:
        """Uncompressed chunks ``run`` (``nbytes`` at ``offset``) read straight into ``dest``."""
        layout = self.layout
        row = layout.row_bytes
        # Scatter straight into the destination: the parts of the edge chunks outside the range
        # and the crc32c trailers land in scratch, so every byte is checked and copied once.
        scratch = _SCRATCH.get(2 * layout.chunk_bytes + CRC_BYTES * len(run))
        used = 0
        buffers: list[Any] = []
        pieces: list[list[Any]] = []  # per chunk: its data parts in order, then its crc
        last_buffer: list[int] = []  # per chunk: the index in buffers of its crc, its last buffer
        for chunk in run:
            lo, hi = self._clip(shard, chunk, start, stop)
            head = (lo - layout.first_row(shard, chunk)) * row
            body = dest[(lo - dest_start) * row : (hi - dest_start) * row]
            after = layout.chunk_bytes - head - len(body)
            parts: list[Any] = []
            if head:
                parts.append(scratch[used : used + head])
                used += head
            parts.append(body)
            if after:
                parts.append(scratch[used : used + after])
                used += after
            crc = scratch[used : used + CRC_BYTES]
            used += CRC_BYTES
            buffers.extend(parts)
            buffers.append(crc)
            pieces.append([*parts, crc])
            last_buffer.append(len(buffers) - 1)
        checked = 0

        def on_filled(i: int) -> None:
            # A chunk is checked as soon as its last buffer lands, while its bytes are still in the
            # CPU's cache, not in a pass over the run after the read (issue 32: 1.4-1.6x in a
            # micro-benchmark, 1.02x for the loader on 16 cores).
            nonlocal checked
            if checked < len(run) and i == last_buffer[checked]:
                self._check_chunk(shard, run[checked], pieces[checked])
                checked += 1

        self._read_bytes(shard, offset, nbytes, into=buffers, on_filled=on_filled)  # a short read raises
        # Every byte landed (the length says so): check what the backend did not report, so that
        # no chunk goes unchecked whatever a backend does with on_filled.
        for chunk, parts in zip(run[checked:], pieces[checked:], strict=True):
            self._check_chunk(shard, chunk, parts)

    def _check_chunk(self, shard: int, chunk: int, parts: list[Any]) -> None:
        """Raise if the chunk's data ``parts[:-1]`` fail the crc32c stored in ``parts[-1]``."""
        if crc32c_bytes(parts[:-1]) != parts[-1].tobytes():
            raise self._corrupt(shard, f"chunk {chunk} fails its crc32c")
