"""The torch-facing half of the streaming loader: device transfer and decoding, the
``IterableDataset``/``DataLoader`` wrappers, and the data-wait timer.

:mod:`hsstore.loader` plans and reads batches and keeps them as numpy arrays of stored bits, so that
``import hsstore`` stays free of torch. Everything that hands batches to a torch training loop lives
here instead, and this module imports torch at the top:

- **Decoding on the device**: :func:`to_device` moves a :class:`~hsstore.loader.HostBatch` to the
  training device and decodes its features there (a bf16 view, or an fp8 cast times the scale), so
  the host moves half (bf16) or a quarter (fp8) of the float32 bytes.
- **Workers**: :class:`StoreBatchDataset` is a torch ``IterableDataset``; each DataLoader worker
  opens the store itself (fsspec is not fork-safe) and takes every ``num_workers``-th batch of the
  rank's stream, which is the order torch's DataLoader returns them in. No shared memory or lock
  files between workers. :func:`make_dataloader` builds that DataLoader.
- **Data wait**: :class:`WaitTimer` measures how long the training loop blocks on the next batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils.data

from hsstore.format import codecs
from hsstore.format.features import FeatureSpec
from hsstore.loader import HostBatch, LoaderState, StreamingLoader
from hsstore.store import Store


@dataclass
class DeviceBatch:
    """A batch on the training device: token tensors ``[B, T]`` and decoded features."""

    epoch: int
    index: int
    input_ids: torch.Tensor  # int64
    loss_mask: torch.Tensor  # bool
    position_ids: torch.Tensor  # int64
    doc_ids: torch.Tensor  # int32 (-1 on padding)
    doc_remaining: torch.Tensor  # int32
    features: dict[str, torch.Tensor]  # logical dtype (bf16 for bf16/fp8 codecs)
    doc_lengths: list[list[int]]
    num_real_tokens: int
    num_padding_tokens: int
    num_skipped_samples: int
    read_seconds: float
    bytes_read: int


def to_device(
    batch: HostBatch,
    specs: dict[str, FeatureSpec],
    device: str | torch.device,
    *,
    pin_memory: bool = False,
    release: bool | None = None,
) -> DeviceBatch:
    """Move a host batch to ``device`` and decode its features there (hsstore.format.codecs.decode_torch).

    Arrays may already be torch tensors (a DataLoader worker converts them to share memory).

    ``release`` (default: whether ``device`` is not the CPU) gives the host batch's buffers back to
    the loader once they are copied (:meth:`HostBatch.release`; ``batch.features`` is emptied). On
    a CPU the device batch shares the host buffers, so the default keeps them: call
    ``batch.release()`` once the device batch is no longer used.
    """

    def tensor(array: Any) -> torch.Tensor:
        t = array if isinstance(array, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(array))
        if pin_memory and t.device.type == "cpu":
            t = t.pin_memory()
        return t.to(device, non_blocking=pin_memory)

    features = {}
    for name, spec in specs.items():
        raw = {key: tensor(batch.features[key]) for key in spec.array_names()}
        features[name] = codecs.decode_torch(spec, raw, name, device=device)
    on_cpu = torch.device(device).type == "cpu"
    if release if release is not None else not on_cpu:
        if on_cpu:
            # The decoded tensors may be views of the host buffers: copy before giving them back.
            features = {name: value.clone() for name, value in features.items()}
        # Otherwise the buffers were read already: a copy from pageable memory returns once CUDA has
        # staged the bytes, and with pin_memory the (synchronous) pinning copy read them.
        batch.release()
    return DeviceBatch(
        epoch=batch.epoch,
        index=batch.index,
        input_ids=tensor(batch.input_ids).long(),
        loss_mask=tensor(batch.loss_mask).bool(),
        position_ids=tensor(batch.position_ids).long(),
        doc_ids=tensor(batch.doc_ids),
        doc_remaining=tensor(batch.doc_remaining),
        features=features,
        doc_lengths=batch.doc_lengths,
        num_real_tokens=batch.num_real_tokens,
        num_padding_tokens=int(batch.input_ids.shape[0] * batch.input_ids.shape[1]) - batch.num_real_tokens,
        num_skipped_samples=batch.num_skipped_samples,
        read_seconds=batch.read_seconds,
        bytes_read=batch.bytes_read,
    )


def _host_batch_to_torch(batch: HostBatch) -> HostBatch:
    """Numpy arrays to CPU tensors in shared memory, so that a DataLoader worker hands them over
    without pickling them through a pipe. Moving them there is the one copy torch would make when
    sending them anyway; it frees the loader's buffers at once, so they are released here."""

    def conv(a: np.ndarray) -> Any:
        return torch.from_numpy(np.ascontiguousarray(a)).share_memory_()

    batch.input_ids = conv(batch.input_ids)
    batch.loss_mask = conv(batch.loss_mask)
    batch.position_ids = conv(batch.position_ids)
    batch.doc_ids = conv(batch.doc_ids)
    batch.doc_remaining = conv(batch.doc_remaining)
    features = {key: conv(value) for key, value in batch.features.items()}
    batch.release()
    batch.features = features
    return batch


def _identity(batch: Any) -> Any:
    """The DataLoader's collate_fn: batches come packed already (a module-level function, so that
    spawned workers can pickle it)."""
    return batch


class StoreBatchDataset(torch.utils.data.IterableDataset):
    """A torch ``IterableDataset`` of one rank's packed batches (stored bits, on the host).

    Holds only the store (a URL, or a :class:`Store`, which pickles as its URL, storage options,
    manifest and cache settings) and settings: each worker process builds its own
    :class:`StreamingLoader`, since a spawned worker receives the dataset pickled (a loader's locks
    do not pickle) and fsspec's filesystems are not fork-safe.
    """

    def __init__(
        self,
        store_url: str | Store,
        features: list[str],
        start: LoaderState | None = None,
        *,
        max_epochs: int | None = None,
        **loader_kwargs: Any,
    ) -> None:
        self.store_url = store_url
        self.features = features
        self.start = start
        self.max_epochs = max_epochs
        self.loader_kwargs = loader_kwargs

    def __iter__(self) -> Iterator[HostBatch]:
        info = torch.utils.data.get_worker_info()
        worker_id, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        loader = StreamingLoader(self.store_url, self.features, **self.loader_kwargs)
        for batch in loader.batches(
            self.start, max_epochs=self.max_epochs, worker_id=worker_id, num_workers=num_workers
        ):
            yield _host_batch_to_torch(batch) if info is not None else batch


def make_dataloader(
    store_url: str | Store,
    features: Sequence[str],
    start: LoaderState | None = None,
    *,
    num_workers: int = 0,
    max_epochs: int | None = None,
    **loader_kwargs: Any,
) -> Any:
    """A ``torch.utils.data.DataLoader`` over :class:`StoreBatchDataset` yielding :class:`HostBatch`.

    Batches arrive in the rank's stream order whatever ``num_workers`` is (the DataLoader's round
    robin over workers matches the dataset's striding). Workers start with ``spawn``: they open the
    store themselves, and fsspec's async filesystems are not fork-safe.
    """
    dataset = StoreBatchDataset(store_url, list(features), start, max_epochs=max_epochs, **loader_kwargs)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        num_workers=num_workers,
        collate_fn=_identity,
        multiprocessing_context="spawn" if num_workers > 0 else None,
        persistent_workers=False,
        prefetch_factor=2 if num_workers > 0 else None,
    )


class WaitTimer:
    """Wraps an iterator and accumulates the time spent blocked in ``next()``: the data wait."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self._iterator = iterator
        self.wait_seconds = 0.0
        self.last_wait = 0.0

    def __iter__(self) -> WaitTimer:
        return self

    def __next__(self) -> Any:
        started = time.perf_counter()
        try:
            return next(self._iterator)
        finally:
            self.last_wait = time.perf_counter() - started
            self.wait_seconds += self.last_wait


__all__ = [
    "DeviceBatch",
    "StoreBatchDataset",
    "WaitTimer",
    "make_dataloader",
    "to_device",
]
