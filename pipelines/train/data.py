"""The trainer's data: one typed set of loader settings, the batch stream, batches on the device.

:class:`LoaderSettings` is everything :class:`hsstore.loader.StreamingLoader` takes besides the
store and the features (the recipe's ``loader`` section plus what the run decides: seed, rank,
world size, the aux layers read, where fp8 is decoded), built once and passed whole; the in-process
loader and DataLoader workers both get it from here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch

import hsstore
from hsstore.aux_layers import AUX_HIDDEN_STATES, select_aux_layers
from hsstore.batches import HostBatch, LoaderState
from hsstore.loader import StreamingLoader
from hsstore.packing import LongSamples, Remainder
from hsstore.torch_data import DeviceBatch, to_device
from pipelines.train.config import TrainRecipe
from pipelines.train.distributed import Distributed


@dataclass(frozen=True)
class LoaderSettings:
    """How one rank streams the store (see :class:`hsstore.loader.StreamingLoader` for each)."""

    token_budget: int  # tokens per packed row
    rows_per_batch: int  # packed rows per step and rank
    seed: int  # the loader's order (the recipe's seed)
    shuffle_window: int  # samples shuffled together
    rank: int
    world_size: int
    remainder: Remainder  # batches that do not divide across ranks: dropped or wrapped
    long_samples: LongSamples  # samples over token_budget: refused or truncated
    read_threads: int | None  # reads in flight (None: the store location's default)
    prefetch_batches: int | None  # batches read ahead (None: the store location's default)
    skip_corrupt: bool  # skip (and count) samples whose shard fails to read
    decode_on_host: bool  # fp8 features decoded by the read threads, not on the device
    layers: dict[str, list[int]]  # leading indices read per feature (the aux layers trained on)

    @classmethod
    def from_recipe(
        cls, recipe: TrainRecipe, store: hsstore.Store, dist_state: Distributed, device: torch.device
    ) -> LoaderSettings:
        loader = recipe.loader
        return cls(
            token_budget=loader.token_budget, rows_per_batch=loader.rows_per_batch, seed=recipe.seed,
            shuffle_window=loader.shuffle_window, rank=dist_state.rank, world_size=dist_state.world_size,
            remainder=loader.remainder, long_samples=loader.long_samples, read_threads=loader.read_threads,
            prefetch_batches=loader.prefetch_batches, skip_corrupt=recipe.skip_corrupt,
            # Training on the CPU: fp8 features are decoded by the read threads, overlapping the
            # step; a GPU decodes them for free and the host moves half the bytes.
            decode_on_host=device.type == "cpu",
            # Only the chosen aux layers are read (a store written with layer_arrays reads only their bytes).
            layers={AUX_HIDDEN_STATES: select_aux_layers(store.lineage.aux_layer_ids, recipe.aux_layer_ids)},
        )

    def loader_kwargs(self) -> dict[str, Any]:
        """The settings as hsstore's loader entry points take them (keyword arguments)."""
        return {field.name: getattr(self, field.name) for field in fields(self)}


def open_loader(store: hsstore.Store, features: list[str], settings: LoaderSettings) -> StreamingLoader:
    return StreamingLoader(store, features, **settings.loader_kwargs())


def batch_stream(
    loader: StreamingLoader, settings: LoaderSettings, start: LoaderState, num_workers: int
) -> Iterator[HostBatch]:
    """The rank's batches from ``start``: read in process, or by ``num_workers`` DataLoader workers
    (each opens the store and builds its own loader from the same settings)."""
    if num_workers == 0:
        return loader.batches(start)
    from hsstore.torch_data import make_dataloader

    return iter(make_dataloader(loader.store, loader.features, start, num_workers=num_workers,
                                **settings.loader_kwargs()))


def batch_on_device(host: HostBatch, loader: StreamingLoader, device: torch.device) -> DeviceBatch:
    """Decode ``host`` onto the training device; on the CPU, floating features become float32."""
    batch = to_device(host, loader.specs, device, pin_memory=device.type == "cuda")
    if device.type == "cpu":  # CPU bf16 matmuls are slow; features go in as float32
        batch.features = {k: v.float() if v.is_floating_point() else v for k, v in batch.features.items()}
    return batch
