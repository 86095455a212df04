"""The ``fp8_e4m3`` codec: float8 e4m3 bits (uint8) plus one float32 scale per token and leading
index, e.g. per aux layer (the extra array ``<name>.scale``).

The scale is the smallest power of two >= ``amax / 448``, so that each row's largest
value lands in (224, 448] and the row uses e4m3's range. Real models have outlier channels; the
scale is per row, so one outlier only costs its own row's precision.

Why a power of two rather than ``amax / 448`` itself: e4m3 is a floating-point format, so its
relative precision (2^-4) is the same at any scale; a power of two only moves the row down by less
than one binade, which costs at most one binade of subnormal range (values below about
``amax * 2^-14`` fall into e4m3's subnormals, absolute step ``scale * 2^-9`` with
``scale < amax / 224`` instead of ``amax / 448``). In exchange ``e4m3 * scale`` is exact in bf16
(4 significant bits fit in 8), so a CPU decodes with a table gather and an exact bf16 multiply
instead of a float32 detour (see :meth:`Fp8E4M3Codec.decode_torch`). The on-disk format is unchanged: stores
written with arbitrary scales still decode exactly as before.

Error bound (tested): ``|x' - x| <= max(2^-4 |x|, 2^-10 scale) + 2^-134``, for ``|x| <= 2^127``;
the last term is bf16's subnormal rounding, reached only by rows with ``amax < 2^-109``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

from hsstore.errors import CodecError
from hsstore.format.layout import SCALE_SUFFIX
from hsstore.format.plain_codecs import float32_to_bf16_bits
from hsstore.format.registry import FeatureCodec, is_torch, register_codec

if TYPE_CHECKING:
    import torch

    from hsstore.format.registry import FeatureSpec

FP8_E4M3_MAX = 448.0


def _fp8_e4m3fn_table() -> np.ndarray:
    """The 256 values of float8 e4m3fn (no infinities; 0x7f/0xff are NaN), as float32."""
    bits = np.arange(256, dtype=np.uint32)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent = (bits >> 3) & 0xF
    mantissa = (bits & 0x7).astype(np.float64)
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent.astype(np.float64) - 7.0)
    subnormal = (mantissa / 8.0) * 2.0**-6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(exponent == 0xF) & ((bits & 0x7) == 0x7)] = np.nan
    return values.astype(np.float32)


FP8_E4M3_VALUES = _fp8_e4m3fn_table()


FP8_E4M3_VALUES = _fp8_e4m3fn_table()


@register_codec
class Fp8E4M3Codec(FeatureCodec):
    name = "fp8_e4m3"
    storage_dtype = "uint8"
    logical_dtype = "bfloat16"

    def extra_arrays(self, spec: FeatureSpec) -> list[tuple[str, tuple[int, ...], str]]:
        # One float32 scale per token and leading index: the last axis shares a scale.
        return [(spec.name + SCALE_SUFFIX, tuple(spec.shape[:-1]), "float32")]

    def encode_numpy(self, spec: FeatureSpec, values: np.ndarray) -> dict[str, np.ndarray]:
        # Through torch's float8 rounding: the one conversion both sides agree on.
        import torch

        tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        encoded = {name: bits.numpy() for name, bits in self.encode_torch(spec, tensor).items()}
        self.check_encoded(spec, encoded)
        return encoded

    def encode_torch(self, spec: FeatureSpec, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows holding NaN or infinity are not refused here (that would ask the device): their
        scale is NaN, and :meth:`check_encoded` raises for it on the host."""
        import torch

        work = tensor.to(torch.float32)
        amax = work.abs().amax(dim=-1, keepdim=True)
        scale_exponent = _fp8_scale_exponent(amax)
        # 2^-k is exact too (k in [-126, 120]) and so is multiplying by it (a product small enough
        # to be rounded as a float32 subnormal is far below e4m3's range and becomes 0 either way):
        # the e4m3 cast is the only rounding.
        fp8_bits = (work * _power_of_two(-scale_exponent)).to(torch.float8_e4m3fn)
        # A NaN or infinity anywhere in a row makes its amax non-finite: flag the row by a NaN scale
        # (H times less to check on the host than every value).
        scale = torch.where(
            torch.isfinite(amax), _power_of_two(scale_exponent), torch.full_like(amax, float("nan"))
        )
        return {
            spec.name: fp8_bits.view(torch.uint8),
            spec.name + SCALE_SUFFIX: scale.squeeze(-1),
        }

    def check_encoded(self, spec: FeatureSpec, encoded: dict[str, np.ndarray]) -> None:
        if np.isnan(encoded[spec.name + SCALE_SUFFIX]).any():
            raise CodecError(
                f"feature {spec.name!r}: fp8_e4m3 cannot store NaN or infinity; "
                "use the bf16 codec for this feature or fix the source values"
            )

    def decode_numpy(self, spec: FeatureSpec, raw: dict[str, Any], name: str) -> np.ndarray:
        """``e4m3(bits) * scale`` in float32, exact for power-of-two scales; rounding it to bf16 gives
        exactly what :meth:`decode_torch` returns (NaN payloads aside)."""
        scale = np.asarray(raw[name + SCALE_SUFFIX], dtype=np.float32)
        values = np.take(FP8_E4M3_VALUES, np.asarray(raw[name], dtype=np.uint8))
        values *= scale[..., None]
        return values

    def decode_torch(
        self,
        spec: FeatureSpec,
        raw: dict[str, Any],
        name: str,
        bits_t: torch.Tensor,
        *,
        device: Any,
        out: torch.Tensor | None,
        threads: int | None,
    ) -> torch.Tensor:
        """On a CPU, power-of-two scales (every store this version writes) decode by a table gather
        over ``threads`` threads and an exact bf16 multiply; other scales (older stores) take an
        exact float32 route, 3-5x slower. Both give ``bf16(e4m3(bits) * scale)``."""
        import torch

        scale = raw[name + SCALE_SUFFIX]
        scale_t = scale if is_torch(scale) else torch.from_numpy(np.ascontiguousarray(scale))
        scale_t = scale_t.to(device, non_blocking=True) if device is not None else scale_t
        if bits_t.device.type != "cpu":
            # GPUs cast float8 natively: the cast and the multiply cost next to nothing there.
            values = bits_t.view(torch.float8_e4m3fn).to(torch.float32) * scale_t.unsqueeze(-1)
            return values.to(torch.bfloat16)
        if _scales_exact_in_bf16(scale_t):
            if out is not None and out.dtype == torch.bfloat16:
                target = out
            else:
                target = torch.empty(bits_t.shape, dtype=torch.bfloat16)
            _decode_fp8_cpu_bf16(bits_t, scale_t, target, threads)
            return target
        # Arbitrary scales (stores written before scales were powers of two): e4m3 * scale
        # is rounded once, from float32, as those stores were always decoded.
        unscaled = np.empty(tuple(bits_t.shape), dtype=np.float32)
        _gather(FP8_E4M3_VALUES, _flat_numpy(bits_t.view(torch.uint8)), unscaled.reshape(-1), threads)
        return (torch.from_numpy(unscaled) * scale_t.unsqueeze(-1)).to(torch.bfloat16)


def _fp8_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The exponent k of the fp8 scale 2^k: the smallest power of two >= ``amax / 448``.

    Worked on the exact binary exponent rather than on ``log2(amax / 448)``, which could round
    across a power of two. With ``amax = m * 2^e`` (frexp: m in [0.5, 1)) and ``448 = 0.875 * 2^9``,
    ``amax / 448 = (m / 0.875) * 2^(e - 9)`` and ``m / 0.875`` lies in [0.57, 1.15): k is ``e - 9``,
    or ``e - 8`` when ``m > 0.875``. amax 0 gives 1 (k = 0); tiny rows clamp at 2^-126, the smallest
    normal float32, so the scale never underflows to 0 (nor to a subnormal, whose inverse overflows).
    """
    import torch

    mantissa, exponent = torch.frexp(amax)
    scale_exponent = exponent - 9 + (mantissa > 0.875).to(exponent.dtype)
    scale_exponent = scale_exponent.clamp(min=-126)
    return torch.where(amax > 0, scale_exponent, torch.zeros_like(scale_exponent))


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """float32 ``2^exponent`` for exponents in [-126, 127], built from its bits (exact on any device,
    where ``torch.ldexp``/``pow`` go through a float power that need not be exact)."""
    import torch

    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


# --- CPU fp8 decoding ------------------------------------------------------------------------
#
# Measured on a 2-core CPU for [4096, 3, 4096] values (50M): torch's float8 -> bf16 cast 101 ms;
# np.take over a 256-entry table 44-52 ms, because numpy first casts the uint8 indices to an intp
# array 8x their size; the same take in 256K-value chunks 22 ms (the intp temporary stays in
# cache), over pairs of values (a 65,536-entry uint32 table indexed by the bytes viewed as uint16)
# 14 ms, and that on 2 threads 7.4 ms (take releases the GIL). A bf16 * bf16 multiply in place
# then costs ~3 ms; a bf16 * float32 one 107 ms, hence the scale cast to bf16.

# bf16 bit patterns of the 256 e4m3 values: exact (4 significant bits, exponents -9..8).
FP8_E4M3_BF16_BITS = float32_to_bf16_bits(FP8_E4M3_VALUES)

_GATHER_CHUNK = 1 << 18  # lookups per np.take call: its intp index temporary is 2 MiB


@cache
def _fp8_pair_table() -> np.ndarray:
    """uint32 table: for every 2-byte pattern, the two bf16 bit patterns in the same memory order.

    Built through views of the same memory layout, so it is right on either byte order."""
    byte_pairs = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    return np.ascontiguousarray(FP8_E4M3_BF16_BITS[byte_pairs]).view(np.uint32).reshape(-1)


def _flat_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A flat numpy view of a CPU tensor's elements (copied first only if not contiguous)."""
    return tensor.contiguous().view(-1).numpy()


def _gather(table: np.ndarray, indices: np.ndarray, out: np.ndarray, threads: int | None = None) -> None:
    """``out[i] = table[indices[i]]`` for flat arrays, in chunks spread over torch's thread count.

    Indices must be in range (uint8 into 256 entries, uint16 into 65,536): ``mode="wrap"`` then
    changes nothing, and unlike the default ``"raise"`` it lets numpy write ``out`` unbuffered.
    """
    import torch

    num_chunks = -(-indices.size // _GATHER_CHUNK)
    num_threads = max(1, min(threads or torch.get_num_threads(), num_chunks))
    span = -(-num_chunks // num_threads) * _GATHER_CHUNK

    def gather_span(start: int) -> None:
        stop = min(start + span, indices.size)
        for lo in range(start, stop, _GATHER_CHUNK):
            hi = min(lo + _GATHER_CHUNK, stop)
            np.take(table, indices[lo:hi], out=out[lo:hi], mode="wrap")

    if num_threads == 1:
        gather_span(0)
        return
    # A pool per call (~0.1 ms): a module-level one would reach forked DataLoader workers without
    # its threads, and their tasks would never run.
    with ThreadPoolExecutor(num_threads - 1) as pool:
        spans = [pool.submit(gather_span, start) for start in range(span, indices.size, span)]
        gather_span(0)
        for future in spans:
            future.result()


def _scales_exact_in_bf16(scale_t: torch.Tensor) -> bool:
    """Whether every scale is +0.0 or a float32 power of two in [2^-117, 2^119] (read from its bits).

    Then every e4m3 value times its scale is zero or a normal bf16 (2^-9 * 2^-117 = 2^-126 at the
    bottom, 1.75 * 2^8 * 2^119 < 2^128 at the top) with at most 4 significant bits: the bf16
    multiply is exact, whatever the kernel's rounding or denormal mode. Encoded scales lie in
    [2^-126, 2^120]; batches with a row outside this range (amax below ~2^-109 or above
    1.75 * 2^127) are so rare that they simply take the float32 route.
    """
    import torch

    if scale_t.dtype != torch.float32:
        return False
    scale_bits = scale_t.contiguous().view(torch.int32)
    exponent = (scale_bits >> 23) & 0xFF
    power_of_two = (scale_bits & 0x7FFFFF) == 0
    in_range = (exponent >= 127 - 117) & (exponent <= 127 + 119)
    # +0.0 is exact too (every product is zero): batch buffers hold it on their padding tokens.
    return bool(((power_of_two & in_range) | (scale_bits == 0)).all())


def _decode_fp8_cpu_bf16(
    bits_t: torch.Tensor, scale_t: torch.Tensor, out: torch.Tensor, threads: int | None = None
) -> None:
    """``out = bf16(e4m3(bits) * scale)`` for scales that pass :func:`_scales_exact_in_bf16`.

    e4m3 NaN (0x7f, 0xff; never written by :func:`encode`) decodes to a NaN whose payload depends on
    torch's kernel (0x7fc0 or 0xffff), as with torch's own casts.
    """
    import torch

    indices = _flat_numpy(bits_t.view(torch.uint8))
    out_bits = out.view(-1).view(torch.int16).numpy().view(np.uint16)
    table = FP8_E4M3_BF16_BITS
    # Two values per lookup when both arrays allow the wider views: an even number of values in
    # aligned buffers, which is every batch with an even last axis in practice.
    if indices.size % 2 == 0 and indices.ctypes.data % 2 == 0 and out_bits.ctypes.data % 4 == 0:
        table = _fp8_pair_table()
        indices, out_bits = indices.view(np.uint16), out_bits.view(np.uint32)
    _gather(table, indices, out_bits, threads)
    out.mul_(scale_t.to(torch.bfloat16).unsqueeze(-1))
