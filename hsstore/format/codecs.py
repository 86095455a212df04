"""Encoding and decoding features through their registered codec (:mod:`hsstore.format.registry`).

Encoding accepts numpy arrays or torch tensors (on any device: fp8 scaling runs where the tensor is,
so a GPU ships a quarter of the bytes). Decoding to numpy needs no torch; :func:`decode_torch` is the
loader's path and decodes on the target device.

The codecs themselves live in :mod:`hsstore.format.plain_codecs` (int32, float32, bf16) and
:mod:`hsstore.format.fp8`; importing this module registers them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hsstore.errors import CodecError
from hsstore.format.fp8 import FP8_E4M3_BF16_BITS, FP8_E4M3_MAX, FP8_E4M3_VALUES
from hsstore.format.plain_codecs import bf16_bits_to_float32, float32_to_bf16_bits
from hsstore.format.registry import codec_for, codec_names, is_torch, register_codec

if TYPE_CHECKING:
    import torch

    from hsstore.format.features import FeatureSpec


def encode(spec: FeatureSpec, values: Any) -> dict[str, np.ndarray]:
    """Encode ``values`` of shape ``[T, *spec.shape]`` into the arrays the store writes.

    Returns ``{name: bits}`` plus the codec's extra arrays (``{name.scale: scales}`` for fp8).
    Raises :class:`CodecError` for a wrong shape, or values the codec cannot represent (non-finite
    values under fp8).
    """
    shape = tuple(values.shape)
    if shape[1:] != tuple(spec.shape):
        raise CodecError(
            f"feature {spec.name!r}: expected per-token shape {tuple(spec.shape)}, got {shape[1:]} "
            f"(full shape {shape})"
        )
    codec = codec_for(spec.codec)
    if is_torch(values):
        encoded = {name: _bits_to_numpy(bits) for name, bits in codec.encode_torch(spec, values.detach()).items()}
        codec.check_encoded(spec, encoded)
        return encoded
    return codec.encode_numpy(spec, np.asarray(values))


def encode_torch(spec: FeatureSpec, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Encode on ``tensor``'s device: the stored arrays as torch tensors there, without a sync.

    The extraction worker encodes on the GPU before the device-to-host copy, so the host receives
    the stored bytes (fp8: a quarter of float32's, half of bf16's) and does no codec work. bf16 bits
    come back as int16 (torch has no uint16 arithmetic; the bits are the same), fp8 bits as uint8
    with float32 scales. The bits are the same on every device (tested: the GPU against the CPU).

    What cannot be refused without asking the device (fp8 of NaN or infinity: a NaN scale) is
    flagged instead: call :func:`check_encoded` on what arrives on the host.
    """
    return codec_for(spec.codec).encode_torch(spec, tensor.detach())


def check_encoded(spec: FeatureSpec, encoded: dict[str, np.ndarray]) -> None:
    """Raise :class:`CodecError` for what :func:`encode_torch` could only flag (fp8 of NaN/inf)."""
    codec_for(spec.codec).check_encoded(spec, encoded)


def _bits_to_numpy(bits: torch.Tensor) -> np.ndarray:
    import torch

    if bits.dtype == torch.int16:  # bf16 bits
        return bits.cpu().numpy().view(np.uint16)
    return bits.cpu().numpy()


def decode_numpy(spec: FeatureSpec, raw: dict[str, np.ndarray], key: str | None = None) -> np.ndarray:
    """Decode stored arrays to numpy: bf16 and fp8 become float32 (numpy has no bf16)."""
    return codec_for(spec.codec).decode_numpy(spec, raw, key or spec.name)


def decode_torch(
    spec: FeatureSpec,
    raw: dict[str, Any],
    key: str | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """Decode stored arrays to a torch tensor on ``device``, in the logical dtype (or ``dtype``).

    The bits travel to the device first and are reinterpreted there: bf16 is a free view, fp8 a
    view, a cast and a multiply, so the host never expands the data.

    ``out``, if given, receives the result and is returned: a contiguous tensor of the stored shape,
    of the returned dtype, on the decode device. The CPU fp8 path writes into it directly, which
    saves a fresh allocation whose first-touch page faults cost ~25 ms per 100 MB; reuse one buffer
    per batch shape. Other paths copy into it.

    ``threads`` caps the threads of the CPU fp8 table gather (default ``torch.get_num_threads()``):
    callers that already decode from several threads (the loader's readers) pass 1.
    """
    import torch

    codec = codec_for(spec.codec)
    name = key or spec.name
    bits = raw[name]
    bits_t = bits if is_torch(bits) else torch.from_numpy(np.ascontiguousarray(bits))
    bits_t = bits_t.to(device, non_blocking=True) if device is not None else bits_t
    result_dtype = dtype if dtype is not None else getattr(torch, codec.logical_dtype)
    if out is not None:
        _check_out(spec, out, bits_t, result_dtype)
    result = codec.decode_torch(spec, raw, name, bits_t, device=device, out=out, threads=threads)
    if result.dtype != result_dtype:
        result = result.to(result_dtype)
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result


def _check_out(spec: FeatureSpec, out: torch.Tensor, bits_t: torch.Tensor, dtype: torch.dtype) -> None:
    if (
        tuple(out.shape) != tuple(bits_t.shape)
        or out.dtype != dtype
        or out.device != bits_t.device
        or not out.is_contiguous()
    ):
        raise CodecError(
            f"feature {spec.name!r}: out must be a contiguous {dtype} tensor of shape "
            f"{tuple(bits_t.shape)} on {bits_t.device}; got {out.dtype} {tuple(out.shape)} on "
            f"{out.device}{'' if out.is_contiguous() else ' (not contiguous)'}"
        )


__all__ = [
    "FP8_E4M3_BF16_BITS",
    "FP8_E4M3_MAX",
    "FP8_E4M3_VALUES",
    "bf16_bits_to_float32",
    "check_encoded",
    "codec_for",
    "codec_names",
    "decode_numpy",
    "decode_torch",
    "encode",
    "encode_torch",
    "float32_to_bf16_bits",
    "register_codec",
]
