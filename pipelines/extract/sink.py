"""Overlap writing with compute: batches' features go to the shard on a background thread.

The GPU must not wait for the host, nor the host do work the GPU does better. After each forward,
:meth:`ShardSink.submit` encodes the packed features *on the device* (``hsstore.format.codecs.
encode_torch``: bf16 bits, or fp8 bits and power-of-two scales, the same bits the CPU encoder gives)
and copies the encoded arrays to the host asynchronously on a side CUDA stream (the main stream goes
straight on to the next forward), *paced*: in :data:`COPY_PIECES` pieces, one issued as each of the
capture's pace layers of the next forward starts (:meth:`ShardSink.pace`). One 20 ms burst of
device-to-host DMA (a 32k-token bf16 batch of an 8B target) slows the eager forward it overlaps by
~14 ms (1.4%): the link busy with the copy delays the forward's kernel launches, not its kernels (a
CUDA-graph replay of the same forward is not slowed); four pieces spread over the forward cost
nothing measurable (benchmarks/investigations/profile_copy_contention.py, benchmarks/LOG.md). A batch with no next
forward in its unit is copied at once when the unit's forwards end (:meth:`flush_copies`).
The copies land in a :class:`HostBufferPool`: pinned
buffers allocated once per worker, as many as the queue can hold, so no batch allocates or pins
memory. A writer thread waits for a batch's copy, hands the encoded arrays to
:meth:`hsstore.ShardWriter.add_encoded_samples` (which appends each array from its own thread) and
gives the buffers back. The queue is bounded, so a slow store applies back-pressure instead of
filling host memory.

On the CPU the features are already host tensors: the writer thread encodes them (the same
function), overlapping encoding and writes with the next forward.

``write_seconds`` is the writer thread's busy time: encoding (CPU), checks and appends, not the
time it waits for a copy (on a GPU that is waiting for the forward itself). The ShardWriter is only
ever touched by the writer thread (it is not thread-safe).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hsstore import FeatureSpec, ShardRecord, ShardWriter
from hsstore.errors import StoreWriteError
from hsstore.format.codecs import encode_torch
from pipelines.extract.units import SampleRow

logger = logging.getLogger(__name__)

_STOP = object()
# Pieces a batch's device-to-host copy is cut into, one per pace layer of the next forward
# (capture.pace_layers). Measured on an H200 with the Qwen3-8B shape: one burst +1.4% on the
# forward, 4, 12 or 36 pieces within +-0.5% of none.
COPY_PIECES = 4
# Stored dtypes as torch holds them (bf16 bits travel as int16: torch has no uint16 arithmetic).
_TORCH_DTYPE = {
    "uint16": torch.int16,
    "uint8": torch.uint8,
    "float32": torch.float32,
    "int32": torch.int32,
}


class HostBufferPool:
    """Host buffers that batches' encoded features are copied into, allocated once per worker.

    ``num_buffers`` sets of one buffer per stored array, each of ``max_tokens`` tokens (a batch holds
    at most ``token_budget`` real tokens), pinned on CUDA so that copies are asynchronous DMA.
    Allocated on first use; :meth:`acquire` blocks while every set is in use (back-pressure). A
    batch larger than ``max_tokens`` (a single sample over the budget, which the recipe forbids)
    gets a one-off buffer rather than an error.
    """

    def __init__(
        self, features: Sequence[FeatureSpec], max_tokens: int, num_buffers: int, *, pin: bool
    ):
        self.arrays = [
            (name, tuple(tail), _TORCH_DTYPE[dtype])
            for spec in features
            for name, tail, dtype in spec.stored_arrays()
        ]
        self.max_tokens = max_tokens
        self.num_buffers = num_buffers
        self.pin = pin
        self._free: queue.Queue[dict[str, torch.Tensor]] = queue.Queue()
        self._allocated = 0
        self._lock = threading.Lock()

    @property
    def bytes_per_set(self) -> int:
        return sum(
            self.max_tokens
            * int(np.prod(tail, dtype=np.int64))
            * torch.empty((), dtype=dtype).element_size()
            for _, tail, dtype in self.arrays
        )

    def _allocate(self, num_tokens: int) -> dict[str, torch.Tensor]:
        return {
            name: torch.empty((num_tokens, *tail), dtype=dtype, pin_memory=self.pin)
            for name, tail, dtype in self.arrays
        }

    def preallocate(self) -> None:
        """Allocate (and pin) every set now, e.g. while a worker starts, rather than in its first
        batches (pinning a GiB takes a fraction of a second)."""
        with self._lock:
            while self._allocated < self.num_buffers and self.max_tokens:
                self._allocated += 1
                self._free.put(self._allocate(self.max_tokens))

    def acquire(self, num_tokens: int, alive: Any = None) -> dict[str, torch.Tensor]:
        """A set of buffers of at least ``num_tokens`` tokens. ``alive()`` is called while waiting
        (it raises to stop waiting, e.g. when the writer thread failed)."""
        if num_tokens > self.max_tokens:
            if self.max_tokens:
                logger.warning(
                    "a batch of %d tokens is over the pool's %d: a one-off buffer",
                    num_tokens,
                    self.max_tokens,
                )
            return self._allocate(num_tokens)
        with self._lock:
            if self._free.empty() and self._allocated < self.num_buffers:
                self._allocated += 1
                return self._allocate(self.max_tokens)
        while True:
            try:
                return self._free.get(timeout=0.5)
            except queue.Empty:
                if alive is not None:
                    alive()

    def release(self, buffers: dict[str, torch.Tensor]) -> None:
        first = next(iter(buffers.values()), None)
        if (
            first is not None and self.max_tokens and first.shape[0] == self.max_tokens
        ):  # one-offs are dropped
            self._free.put(buffers)


@dataclass
class _PendingCopy:
    """A batch's encoded arrays on the device, waiting for their pieces to be copied to the host.

    ``encoded`` keeps the device tensors alive until every piece is on the copy stream (the
    caching allocator must not hand their memory to a forward before the copy has read it)."""

    encoded: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    num_tokens: int
    ready: torch.cuda.Event  # recorded after the forward and the encode
    done: torch.cuda.Event  # recorded on the copy stream after the last piece
    enqueued: threading.Event = field(default_factory=threading.Event)  # every piece issued
    next_piece: int = 0


class ShardSink:
    """Feeds one ShardWriter from a writer thread; ``finish()`` returns the shard's record."""

    def __init__(
        self,
        writer: ShardWriter,
        device: torch.device,
        *,
        pool: HostBufferPool | None = None,
        max_pending_batches: int = 3,
        copy_pieces: int = COPY_PIECES,
    ):
        self.writer = writer
        self.copy_pieces = max(1, copy_pieces)
        self._copies: deque[_PendingCopy] = deque()  # issued piece by piece by pace()
        self.device = device
        self.features = list(writer.features.values())
        self._cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device=device) if self._cuda else None
        if self._cuda and pool is None:
            pool = HostBufferPool(self.features, 0, 0, pin=True)  # no pool: a buffer per batch
        self.pool = pool
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending_batches)
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"shard-sink-{writer.shard_id}", daemon=True
        )
        self._thread.start()
        self.write_seconds = 0.0  # busy: encoding (CPU), checks, appends
        self.wait_seconds = 0.0  # waiting for a batch's device-to-host copy
        # The forwards' thread waiting for a free set of host buffers: back-pressure from the
        # writer (every set queued or being written), time the GPU may run dry.
        self.pool_wait_seconds = 0.0
        # Wall clock (time.time()) when the writer saw the latest batch's features on the host: on
        # a GPU, the end of that batch's forward and copy (the host launches ~0.5 s ahead of the
        # GPU, so the forward loop's own end says little about when the GPU was done).
        self.landed_at = 0.0

    def submit(self, rows: Sequence[SampleRow], features: dict[str, torch.Tensor]) -> None:
        """Queue one batch: ``rows`` in packed order, ``features[name]`` ``[sum(T_i), ...]``."""
        self._raise_if_failed()
        num_tokens = sum(len(row.input_ids) for row in rows)
        if not self._cuda:
            self._put(
                (list(rows), num_tokens, {n: t.detach() for n, t in features.items()}, None, None)
            )
            return
        assert self._copy_stream is not None and self.pool is not None
        # A batch whose copy no pace point took (a forward without the capture's hooks, e.g. a
        # caller that never calls pace()) is copied now rather than held: at most one waits.
        self.flush_copies()
        # Encoded on the compute stream, right after the forward: a few elementwise kernels.
        encoded: dict[str, torch.Tensor] = {}
        for spec in self.features:
            encoded.update(encode_torch(spec, features[spec.name]))
        waited = time.perf_counter()
        buffers = self.pool.acquire(num_tokens, self._raise_if_failed)
        self.pool_wait_seconds += time.perf_counter() - waited
        try:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            copy = _PendingCopy(encoded, buffers, num_tokens, ready, torch.cuda.Event())
            self._copies.append(copy)
            self._put((list(rows), num_tokens, None, buffers, copy))
        except BaseException:
            if self._copies and self._copies[-1].buffers is buffers:
                self._copies.pop()
            self.pool.release(buffers)
            raise

    def pace(self) -> None:
        """A pace point of the next forward (a decoder layer starting): copy the next piece of
        the oldest pending batch, after this point of the compute stream."""
        if not self._copies:
            return
        point = torch.cuda.Event()
        point.record()  # on the current stream of the hooked layer's device
        self._issue(self._copies[0], 1, point)

    def flush_copies(self) -> None:
        """Issue every pending piece now (the unit's forwards are over, or a batch was not paced)."""
        while self._copies:
            self._issue(self._copies[0], self.copy_pieces, None)

    def _issue(self, copy: _PendingCopy, pieces: int, point: torch.cuda.Event | None) -> None:
        assert self._copy_stream is not None
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(copy.ready)  # the batch's forward and encode are over
            if point is not None:
                self._copy_stream.wait_event(point)
            for piece in range(copy.next_piece, min(copy.next_piece + pieces, self.copy_pieces)):
                rows = slice(
                    copy.num_tokens * piece // self.copy_pieces,
                    copy.num_tokens * (piece + 1) // self.copy_pieces,
                )
                for name, bits in copy.encoded.items():
                    copy.buffers[name][rows].copy_(bits[rows], non_blocking=True)
                copy.next_piece = piece + 1
            if copy.next_piece < self.copy_pieces:
                return
            copy.done.record(self._copy_stream)
        for bits in copy.encoded.values():
            bits.record_stream(self._copy_stream)  # freed now, reused only after the copy
        copy.encoded = {}
        self._copies.popleft()
        copy.enqueued.set()

    def _put(self, item: Any) -> None:
        # A bounded put that notices a dead writer thread instead of blocking forever.
        while True:
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                self._raise_if_failed()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            rows, num_tokens, host_features, buffers, copy = item
            try:
                if self._error is None:  # else drain: the main thread will see the error
                    self._write(rows, num_tokens, host_features, buffers, copy)
            except BaseException as err:  # noqa: BLE001 - re-raised in the main thread
                self._error = err
            finally:
                if buffers is not None and self.pool is not None:
                    if copy is None:
                        self.pool.release(buffers)
                    elif copy.enqueued.is_set():
                        copy.done.synchronize()  # the copy must be over before the buffers are reused
                        self.pool.release(buffers)
                    # else never copied (aborted on a broken device): the buffers are dropped

    def _write(
        self,
        rows: list[SampleRow],
        num_tokens: int,
        host_features: dict[str, torch.Tensor] | None,
        buffers: dict[str, torch.Tensor] | None,
        copy: _PendingCopy | None,
    ) -> None:
        if copy is not None:
            start = time.perf_counter()
            # Issued during the next forward (or when the unit's forwards end): a CUDA event
            # not yet recorded would "synchronize" at once, so wait for the issue first.
            while not copy.enqueued.wait(0.5):
                if self._error is not None:
                    raise StoreWriteError(
                        f"shard {self.writer.shard_id}: aborted before a copy was issued"
                    )
            copy.done.synchronize()
            self.wait_seconds += time.perf_counter() - start
        self.landed_at = time.time()
        start = time.perf_counter()
        if host_features is not None:
            encoded = {}
            for spec in self.features:
                values = host_features[spec.name]
                if values.shape[0] != num_tokens:
                    raise StoreWriteError(
                        f"shard {self.writer.shard_id}: feature {spec.name!r} holds {values.shape[0]} "
                        f"tokens, rows {num_tokens}"
                    )
                encoded.update(encode_torch(spec, values))
            arrays = {name: _as_numpy(bits) for name, bits in encoded.items()}
        else:
            assert buffers is not None
            arrays = {name: _as_numpy(buffer[:num_tokens]) for name, buffer in buffers.items()}
        self.writer.add_encoded_samples(
            [(r.sample_id, r.source_id, r.input_ids, r.loss_mask) for r in rows], arrays
        )
        self.write_seconds += time.perf_counter() - start

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise StoreWriteError(
                f"shard {self.writer.shard_id}: writing failed: {self._error}"
            ) from self._error

    def finish(self) -> ShardRecord:
        """Wait for every queued batch, then finish the shard (files in place, not yet committed)."""
        if self._cuda:
            self.flush_copies()
        self._put(_STOP)
        self._thread.join()
        self._raise_if_failed()
        return self.writer.finish()

    def abort(self) -> None:
        """Stop the thread and remove this attempt's files (it is garbage; nothing was committed)."""
        if self._cuda:
            with contextlib.suppress(Exception):  # a broken device: nothing more to copy
                self.flush_copies()
        if self._thread.is_alive():
            self._error = self._error or RuntimeError("aborted")
            with contextlib.suppress(queue.Full):
                self._queue.put(_STOP, timeout=5)
            self._thread.join(timeout=30)
        self.writer.abort()


def _as_numpy(bits: torch.Tensor) -> np.ndarray:
    """A host tensor of stored bits as the numpy array the store writes (bf16 bits as uint16)."""
    array = bits.numpy()
    return array.view(np.uint16) if bits.dtype == torch.int16 else array
