"""Writing one feature array of a store shard as Zarr shard files, one inner chunk at a time.

zarr-python builds a whole Zarr shard file in memory before writing it, so a file could hold only
what fits in RAM, and a store had ~100 files per million tokens at H=4096. :class:`ArrayWriter`
appends each inner chunk to its file as it fills and writes the file's index last, so one file can
hold a whole store shard (millions of tokens) with a few chunks of memory, and hashes as it writes.
The bytes are exactly what zarr-python writes and reads (:mod:`hsstore.format.chunk_layout`; tested
against golden stores); the array's ``zarr.json`` is written by zarr-python itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from hsstore.checksum import crc32c_bytes
from hsstore.format.chunk_layout import CRC_BYTES, MISSING, ChunkLayout
from hsstore.storage.base import StoreLocation


@dataclass(frozen=True)
class WrittenFile:
    path: str  # relative to the store root
    size: int
    sha256: str


class ArrayWriter:
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
        row_shape: tuple[int, ...],
        dtype: Any,
        chunk_tokens: int,
        shard_tokens: int | None,
        compression: str,
        level: int,
        max_in_flight: int = 4,
    ):
        self.location = location
        self.array_dir = array_dir
        self.row_shape = tuple(row_shape)
        self.dtype = np.dtype(dtype)
        self.chunk_tokens = chunk_tokens
        self.fixed_shard_tokens = shard_tokens
        self._layout = ChunkLayout(self.row_shape, self.dtype, chunk_tokens, shard_tokens or chunk_tokens, compression, level)
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
        self._file_shard = -1  # the Zarr shard file open for writing
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
            return np.empty((self.chunk_tokens, *self.row_shape), dtype=self.dtype)

    def append(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows)
        if rows.shape[1:] != self.row_shape:
            raise ValueError(f"{self.array_dir}: rows of shape {rows.shape[1:]}, expected {self.row_shape}")
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
        zarr_shard = number // chunks_per_shard if chunks_per_shard else 0
        if zarr_shard != self._file_shard:
            self._finish_file(chunks_per_shard)
            self._open_file(zarr_shard)
        payload: Any = chunk.reshape(-1).view(np.uint8)
        if self._compressor is not None:
            payload = self._compressor.encode(payload)
        crc = crc32c_bytes([payload])
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

    def _open_file(self, zarr_shard: int) -> None:
        relative = f"{self.array_dir}/{self._layout.shard_key(zarr_shard)}"
        self.location.makedirs(relative.rsplit("/", 1)[0])
        self._file = self.location.open_write(relative)
        self._file_path = relative
        self._file_shard = zarr_shard
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
        index_block = index + crc32c_bytes([index])
        self._file.write(index_block)
        self._file.close()
        self._file = None
        self._hash_later(self._file_hash, (index_block,), done=(self._file_path, self._file_offset + len(index_block)))
