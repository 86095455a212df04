"""The codecs that keep every value: ``int32``, ``float32`` and ``bf16`` (stored as uint16 bits).

bf16 is lossless with respect to a bf16 target's own compute. numpy has no bf16: numpy decoding
gives float32 (exact), torch decoding a free view of the bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hsstore.format.registry import FeatureCodec, register_codec

if TYPE_CHECKING:
    import torch

    from hsstore.format.registry import FeatureSpec


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (round to nearest even), returning the uint16 bit patterns."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    rounded = ((bits + rounding) >> 16).astype(np.uint16)
    # Keep NaNs NaN (rounding could carry a NaN payload into infinity).
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


class _Identity(FeatureCodec):
    """Values stored as they are, in ``storage_dtype``."""

    def encode_numpy(self, spec: FeatureSpec, values: np.ndarray) -> dict[str, np.ndarray]:
        return {spec.name: values.astype(self.storage_dtype, copy=False)}

    def encode_torch(self, spec: FeatureSpec, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        import torch

        return {spec.name: tensor.to(getattr(torch, self.storage_dtype))}

    def decode_numpy(self, spec: FeatureSpec, raw: dict[str, Any], name: str) -> np.ndarray:
        return np.asarray(raw[name])

    def decode_torch(self, spec: FeatureSpec, raw: dict[str, Any], name: str, bits_t: torch.Tensor, *, device: Any, out: torch.Tensor | None, threads: int | None) -> torch.Tensor:
        import torch

        return bits_t.to(getattr(torch, self.storage_dtype))


@register_codec
class Int32Codec(_Identity):
    name = "int32"
    storage_dtype = "int32"
    logical_dtype = "int32"


@register_codec
class Float32Codec(_Identity):
    name = "float32"
    storage_dtype = "float32"
    logical_dtype = "float32"


@register_codec
class Bf16Codec(FeatureCodec):
    name = "bf16"
    storage_dtype = "uint16"
    logical_dtype = "bfloat16"

    def encode_numpy(self, spec: FeatureSpec, values: np.ndarray) -> dict[str, np.ndarray]:
        return {spec.name: float32_to_bf16_bits(values.astype(np.float32, copy=False))}

    def encode_torch(self, spec: FeatureSpec, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """bf16 bits as int16: torch has no uint16 arithmetic; the bits are the same."""
        import torch

        return {spec.name: tensor.to(torch.bfloat16).contiguous().view(torch.int16)}

    def decode_numpy(self, spec: FeatureSpec, raw: dict[str, Any], name: str) -> np.ndarray:
        return bf16_bits_to_float32(raw[name])

    def decode_torch(self, spec: FeatureSpec, raw: dict[str, Any], name: str, bits_t: torch.Tensor, *, device: Any, out: torch.Tensor | None, threads: int | None) -> torch.Tensor:
        import torch

        return bits_t.view(torch.int16).view(torch.bfloat16)
