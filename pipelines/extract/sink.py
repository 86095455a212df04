"""Overlap writing with compute: batches' features go to the shard on a background thread.

The GPU must not wait for the disk. After each forward, :meth:`ShardSink.submit` queues an
asynchronous device-to-host copy of the packed features into pinned memory on a side CUDA stream
(the main stream goes straight on to the next batch) and hands the batch to a writer thread, which
waits for that copy only, encodes per sample and appends to the unit's :class:`hsstore.ShardWriter`.
The queue is bounded, so a slow store applies back-pressure instead of filling host memory.

On the CPU the features are already host tensors; the thread still overlaps encoding and Zarr
writes with the next forward.

The ShardWriter is only ever touched by the writer thread (it is not thread-safe).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hsstore import ShardRecord, ShardWriter
from hsstore.errors import StoreWriteError

_STOP = object()


@dataclass(frozen=True)
class SampleRow:
    """What the store's sample table needs of one sample besides its features."""

    sample_id: str
    source_id: str
    input_ids: Any  # np.int32 [T]
    loss_mask: Any  # np.uint8 [T]


class ShardSink:
    """Feeds one ShardWriter from a writer thread; ``finish()`` returns the shard's record."""

    def __init__(self, writer: ShardWriter, device: torch.device, *, max_pending_batches: int = 3):
        self.writer = writer
        self.device = device
        self._cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device=device) if self._cuda else None
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending_batches)
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"shard-sink-{writer.shard_id}", daemon=True
        )
        self._thread.start()
        self.write_seconds = 0.0

    def submit(self, rows: Sequence[SampleRow], features: dict[str, torch.Tensor]) -> None:
        """Queue one batch: ``rows`` in packed order, ``features[name]`` ``[sum(T_i), ...]``."""
        self._raise_if_failed()
        if self._cuda:
            assert self._copy_stream is not None
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            host: dict[str, torch.Tensor] = {}
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(ready)
                for name, tensor in features.items():
                    buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                    buffer.copy_(tensor, non_blocking=True)
                    # The caching allocator must not hand this memory to the next forward
                    # before the copy stream has read it.
                    tensor.record_stream(self._copy_stream)
                    host[name] = buffer
                done: torch.cuda.Event | None = torch.cuda.Event()
                done.record(self._copy_stream)
        else:
            host = {name: tensor.detach() for name, tensor in features.items()}
            done = None
        self._put((list(rows), host, done))

    def _put(self, item: Any) -> None:
        # A bounded put that notices a dead writer thread instead of blocking forever.
        while True:
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                self._raise_if_failed()

    def _run(self) -> None:
        import time

        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if self._error is not None:
                continue  # drain: the main thread will see the error
            rows, host, done = item
            try:
                start = time.perf_counter()
                if done is not None:
                    done.synchronize()
                offset = 0
                for row in rows:
                    count = len(row.input_ids)
                    self.writer.add_sample(
                        sample_id=row.sample_id,
                        source_id=row.source_id,
                        input_ids=row.input_ids,
                        loss_mask=row.loss_mask,
                        features={
                            name: values[offset : offset + count] for name, values in host.items()
                        },
                    )
                    offset += count
                if any(values.shape[0] != offset for values in host.values()):
                    raise StoreWriteError(
                        f"shard {self.writer.shard_id}: features hold "
                        f"{[v.shape[0] for v in host.values()]} tokens, rows {offset}"
                    )
                self.write_seconds += time.perf_counter() - start
            except BaseException as err:  # noqa: BLE001 - re-raised in the main thread
                self._error = err

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise StoreWriteError(
                f"shard {self.writer.shard_id}: writing failed: {self._error}"
            ) from self._error

    def finish(self) -> ShardRecord:
        """Wait for every queued batch, then finish the shard (files in place, not yet committed)."""
        self._put(_STOP)
        self._thread.join()
        self._raise_if_failed()
        return self.writer.finish()

    def abort(self) -> None:
        """Stop the thread and remove this attempt's files (it is garbage; nothing was committed)."""
        if self._thread.is_alive():
            self._error = self._error or RuntimeError("aborted")
            with contextlib.suppress(queue.Full):
                self._queue.put(_STOP, timeout=5)
            self._thread.join(timeout=30)
        self.writer.abort()
