"""Rows of a Zarr array in a layout :mod:`hsstore.format.array_reader` does not read (written by
another tool), through zarr-python: the store's fallback reader."""

from __future__ import annotations

from typing import Any

import numpy as np

from hsstore.errors import ShardCorruptError
from hsstore.format.layout import array_dir, features_root
from hsstore.storage.base import StoreLocation


class ZarrRows:
    """Rows of a zarr array in a layout :mod:`hsstore.format.array_reader` does not handle (written by
    another tool): read through zarr-python, then copied into ``out``."""

    def __init__(self, array: Any, where: str):
        self.array = array
        self.where = where

    @classmethod
    def open(cls, location: StoreLocation, shard_id: str, shard_path: str, array_name: str) -> ZarrRows:
        """Array ``array_name`` of store shard ``shard_id`` (its folder ``shard_path``)."""
        import zarr

        where = location.path(array_dir(shard_path, array_name))
        try:
            zstore = location.zarr_store(features_root(shard_path), read_only=True)
            return cls(zarr.open_array(zstore, path=array_name, mode="r", zarr_format=3), where)  # v3 only: no v2 probing
        except (ValueError, KeyError) as err:  # zarr's metadata errors are ValueErrors
            raise ShardCorruptError(f"shard {shard_id}: {where}: cannot open: {err}") from err

    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        try:
            rows = self.array[start:stop]
        except (ValueError, RuntimeError) as err:  # a chunk that fails its codecs (checksum, frame)
            raise ShardCorruptError(f"{self.where}: tokens [{start}, {stop}) do not decode: {err}") from err
        if out is None:
            return rows
        out[...] = rows
        return out
