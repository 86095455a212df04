"""Zarr v3 shard files, written as a stream and read straight into the caller's buffer.

A feature array of a store shard is a Zarr v3 array with the ``sharding_indexed`` codec: each Zarr
shard file holds whole inner chunks back to back, then an index (``[offset, nbytes]`` as two
little-endian uint64 per inner chunk, then a crc32c of the index). Inner chunks are the raw
little-endian rows, optionally compressed (zstd, or blosc-zstd with byte shuffle), then a crc32c of
those bytes. zarr-python reads and writes exactly this, but its API costs what hidden states cannot
afford:

* **writing**: zarr builds a whole shard file in memory before writing it, so a file can hold only
  what fits in RAM, and a store had ~100 files per million tokens at H=4096. :class:`ArrayStream`
  appends each inner chunk to the file as it fills and writes the index last, so one file can hold a
  whole store shard (millions of tokens) with a few chunks of memory, and hashes as it writes.
* **reading**: zarr opens, reads and closes the file once per inner chunk, through an asyncio
  pipeline, and copies each chunk three times (bytes, decoded chunk, output array). The loader reads
  about one sample per request. :class:`ArrayReader` caches each file's index (files are immutable
  once committed) and reads a token range with one ``preadv`` straight into the destination (the
  loader's batch buffer), checking every chunk's crc32c on the way: one copy, one syscall per range.

The array metadata (``zarr.json``) is still written and parsed by zarr, so zarr-python and any other
Zarr v3 reader open these arrays unchanged (tested); :func:`layout_of` recognises the layouts this
module understands and anything else is read through zarr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy as np

from hsstore.errors import ShardCorruptError
from hsstore.location import StoreLocation

MISSING = 2**64 - 1  # an index entry for a chunk that was never written (zarr: fill value)
CRC_BYTES = 4
INDEX_ENTRY_BYTES = 16
# preadv takes at most IOV_MAX (1024 on Linux) buffers; a chunk needs up to four.
MAX_CHUNKS_PER_PREADV = 250


@dataclass(frozen=True)
class ChunkLayout:
    """What the fast paths need to know about one array: rows, chunking and the byte codec."""

    tail: tuple[int, ...]  # per-token shape (the token axis is first and the only chunked one)
    dtype: np.dtype[Any]
    chunk_tokens: int
    shard_tokens: int  # tokens per Zarr shard file (a multiple of chunk_tokens)
    compression: str  # "none", "zstd" or "blosc"
    level: int = 1

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.tail, dtype=np.int64)) * self.dtype.itemsize

    @property
    def chunk_bytes(self) -> int:
        """Uncompressed bytes of one inner chunk (the last chunk is stored padded to this)."""
        return self.chunk_tokens * self.row_bytes

    @property
    def chunks_per_shard(self) -> int:
        return self.shard_tokens // self.chunk_tokens

    def shard_key(self, shard: int) -> str:
        """The file of Zarr shard ``shard`` inside the array's folder (default key encoding, "/")."""
        return "/".join(["c", str(shard), *(["0"] * len(self.tail))])

    def zarr_compressors(self) -> list[Any]:
        """The bytes-to-bytes codecs to declare in ``zarr.json``: what this module writes."""
        from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

        checksum = Crc32cCodec()
        if self.compression == "none":
            return [checksum]
        if self.compression == "zstd":
            return [ZstdCodec(level=self.level), checksum]
        return [
            BloscCodec(cname="zstd", clevel=self.level, shuffle="shuffle", typesize=self.dtype.itemsize),
            checksum,
        ]

    def numcodecs_compressor(self) -> Any:
        """The numcodecs codec that encodes inner chunks exactly as zarr's declared codec does."""
        if self.compression == "zstd":
            from numcodecs import Zstd

            return Zstd(level=self.level, checksum=False)
        if self.compression == "blosc":
            from numcodecs import Blosc

            return Blosc(cname="zstd", clevel=self.level, shuffle=Blosc.SHUFFLE, blocksize=0, typesize=self.dtype.itemsize)
        return None


def layout_of(array: Any) -> ChunkLayout | None:
    """The layout of an open zarr array, or None if it is not one the fast paths handle.

    Handled: one ``sharding_indexed`` codec, index at the end (bytes + crc32c), inner chunks spanning
    every axis but the first, inner codecs bytes (little endian) [+ zstd | blosc] + crc32c, the
    default chunk key encoding with "/" (which ``ChunkLayout.shard_key`` reproduces).
    """
    from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ShardingCodec, ZstdCodec

    metadata = array.metadata
    codecs: tuple[Any, ...] = tuple(getattr(metadata, "codecs", ()))
    if len(codecs) != 1 or not isinstance(codecs[0], ShardingCodec):
        return None
    sharding = codecs[0]
    shard_shape = tuple(metadata.chunk_grid.chunk_shape)
    chunk_shape = tuple(sharding.chunk_shape)
    tail = tuple(array.shape[1:])
    if chunk_shape[1:] != tail or shard_shape[1:] != tail or shard_shape[0] % chunk_shape[0]:
        return None
    if str(sharding.index_location.value) != "end":
        return None
    index_codecs = sharding.index_codecs
    if len(index_codecs) != 2 or not isinstance(index_codecs[1], Crc32cCodec):
        return None
    inner = list(sharding.codecs)
    if not inner or not isinstance(inner[0], BytesCodec) or not isinstance(inner[-1], Crc32cCodec):
        return None
    dtype = np.dtype(array.dtype)
    endian = getattr(inner[0].endian, "value", inner[0].endian)
    if dtype.itemsize > 1 and endian not in ("little", None):
        return None
    middle = inner[1:-1]
    level = 1
    if not middle:
        compression = "none"
    elif len(middle) == 1 and isinstance(middle[0], ZstdCodec):
        compression, level = "zstd", int(middle[0].level)
    elif len(middle) == 1 and isinstance(middle[0], BloscCodec):
        compression, level = "blosc", int(middle[0].clevel)
    else:
        return None
    layout = ChunkLayout(
        tail=tail,
        dtype=dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype,
        chunk_tokens=chunk_shape[0],
        shard_tokens=shard_shape[0],
        compression=compression,
        level=level,
    )
    if metadata.encode_chunk_key((0,) * (1 + len(tail))) != layout.shard_key(0):
        return None
    return layout


# -- writing ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WrittenFile:
    path: str  # relative to the store root
    size: int
    sha256: str


class ArrayStream:
    """Appends rows of one array to its Zarr shard files, one inner chunk at a time.

    Rows are copied once, into the chunk being filled; a full chunk is compressed, checksummed and
    appended to its file by a background thread (one per array, so each file is written in order),
    at most ``max_in_flight`` chunks behind, and fed to the file's sha256 by a second thread (sha256
    runs at ~2 GB/s per core: in the writing thread it capped a stream near 1 GB/s). With ``shard_tokens=None`` the whole array
    goes into one file and the shard size is fixed at :meth:`close` (the index is written last).
    """

    def __init__(
        self,
        location: StoreLocation,
        array_dir: str,
        *,
        tail: tuple[int, ...],
        dtype: Any,
        chunk_tokens: int,
        shard_tokens: int | None,
        compression: str,
        level: int,
        max_in_flight: int = 4,
    ):
        self.location = location
        self.array_dir = array_dir
        self.tail = tuple(tail)
        self.dtype = np.dtype(dtype)
        self.chunk_tokens = chunk_tokens
        self.fixed_shard_tokens = shard_tokens
        self._layout = ChunkLayout(self.tail, self.dtype, chunk_tokens, shard_tokens or chunk_tokens, compression, level)
        self._compressor = self._layout.numcodecs_compressor()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hsstore-chunk")
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hsstore-hash")
        self._hash_slots = threading.Semaphore(max_in_flight)  # chunks written but not yet hashed
        self._hash_error: BaseException | None = None
        self._in_flight: deque[Future[None]] = deque()
        self.max_in_flight = max_in_flight
        self._free: deque[np.ndarray] = deque()  # written chunk buffers, ready for reuse
        self._chunk = self._new_chunk()
        self._filled = 0
        self.num_tokens = 0
        self._num_chunks = 0  # handed to the background thread
        # Owned by the background thread:
        self._file: Any = None
        self._file_shard = -1
        self._file_offset = 0
        self._file_index: list[tuple[int, int]] = []
        self._file_hash: Any = None
        self._written: list[WrittenFile] = []

    def _new_chunk(self) -> np.ndarray:
        # Written chunks come back from the background thread: a fresh buffer per chunk cost a page
        # fault per 4 KiB written, which made the extraction writer thread the bottleneck.
        try:
            return self._free.pop()
        except IndexError:
            return np.empty((self.chunk_tokens, *self.tail), dtype=self.dtype)

    def append(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows)
        if rows.shape[1:] != self.tail:
            raise ValueError(f"{self.array_dir}: rows of shape {rows.shape[1:]}, expected {self.tail}")
        done = 0
        while done < len(rows):
            take = min(len(rows) - done, self.chunk_tokens - self._filled)
            self._chunk[self._filled : self._filled + take] = rows[done : done + take]
            self._filled += take
            done += take
            if self._filled == self.chunk_tokens:
                self._submit(self._chunk)
                self._chunk = self._new_chunk()
                self._filled = 0
        self.num_tokens += len(rows)

    def _submit(self, chunk: np.ndarray) -> None:
        while len(self._in_flight) >= self.max_in_flight:
            self._in_flight.popleft().result()
        number = self._num_chunks
        self._num_chunks += 1
        self._in_flight.append(self._pool.submit(self._write_chunk, number, chunk))

    def close(self) -> tuple[ChunkLayout, list[WrittenFile]]:
        """Write the last (zero-padded) chunk and the open file's index. Returns the layout written
        (what ``zarr.json`` must declare, with the final tokens per Zarr shard) and the files
        written, with sizes and sha256."""
        if self._filled:
            self._chunk[self._filled :] = 0  # zarr stores edge chunks whole
            self._submit(self._chunk)
            self._filled = 0
        shard_tokens = self.fixed_shard_tokens or max(1, self._num_chunks) * self.chunk_tokens
        self._in_flight.append(self._pool.submit(self._finish_file, shard_tokens // self.chunk_tokens))
        self.wait()
        self._pool.shutdown()
        self._hasher.shutdown(wait=True)
        if self._hash_error is not None:
            raise self._hash_error
        return dataclasses.replace(self._layout, shard_tokens=shard_tokens), list(self._written)

    def wait(self) -> None:
        """Wait for the chunks in flight; re-raises the first error."""
        errors = []
        while self._in_flight:
            error = self._in_flight.popleft().exception()
            if error is not None:
                errors.append(error)
        if errors:
            raise errors[0]

    def abort(self) -> None:
        for future in self._in_flight:
            future.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._hasher.shutdown(wait=True, cancel_futures=True)
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()

    # -- the background thread ---------------------------------------------------------------

    def _write_chunk(self, number: int, chunk: np.ndarray) -> None:
        chunks_per_shard = (self.fixed_shard_tokens or 0) // self.chunk_tokens
        shard = number // chunks_per_shard if chunks_per_shard else 0
        if shard != self._file_shard:
            self._finish_file(chunks_per_shard)
            self._open_file(shard)
        # google_crc32c takes numpy arrays and bytes, not memoryviews.
        payload: Any = chunk.reshape(-1).view(np.uint8)
        if self._compressor is not None:
            payload = self._compressor.encode(payload)
        crc = int(google_crc32c.value(payload)).to_bytes(CRC_BYTES, "little")
        self._file.write(payload)
        self._file.write(crc)
        nbytes = len(payload) + CRC_BYTES
        self._file_index.append((self._file_offset, nbytes))
        self._file_offset += nbytes
        self._hash_later(self._file_hash, (payload, crc), recycle=chunk)

    def _hash_later(
        self, file_hash: Any, parts: tuple[Any, ...], *, recycle: np.ndarray | None = None, done: tuple[str, int] | None = None
    ) -> None:
        """Feed ``parts`` to ``file_hash`` on the hashing thread (in order, like the file); then
        give the chunk buffer back, or record the finished file ``done = (path, size)``."""
        self._hash_slots.acquire()  # back-pressure: never more than max_in_flight chunks unhashed

        def work() -> None:
            try:
                for part in parts:
                    file_hash.update(part)
                if done is not None:
                    self._written.append(WrittenFile(done[0], done[1], file_hash.hexdigest()))
            except BaseException as err:  # noqa: BLE001 - raised by close()
                self._hash_error = self._hash_error or err
            finally:
                self._hash_slots.release()
                if recycle is not None:
                    self._free.append(recycle)  # written and hashed: the buffer may be refilled

        self._hasher.submit(work)

    def _open_file(self, shard: int) -> None:
        relative = f"{self.array_dir}/{self._layout.shard_key(shard)}"
        self.location.makedirs(relative.rsplit("/", 1)[0])
        self._file = self.location.fs.open(self.location.path(relative), "wb")
        self._file_path = relative
        self._file_shard = shard
        self._file_offset = 0
        self._file_index = []
        self._file_hash = hashlib.sha256()

    def _finish_file(self, chunks_per_shard: int) -> None:
        """Append the index of the open file (if any) and close it."""
        if self._file is None:
            return
        entries = np.full((max(chunks_per_shard, len(self._file_index)), 2), MISSING, dtype="<u8")
        if self._file_index:
            entries[: len(self._file_index)] = self._file_index
        index = entries.tobytes()
        tail = index + int(google_crc32c.value(index)).to_bytes(CRC_BYTES, "little")
        self._file.write(tail)
        self._file.close()
        self._file = None
        self._hash_later(self._file_hash, (tail,), done=(self._file_path, self._file_offset + len(tail)))


# -- reading ------------------------------------------------------------------------------------


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

    def __init__(self, location: StoreLocation, array_dir: str, layout: ChunkLayout, num_tokens: int):
        self.location = location
        self.array_dir = array_dir
        self.layout = layout
        self.num_tokens = num_tokens
        self._indexes: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self._decompressor = layout.numcodecs_compressor()

    def _path(self, shard: int) -> str:
        return self.location.path(f"{self.array_dir}/{self.layout.shard_key(shard)}")

    def _corrupt(self, shard: int, detail: str) -> ShardCorruptError:
        return ShardCorruptError(f"{self._path(shard)}: {detail} (the file is damaged; run hsstore verify)")

    def _read_bytes(self, shard: int, offset: int, nbytes: int, into: list[Any] | None = None) -> bytes | None:
        """``nbytes`` at ``offset`` of a shard file: returned, or scattered over ``into``."""
        path = self._path(shard)
        if self.location.is_local:
            fd = os.open(path, os.O_RDONLY)
            try:
                if into is None:
                    data = os.pread(fd, nbytes, offset)
                    got = len(data)
                else:
                    data, got = None, os.preadv(fd, into, offset)
            finally:
                os.close(fd)
        else:
            data = bytes(self.location.fs.cat_file(path, start=offset, end=offset + nbytes))
            got = len(data)
            if into is not None:
                view, at = memoryview(data), 0
                for part in into:
                    part[:] = view[at : at + len(part)]
                    at += len(part)
                data = None
        if got != nbytes:
            raise self._corrupt(shard, f"{got} bytes at offset {offset}, expected {nbytes} (truncated?)")
        return data

    def _index(self, shard: int) -> np.ndarray:
        with self._lock:
            index = self._indexes.get(shard)
        if index is not None:
            return index
        count = self.layout.chunks_per_shard
        nbytes = count * INDEX_ENTRY_BYTES + CRC_BYTES
        if self.location.is_local:
            try:
                size = os.stat(self._path(shard)).st_size
            except FileNotFoundError:
                raise self._corrupt(shard, "missing") from None
        else:
            size = int(self.location.fs.size(self._path(shard)))
        if size < nbytes:
            raise self._corrupt(shard, f"{size} bytes, too short for an index of {count} chunks")
        data = self._read_bytes(shard, size - nbytes, nbytes)
        assert data is not None
        if int(google_crc32c.value(data[:-CRC_BYTES])).to_bytes(CRC_BYTES, "little") != data[-CRC_BYTES:]:
            raise self._corrupt(shard, "the shard index fails its crc32c")
        index = np.frombuffer(data[:-CRC_BYTES], dtype="<u8").reshape(count, 2)
        present = index[:, 0] != MISSING
        if np.any(index[present, 0] + index[present, 1] > size - nbytes):
            raise self._corrupt(shard, "the shard index points past the end of the chunks")
        with self._lock:
            self._indexes[shard] = index
        return index

    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[start, stop)``, into ``out`` (C-contiguous, shape ``[stop-start, *tail]``) if given."""
        layout = self.layout
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"{self.array_dir}: rows [{start}, {stop}) outside [0, {self.num_tokens})")
        shape = (stop - start, *layout.tail)
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

    def _first_row(self, shard: int, chunk: int) -> int:
        """The array row where ``chunk`` of Zarr shard ``shard`` starts."""
        return shard * self.layout.shard_tokens + chunk * self.layout.chunk_tokens

    def _clip(self, shard: int, chunk: int, start: int, stop: int) -> tuple[int, int]:
        """The rows of ``chunk`` (of Zarr shard ``shard``) that are inside ``[start, stop)``."""
        first_row = self._first_row(shard, chunk)
        return max(start, first_row), min(stop, first_row + self.layout.chunk_tokens)

    def _flush_run(
        self, shard: int, run: list[int], index: np.ndarray, start: int, stop: int, dest: np.ndarray, dest_start: int
    ) -> None:
        """Read chunks ``run`` (contiguous in the file) and put their rows inside the range in place."""
        if not run:
            return
        layout = self.layout
        row = layout.row_bytes
        offset = int(index[run[0], 0])
        nbytes = int(index[run[-1], 0]) + int(index[run[-1], 1]) - offset
        if layout.compression == "none":
            # Scatter straight into the destination: the parts of the edge chunks outside the range
            # and the crc32c trailers land in scratch, so every byte is checked and copied once.
            scratch = _SCRATCH.get(2 * layout.chunk_bytes + CRC_BYTES * len(run))
            used = 0
            buffers: list[Any] = []
            pieces: list[list[Any]] = []  # per chunk: its data parts in order, then its crc
            for chunk in run:
                lo, hi = self._clip(shard, chunk, start, stop)
                head = (lo - self._first_row(shard, chunk)) * row
                body = dest[(lo - dest_start) * row : (hi - dest_start) * row]
                tail = layout.chunk_bytes - head - len(body)
                parts: list[Any] = []
                if head:
                    parts.append(scratch[used : used + head])
                    used += head
                parts.append(body)
                if tail:
                    parts.append(scratch[used : used + tail])
                    used += tail
                crc = scratch[used : used + CRC_BYTES]
                used += CRC_BYTES
                buffers.extend(parts)
                buffers.append(crc)
                pieces.append([*parts, crc])
            self._read_bytes(shard, offset, nbytes, into=buffers)
            for chunk, parts in zip(run, pieces, strict=True):
                computed = 0
                for part in parts[:-1]:
                    computed = google_crc32c.extend(computed, part)
                if int(computed).to_bytes(CRC_BYTES, "little") != parts[-1].tobytes():
                    raise self._corrupt(shard, f"chunk {chunk} fails its crc32c")
            return
        data = self._read_bytes(shard, offset, nbytes)
        assert data is not None
        view = np.frombuffer(data, dtype=np.uint8)
        for chunk in run:
            at = int(index[chunk, 0]) - offset
            size = int(index[chunk, 1])
            payload, stored = view[at : at + size - CRC_BYTES], view[at + size - CRC_BYTES : at + size]
            if int(google_crc32c.value(payload)).to_bytes(CRC_BYTES, "little") != stored.tobytes():
                raise self._corrupt(shard, f"chunk {chunk} fails its crc32c")
            lo, hi = self._clip(shard, chunk, start, stop)
            chunk_first = self._first_row(shard, chunk)
            target = dest[(lo - dest_start) * row : (hi - dest_start) * row]
            try:
                if hi - lo == layout.chunk_tokens:
                    self._decompressor.decode(payload, out=target)
                else:
                    whole = _SCRATCH.get(layout.chunk_bytes)
                    self._decompressor.decode(payload, out=whole)
                    target[:] = whole[(lo - chunk_first) * row : (hi - chunk_first) * row]
            except Exception as err:  # numcodecs raises RuntimeError/ValueError on bad frames
                raise self._corrupt(shard, f"chunk {chunk} does not decompress ({err})") from err
