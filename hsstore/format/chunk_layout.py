"""The chunk layout of one feature array: what the Zarr shard file writer and reader share.

A feature array of a store shard is a Zarr v3 array with the ``sharding_indexed`` codec: each Zarr
shard file holds whole inner chunks back to back, then an index (``[offset, nbytes]`` as two
little-endian uint64 per inner chunk, then a crc32c of the index). Inner chunks are the raw
little-endian rows, optionally compressed (zstd, or blosc-zstd with byte shuffle), then a crc32c of
those bytes. Only the token axis is chunked.

:func:`layout_of` recognises that layout from the array's ``zarr.json`` as the Zarr v3 specification
defines it (plain JSON, not zarr-python's objects, so a zarr-python release cannot change what it
sees); anything else is read through zarr-python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hsstore.checksum import CRC_BYTES
from hsstore.format.layout import zarr_shard_key

MISSING = 2**64 - 1  # an index entry for a chunk that was never written (zarr: fill value)
INDEX_ENTRY_BYTES = 16


@dataclass(frozen=True)
class ChunkLayout:
    """Rows, chunking and byte codec of one array: enough to write or read its Zarr shard files."""

    row_shape: tuple[int, ...]  # per-token shape (the token axis is first and the only chunked one)
    dtype: np.dtype[Any]
    chunk_tokens: int
    shard_tokens: int  # tokens per Zarr shard file (a multiple of chunk_tokens)
    compression: str  # "none", "zstd" or "blosc"
    level: int = 1

    @property
    def row_bytes(self) -> int:
        # math.prod, not np.prod: the readers ask for this a few times per chunk read, and np.prod of
        # a tuple (~5 us) was half of a ranged read's Python time, taken under the GIL (issue 32).
        return math.prod(self.row_shape) * self.dtype.itemsize

    @property
    def chunk_bytes(self) -> int:
        """Uncompressed bytes of one inner chunk (the last chunk is stored padded to this)."""
        return self.chunk_tokens * self.row_bytes

    @property
    def chunks_per_shard(self) -> int:
        return self.shard_tokens // self.chunk_tokens

    @property
    def index_bytes(self) -> int:
        """Bytes of a Zarr shard file's index, its crc32c included."""
        return self.chunks_per_shard * INDEX_ENTRY_BYTES + CRC_BYTES

    def shard_key(self, zarr_shard: int) -> str:
        """The file of Zarr shard ``zarr_shard`` inside the array's folder."""
        return zarr_shard_key(zarr_shard, len(self.row_shape))

    def first_row(self, zarr_shard: int, chunk: int) -> int:
        """The array row where inner chunk ``chunk`` of Zarr shard ``zarr_shard`` starts."""
        return zarr_shard * self.shard_tokens + chunk * self.chunk_tokens

    def zarr_compressors(self) -> list[Any]:
        """The bytes-to-bytes codecs to declare in ``zarr.json``: what the writer writes."""
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


def _named(codec: Any) -> tuple[str, dict[str, Any]]:
    """(name, configuration) of a codec entry of ``zarr.json`` (a bare string is allowed too)."""
    if isinstance(codec, str):
        return codec, {}
    if not isinstance(codec, dict) or not isinstance(codec.get("name"), str):
        return "", {}
    configuration = codec.get("configuration") or {}
    return codec["name"], configuration if isinstance(configuration, dict) else {}


def layout_of(metadata: dict[str, Any]) -> ChunkLayout | None:
    """The layout of an array from its ``zarr.json`` (parsed), or None if the fast paths do not
    handle it (it is then read through zarr-python).

    Handled: a Zarr v3 array whose only codec is ``sharding_indexed`` with the index at the end
    (bytes little endian + crc32c), inner chunks spanning every axis but the first, inner codecs
    bytes (little endian) [+ zstd | blosc] + crc32c, a regular chunk grid, and the default chunk key
    encoding with "/" (which :meth:`ChunkLayout.shard_key` reproduces).
    """
    try:
        return _parse_layout(metadata)
    except (KeyError, TypeError, ValueError, IndexError):
        return None  # not a layout written the way the fast paths read; zarr-python decides


def _parse_layout(metadata: dict[str, Any]) -> ChunkLayout | None:
    if metadata.get("zarr_format") != 3 or metadata.get("node_type") != "array":
        return None
    if metadata.get("storage_transformers"):
        return None
    shape = tuple(int(d) for d in metadata["shape"])
    row_shape = shape[1:]
    if not shape or metadata["chunk_grid"]["name"] != "regular":
        return None
    shard_shape = tuple(int(d) for d in metadata["chunk_grid"]["configuration"]["chunk_shape"])
    key_name, key_config = _named(metadata["chunk_key_encoding"])
    if key_name != "default" or key_config.get("separator", "/") != "/":
        return None
    codecs = metadata["codecs"]
    if len(codecs) != 1:
        return None
    name, sharding = _named(codecs[0])
    if name != "sharding_indexed":
        return None
    chunk_shape = tuple(int(d) for d in sharding["chunk_shape"])
    if chunk_shape[1:] != row_shape or shard_shape[1:] != row_shape or shard_shape[0] % chunk_shape[0]:
        return None
    if sharding.get("index_location", "end") != "end":
        return None
    index_codecs = [_named(c) for c in sharding["index_codecs"]]
    if [n for n, _ in index_codecs] != ["bytes", "crc32c"] or index_codecs[0][1].get("endian", "little") != "little":
        return None
    inner = [_named(c) for c in sharding["codecs"]]
    if len(inner) < 2 or inner[0][0] != "bytes" or inner[-1][0] != "crc32c":
        return None
    dtype = np.dtype(metadata["data_type"])
    if dtype.itemsize > 1 and inner[0][1].get("endian", "little") != "little":
        return None
    middle = inner[1:-1]
    level = 1
    if not middle:
        compression = "none"
    elif len(middle) == 1 and middle[0][0] == "zstd":
        # zstd and blosc frames are self-describing: any level, checksum flag, cname or shuffle
        # decodes; the level only matters to the writer, which declares what it used.
        compression, level = "zstd", int(middle[0][1].get("level", 0))
    elif len(middle) == 1 and middle[0][0] == "blosc":
        compression, level = "blosc", int(middle[0][1].get("clevel", 5))
    else:
        return None
    return ChunkLayout(
        row_shape=row_shape,
        dtype=dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype,
        chunk_tokens=chunk_shape[0],
        shard_tokens=shard_shape[0],
        compression=compression,
        level=level,
    )
