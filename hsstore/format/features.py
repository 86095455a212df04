"""Feature specifications: what a store holds per token, in which codec, and how it is chunked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

from hsstore.format.layout import TABLE_FEATURES
from hsstore.format.registry import FeatureCodec, codec_for

Compression = Literal["none", "zstd", "blosc"]

# Default inner chunk: reads are about one sample (hundreds of tokens) and always cover whole chunks,
# so a chunk is sized in tokens, not bytes: a power of two of at most 1,024 tokens and 2 MiB. That is
# 64 tokens of [3, 4096] bf16 aux states (1.5 MiB), 512 of [3, 384]; benchmarks/RESULTS.md has the sweep.
DEFAULT_CHUNK_BYTES = 2 << 20
MAX_DEFAULT_CHUNK_TOKENS = 1024


def default_chunk_tokens(bytes_per_token: int) -> int:
    """The default tokens per inner chunk for rows of ``bytes_per_token`` stored bytes."""
    fit = max(1, DEFAULT_CHUNK_BYTES // max(1, bytes_per_token))
    return min(MAX_DEFAULT_CHUNK_TOKENS, 1 << (fit.bit_length() - 1))


class FileArray(NamedTuple):
    """One Zarr array of a feature as written: its name, per-token shape and stored dtype, and the
    logical array (name, leading index or None) whose bits it holds."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    logical: str
    layer: int | None  # the leading index it holds; None: the whole logical array


class FeatureSpec(BaseModel):
    """One per-token feature of a store.

    The token axis is implicit and first: a feature of ``shape=(3, 4096)`` is stored as a Zarr array
    ``[num_tokens, 3, 4096]``. ``fp8_e4m3`` adds a float32 array ``<name>.scale`` holding one scale per
    token and per leading index (``[num_tokens, 3]`` here): the last axis shares a scale. ``codec``
    names a registered :class:`~hsstore.format.registry.FeatureCodec`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="feature name, e.g. aux_hidden_states", pattern=r"^[A-Za-z0-9_]+$")
    shape: tuple[int, ...] = Field(description="per-token shape (without the token axis)")
    codec: str = Field(default="bf16", description="how values are stored: a registered codec (bf16, fp8_e4m3, float32, int32)")
    compression: Compression = Field(default="none", description="byte compression of inner chunks")
    compression_level: int = Field(default=1, ge=0, le=22, description="zstd/blosc level")
    chunk_tokens: int | None = Field(
        default=None,
        ge=1,
        description=(
            "tokens per inner chunk (the unit of reading and of the crc32c); default: from "
            "chunk_bytes, else the largest power of two whose chunk stays within "
            "DEFAULT_CHUNK_BYTES, at most MAX_DEFAULT_CHUNK_TOKENS"
        ),
    )
    chunk_bytes: int | None = Field(
        default=None,
        ge=1024,
        description="target bytes of an inner chunk, used only to derive chunk_tokens when it is not given",
    )
    shard_chunks: int | None = Field(
        default=None,
        ge=1,
        description=(
            "inner chunks per Zarr shard file; default (None): one file per array per store shard, "
            "written as a stream (the fewest files)"
        ),
    )
    layer_arrays: bool = Field(
        default=False,
        description=(
            "store each index of the leading axis (each aux layer of [K, H]) as its own Zarr array "
            "'<name>.<i>' (fp8: with '<name>.<i>.scale'), so that a reader of some layers reads only "
            "their bytes; readers still see one [K, H] feature (FeatureSpec.select)"
        ),
    )

    @field_validator("codec")
    @classmethod
    def _check_codec(cls, codec: str) -> str:
        codec_for(codec)  # a CodecError (a ValueError) naming the known codecs
        return codec

    @field_validator("shape")
    @classmethod
    def _check_shape(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        if any(dim <= 0 for dim in shape):
            raise ValueError(f"every per-token dimension must be positive, got {shape}")
        return shape

    @model_validator(mode="after")
    def _resolve_chunk_tokens(self) -> FeatureSpec:
        if self.layer_arrays and len(self.shape) < 2:
            raise ValueError(f"layer_arrays splits the leading axis of a [K, ...] feature; {self.name} has shape {self.shape}")
        # Resolved once, here, so that the manifest records the chunk length actually written. With
        # layer_arrays too, chunks are sized by the whole feature's bytes per token (a layer's chunk
        # is 1/K of that): the same chunk_tokens as one array of every layer, and no more tokens than
        # a store holding fewer layers would use, so a subset read wastes no more on edge chunks.
        if self.chunk_tokens is None:
            row_bytes = self.value_bytes_per_token
            if self.chunk_bytes is not None:
                tokens = max(1, self.chunk_bytes // row_bytes)
            else:
                tokens = default_chunk_tokens(row_bytes)
            object.__setattr__(self, "chunk_tokens", tokens)
        return self

    @model_serializer(mode="wrap")
    def _omit_default_layout(self, handler: Any) -> dict[str, Any]:
        # layer_arrays is written only when set: manifests of the default layout stay as they were
        # (and readable by code that predates the field).
        data: dict[str, Any] = handler(self)
        if not self.layer_arrays:
            data.pop("layer_arrays", None)
        return data

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if name in TABLE_FEATURES:
            raise ValueError(f"{name!r} lives in the Arrow sample table, not in a feature array")
        return name

    @property
    def codec_impl(self) -> FeatureCodec:
        """The registered codec object (encode, decode, extra arrays)."""
        return codec_for(self.codec)

    @property
    def logical_dtype(self) -> str:
        return self.codec_impl.logical_dtype

    @property
    def storage_dtype(self) -> str:
        return self.codec_impl.storage_dtype

    @property
    def has_scale(self) -> bool:
        """Whether the codec keeps extra arrays (fp8's scales) beside the values."""
        return bool(self.codec_impl.extra_arrays(self))

    @property
    def values_per_token(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def value_bytes_per_token(self) -> int:
        """Bytes of stored values per token (scales excluded): what an inner chunk is sized by."""
        return np.dtype(self.storage_dtype).itemsize * self.values_per_token

    @property
    def scale_bytes_per_token(self) -> int:
        """Bytes of the codec's extra arrays per token (fp8: one float32 scale per leading index)."""
        total = 0
        for _, per_token, dtype in self.codec_impl.extra_arrays(self):
            total += np.dtype(dtype).itemsize * int(np.prod(per_token, dtype=np.int64))
        return total

    @property
    def raw_bytes_per_token(self) -> int:
        """Uncompressed bytes per token, scales included."""
        return self.value_bytes_per_token + self.scale_bytes_per_token

    @property
    def shard_tokens(self) -> int | None:
        """Tokens per Zarr shard file, or None for one file per store shard."""
        return None if self.shard_chunks is None else (self.chunk_tokens or 1) * self.shard_chunks

    def stored_arrays(self) -> list[tuple[str, tuple[int, ...], str]]:
        """``(Zarr array name, per-token shape, stored dtype)`` of every array holding this feature:
        the values, plus the codec's extra arrays (fp8's float32 scales). What writers, readers and
        checks iterate over."""
        return [(self.name, self.shape, self.storage_dtype), *self.codec_impl.extra_arrays(self)]

    def array_names(self) -> list[str]:
        """The arrays a reader hands out for this feature (values, then the codec's extra arrays)."""
        return [name for name, _, _ in self.stored_arrays()]

    def file_arrays(self, layers: Sequence[int] | None = None) -> list[FileArray]:
        """The Zarr arrays written for this feature, each with the logical array
        (:meth:`stored_arrays`) it is cut from. Without ``layer_arrays`` these are the logical arrays
        themselves; with it, one per leading index ``i`` (``layers``: only those indices):
        ``<name>.<i>`` holds ``values[:, i]`` and ``<name>.<i>.scale`` holds ``scale[:, i]``."""
        if not self.layer_arrays:
            return [FileArray(name, shape, dtype, name, None) for name, shape, dtype in self.stored_arrays()]
        indices = range(self.shape[0]) if layers is None else layers
        return [
            FileArray(f"{self.name}.{i}{name[len(self.name):]}", tuple(shape[1:]), dtype, name, int(i))
            for i in indices
            for name, shape, dtype in self.stored_arrays()
        ]

    def select(self, layers: Sequence[int]) -> FeatureSpec:
        """The spec of ``layers`` (indices of the leading axis) as a reader hands them out: shape
        ``[len(layers), ...]``, one logical array (what loaders allocate and decoders take)."""
        bad = [i for i in layers if not 0 <= i < self.shape[0]]
        if bad or not layers:
            raise ValueError(f"{self.name}: layer indices {list(layers)} outside [0, {self.shape[0]})")
        return self.model_copy(update={"shape": (len(layers), *self.shape[1:]), "layer_arrays": False})

