"""Feature specifications: what a store holds per token, in which codec, and how it is chunked."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# The names pipelines agree on (DESIGN.md). Other names are allowed: a store is a general container.
AUX_HIDDEN_STATES = "aux_hidden_states"  # [T, num_aux_layers, H]
FINAL_HIDDEN_STATE = "final_hidden_state"  # [T, H], post-norm
TOPK_LOGITS = "topk_logits"  # [T, k]
TOPK_IDS = "topk_ids"  # [T, k]
DRAFT_PROBS = "draft_probs"  # [T, V_draft]
# Served from the Arrow sample table, not from Zarr.
TABLE_FEATURES = ("input_ids", "loss_mask")

Codec = Literal["bf16", "fp8_e4m3", "float32", "int32"]
Compression = Literal["none", "zstd", "blosc"]

# What each codec decodes to, and the dtype of the bits kept on disk.
LOGICAL_DTYPE: dict[str, str] = {
    "bf16": "bfloat16",
    "fp8_e4m3": "bfloat16",
    "float32": "float32",
    "int32": "int32",
}
STORAGE_DTYPE: dict[str, str] = {
    "bf16": "uint16",
    "fp8_e4m3": "uint8",
    "float32": "float32",
    "int32": "int32",
}
SCALE_SUFFIX = ".scale"


class FeatureSpec(BaseModel):
    """One per-token feature of a store.

    The token axis is implicit and first: a feature of ``shape=(3, 4096)`` is stored as a Zarr array
    ``[num_tokens, 3, 4096]``. ``fp8_e4m3`` adds a float32 array ``<name>.scale`` holding one scale per
    token and per leading index (``[num_tokens, 3]`` here): the last axis shares a scale.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="feature name, e.g. aux_hidden_states", pattern=r"^[A-Za-z0-9_]+$")
    shape: tuple[int, ...] = Field(description="per-token shape (without the token axis)")
    codec: Codec = Field(default="bf16", description="how values are stored")
    compression: Compression = Field(default="none", description="byte compression of inner chunks")
    compression_level: int = Field(default=1, ge=0, le=22, description="zstd/blosc level")
    chunk_bytes: int = Field(
        default=4 << 20,
        ge=1024,
        description="target size of an inner chunk (the unit of reading); zarr pays ~1 ms per chunk",
    )
    shard_chunks: int = Field(
        default=64, ge=1, description="inner chunks per Zarr shard file (fewer, larger files)"
    )

    @field_validator("shape")
    @classmethod
    def _check_shape(cls, shape: tuple[int, ...]) -> tuple[int, ...]:
        if any(dim <= 0 for dim in shape):
            raise ValueError(f"every per-token dimension must be positive, got {shape}")
        return shape

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if name in TABLE_FEATURES:
            raise ValueError(f"{name!r} lives in the Arrow sample table, not in a feature array")
        return name

    @property
    def logical_dtype(self) -> str:
        return LOGICAL_DTYPE[self.codec]

    @property
    def storage_dtype(self) -> str:
        return STORAGE_DTYPE[self.codec]

    @property
    def has_scale(self) -> bool:
        return self.codec == "fp8_e4m3"

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """Per-token shape of the scale array (all axes but the last)."""
        return self.shape[:-1]

    @property
    def values_per_token(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def value_bytes_per_token(self) -> int:
        """Bytes of stored values per token (scales excluded): what an inner chunk is sized by."""
        itemsize = {"uint16": 2, "uint8": 1, "float32": 4, "int32": 4}[self.storage_dtype]
        return itemsize * self.values_per_token

    @property
    def scale_bytes_per_token(self) -> int:
        """fp8 only: one float32 scale per token and leading index."""
        return 4 * max(1, self.values_per_token // self.shape[-1]) if self.has_scale else 0

    @property
    def raw_bytes_per_token(self) -> int:
        """Uncompressed bytes per token, scales included."""
        return self.value_bytes_per_token + self.scale_bytes_per_token

    @property
    def chunk_tokens(self) -> int:
        """Tokens per inner chunk, derived from ``chunk_bytes``."""
        return max(1, self.chunk_bytes // self.value_bytes_per_token)

    @property
    def shard_tokens(self) -> int:
        """Tokens per Zarr shard file: writes are flushed in multiples of this."""
        return self.chunk_tokens * self.shard_chunks

    def array_names(self) -> list[str]:
        """The Zarr arrays that hold this feature."""
        return [self.name, self.name + SCALE_SUFFIX] if self.has_scale else [self.name]
