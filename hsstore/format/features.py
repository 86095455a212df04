"""Feature specifications: what a store holds per token, in which codec, and how it is chunked."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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
        # Resolved once, here, so that the manifest records the chunk length actually written.
        if self.chunk_tokens is None:
            if self.chunk_bytes is not None:
                tokens = max(1, self.chunk_bytes // self.value_bytes_per_token)
            else:
                tokens = default_chunk_tokens(self.value_bytes_per_token)
            object.__setattr__(self, "chunk_tokens", tokens)
        return self

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
        """The Zarr arrays that hold this feature."""
        return [name for name, _, _ in self.stored_arrays()]
