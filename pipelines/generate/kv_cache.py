"""A KV cache allocated once per batch, for ``hsstore generate``'s decode loop.

transformers' ``DynamicLayer`` appends each step's keys and values with ``torch.cat``: every decode
step copies each layer's whole cache into a new, slightly larger tensor. A batch that decodes N
tokens after a prompt of P therefore moves O(N (P + N)) bytes per layer, and asks the allocator for
two new blocks per layer and step, each a little larger than the one just freed.
:class:`PreallocatedLayer` holds one buffer per layer sized for the batch's longest prompt plus its
``max_new_tokens``, writes each step's keys in place and hands attention a view of the filled
prefix. Attention reads the same values, so the tokens decoded are the same (tested against
``DynamicCache``). The engine imports this module where a batch is generated (it imports
transformers).

Rows dropped from the batch (``batch_select_indices``, the loop's compaction) keep their place in a
new, smaller buffer. Anything else that replaces the layer's tensors (``crop``, ``reset``, beam
reordering, none of which the loop uses) is noticed at the next update: the layer copies what it
holds into fresh buffers and goes on.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def preallocated_cache(config: Any, capacity: int) -> Any:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are :class:`PreallocatedLayer`
    of ``capacity`` positions. Other layer kinds (sliding windows, which drop old keys) stay as
    transformers builds them."""
    cache = DynamicCache(config=config)
    cache.layers = [
        PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers
    ]
    return cache


class PreallocatedLayer(DynamicLayer):  # type: ignore[misc]
    """A ``DynamicLayer`` whose keys and values live in buffers of ``capacity`` positions;
    ``self.keys`` / ``self.values`` are views of the filled prefix, as transformers expects."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._view: torch.Tensor | None = None  # the keys view last handed out

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized or self.keys is None:
            self.device = key_states.device
            self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
            self.is_initialized = True
        filled = self.keys.shape[-2]
        end = filled + key_states.shape[-2]
        if self._buffers is None or self.keys is not self._view or end > self._buffers[0].shape[-2]:
            self._allocate(key_states, value_states, filled, end)
        assert self._buffers is not None
        keys, values = self._buffers
        keys[..., filled:end, :].copy_(key_states)
        values[..., filled:end, :].copy_(value_states)
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        self._view = self.keys
        return self.keys, self.values

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, filled: int, end: int) -> None:
        """Fresh buffers of at least ``end`` positions, holding the ``filled`` ones the layer has."""
        capacity = max(self.capacity, end)
        keys = key_states.new_empty(*key_states.shape[:-2], capacity, key_states.shape[-1])
        values = value_states.new_empty(*value_states.shape[:-2], capacity, value_states.shape[-1])
        if filled:
            keys[..., :filled, :].copy_(self.keys)
            values[..., :filled, :].copy_(self.values)
        self._buffers = (keys, values)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices``: their whole buffers, so that later steps still write in place."""
        if self._buffers is None or self.keys is not self._view:
            super().batch_select_indices(indices)
            return
        filled = self.keys.shape[-2]
        keys, values = (buffer[indices] for buffer in self._buffers)
        self._buffers = (keys, values)
        self.keys, self.values = keys[..., :filled, :], values[..., :filled, :]
        self._view = self.keys
