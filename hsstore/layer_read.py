"""Reading some layers of a [K, ...] feature (aux hidden states), for training on a subset.

A feature written with ``FeatureSpec.layer_arrays`` keeps each leading index in its own Zarr array,
so reading three of six layers opens and reads three arrays: its share of the bytes. A feature
written as one array (stores from before, or the default layout) is read whole and the chosen
layers kept: the same result without the saving.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hsstore.format.features import FeatureSpec


def read_layers(
    open_array: Callable[[str], Any],
    spec: FeatureSpec,
    chosen: Sequence[int] | None,
    start: int,
    stop: int,
    out: dict[str, np.ndarray] | None,
) -> dict[str, np.ndarray]:
    """The chosen leading indices of one feature (all when None), as arrays ``[n, len(chosen), ...]``
    (into ``out``'s arrays where given); ``open_array(name)`` gives a reader of one array's rows."""
    indices = list(range(spec.shape[0])) if chosen is None else [int(i) for i in chosen]
    view = spec.select(indices)
    n = stop - start
    result: dict[str, np.ndarray] = {}
    for array_name, shape, dtype in view.stored_arrays():
        target = None if out is None else out.get(array_name)
        result[array_name] = target if target is not None else np.empty((n, *shape), dtype=dtype)
    if not spec.layer_arrays:  # one array holds every layer: read it whole, keep the chosen
        for array_name, _, _ in spec.stored_arrays():
            whole = open_array(array_name).read(start, stop, None)
            result[array_name][...] = whole[:, indices]
        return result
    position = {index: j for j, index in enumerate(indices)}
    for array in spec.file_arrays(indices):
        # Each layer's rows are contiguous in its own file but strided in the [n, k, ...]
        # destination: read them into scratch, then place them (a memcpy next to the read).
        rows = open_array(array.name).read(start, stop, _layer_scratch(n, array.shape, array.dtype))
        assert array.layer is not None  # file_arrays of a layer_arrays feature
        result[array.logical][:, position[array.layer]] = rows
    return result


class _LayerScratch(threading.local):
    buffer: np.ndarray | None = None


_LAYER_SCRATCH = _LayerScratch()


def _layer_scratch(num_tokens: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A per-thread C-contiguous buffer ``[num_tokens, *shape]`` of ``dtype`` (grown, never shrunk)."""
    nbytes = num_tokens * int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    buffer = _LAYER_SCRATCH.buffer
    if buffer is None or buffer.nbytes < nbytes:
        buffer = _LAYER_SCRATCH.buffer = np.empty(max(nbytes, 1), dtype=np.uint8)
    return buffer[:nbytes].view(dtype).reshape(num_tokens, *shape)
