"""What the streaming loader hands out and keeps: the resume state, host batches, and the pool of
batch buffers those batches are read into.

Buffers are recycled only when given back explicitly (:meth:`HostBatch.release`): a pool that
guessed when a consumer was done (it used to ask ``sys.getrefcount``) depends on one interpreter's
reference counting, and a wrong guess overwrites a batch still in use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hsstore.packing import LoaderError


class BatchPosition(Protocol):
    """Where a batch sits in the stream: a :class:`HostBatch` or a ``torch_data.DeviceBatch``."""

    epoch: int
    index: int


@dataclass(frozen=True)
class LoaderState:
    """Where a rank's stream stands: the next batch is ``batch_in_epoch`` of ``epoch``.

    The settings that shape the plan are recorded too, so a resume with another world size, budget
    or window (which would silently change what is seen) is refused instead.
    """

    seed: int
    epoch: int = 0
    batch_in_epoch: int = 0
    world_size: int = 1
    token_budget: int = 0
    rows_per_batch: int = 0
    shuffle_window: int = 0
    num_samples: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoaderState:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise LoaderError(f"loader state has unknown keys {sorted(unknown)}")
        return cls(**{key: int(value) for key, value in data.items()})


@dataclass
class HostBatch:
    """One packed batch on the host, features still in stored bits.

    Token arrays are ``[B, T]`` (``T = token_budget``); ``features[name]`` is ``[B, T, *shape]`` in the
    storage dtype (uint16 for bf16, uint8 for fp8) with ``features[name + ".scale"]`` for fp8.
    Padding is zeros with ``loss_mask`` 0 and ``doc_ids`` -1.
    """

    epoch: int
    index: int  # batch index within the rank's epoch
    input_ids: np.ndarray  # int64 [B, T]
    loss_mask: np.ndarray  # uint8 [B, T]
    position_ids: np.ndarray  # int64 [B, T], restarts per document
    doc_ids: np.ndarray  # int32 [B, T], -1 on padding
    doc_remaining: np.ndarray  # int32 [B, T], tokens after t in its document
    doc_lengths: list[list[int]]
    sample_indices: list[list[int]]  # global sample indices per row, in row order
    features: dict[str, np.ndarray]
    num_real_tokens: int
    num_skipped_samples: int = 0
    read_seconds: float = 0.0
    bytes_read: int = 0
    _release: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    @property
    def num_padding_tokens(self) -> int:
        rows, tokens = self.input_ids.shape  # numpy or (from a DataLoader worker) torch
        return int(rows * tokens) - self.num_real_tokens

    def release(self) -> None:
        """Give the feature buffers back to the loader, to be filled with a later batch.

        Call it once nothing uses ``features`` any more: neither the batch nor a view or tensor
        sharing its memory (:func:`hsstore.torch_data.to_device` to a CPU returns such tensors; to
        a GPU it copies, and releases the batch itself). ``features`` is emptied, so a use after
        release fails loudly instead of reading another batch's data. Without a release the loader
        allocates fresh buffers for later batches: correct, only slower (a fresh 100 MB buffer
        costs ~25k page faults). Calling it twice is harmless.
        """
        release, self._release = self._release, None
        self.features = {}
        if release is not None:
            release()


class BatchBufferPool:
    """Feature buffers for batches of ``[rows, token_budget, ...]``, in the stored dtypes.

    :meth:`take` hands out a buffer set (a given-back one if there is one for that row count, else a
    new one); :meth:`give_back` returns it once its batch is released. At most ``max_free`` sets are
    kept per row count; sets never given back are simply garbage collected.
    """

    def __init__(self, arrays: list[tuple[str, tuple[int, ...], str]], token_budget: int, max_free: int) -> None:
        self.arrays = arrays  # (array name, per-token shape, stored dtype)
        self.token_budget = token_budget
        self.max_free = max_free
        self._free: dict[int, list[dict[str, np.ndarray]]] = {}
        self._lock = threading.Lock()
        self.num_allocated = 0  # buffer sets created (tests and benchmarks read it)

    def take(self, row_lengths: list[int]) -> dict[str, np.ndarray]:
        """A buffer set for rows of ``row_lengths`` real tokens, zero past each row's length."""
        num_rows = len(row_lengths)
        with self._lock:
            free = self._free.get(num_rows)
            arrays = free.pop() if free else None
        if arrays is None:
            with self._lock:
                self.num_allocated += 1
            return {
                name: np.zeros((num_rows, self.token_budget, *per_token), dtype=dtype)
                for name, per_token, dtype in self.arrays
            }
        for array in arrays.values():
            for b, length in enumerate(row_lengths):
                array[b, length:] = 0
        return arrays

    def give_back(self, arrays: dict[str, np.ndarray]) -> None:
        """Make ``arrays`` (from :meth:`take`, no longer used by anyone) available again."""
        if not arrays:
            return
        num_rows = len(next(iter(arrays.values())))
        with self._lock:
            free = self._free.setdefault(num_rows, [])
            if len(free) < self.max_free and not any(existing is arrays for existing in free):
                free.append(arrays)

    def releaser(self, arrays: dict[str, np.ndarray]) -> Callable[[], None]:
        """What :attr:`HostBatch._release` calls: give ``arrays`` back."""
        return lambda: self.give_back(arrays)


__all__ = ["BatchBufferPool", "BatchPosition", "HostBatch", "LoaderError", "LoaderState"]
