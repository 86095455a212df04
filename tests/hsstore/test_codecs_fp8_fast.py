"""fp8_e4m3 with power-of-two scales: how scales are chosen, the exact CPU decode, and ``out=``.

The reference for every decode is ``bf16_rne(float32(e4m3(bits) * scale))``, computed in numpy
(:func:`codecs.float32_to_bf16_bits` of :func:`codecs.decode_numpy`): the CPU fast path must
match it bit for bit, NaN payloads aside (torch's bf16 kernels write 0x7fc0 or 0xffff).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hsstore import CodecError, FeatureSpec
from hsstore.format import codecs, fp8

MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT = -126, 127  # every normal float32 power of two
FAST_SCALE_EXPONENTS = (-117, 119)  # the range decode_torch's CPU fast path accepts


def fp8_spec(shape: tuple[int, ...]) -> FeatureSpec:
    return FeatureSpec(name="x", shape=shape, codec="fp8_e4m3")


def reference_bf16_bits(bits: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """bf16 bits of e4m3(bits) * scale, the product in float32 and rounded once to nearest even."""
    with np.errstate(over="ignore"):  # 448 * 2^127 overflows to inf, in the reference as in torch
        product = codecs.FP8_E4M3_VALUES[bits] * scale[..., None].astype(np.float32)
    return codecs.float32_to_bf16_bits(product)


def assert_bits_match(decoded: torch.Tensor, expected_bits: np.ndarray) -> None:
    assert decoded.dtype == torch.bfloat16
    got = decoded.contiguous().view(torch.int16).numpy().view(np.uint16)
    got_nan = np.isnan(codecs.bf16_bits_to_float32(got))
    expected_nan = np.isnan(codecs.bf16_bits_to_float32(expected_bits))
    np.testing.assert_array_equal(got_nan, expected_nan)
    np.testing.assert_array_equal(got[~got_nan], expected_bits[~expected_nan])


@pytest.fixture(params=[1, 3], ids=["1-thread", "3-threads"])
def tiny_gather_chunks(request, monkeypatch):
    """Chunks of 64 values, so that small arrays exercise the chunk loop and the thread split."""
    monkeypatch.setattr(fp8, "_GATHER_CHUNK", 64)
    monkeypatch.setattr(torch, "get_num_threads", lambda: request.param)
    return request.param


# The patch above is the same for every generated input, so sharing it across them is intended.
SHARED_FIXTURE = [HealthCheck.function_scoped_fixture]

# --- scales -----------------------------------------------------------------------------------

wide_floats = st.floats(min_value=-(2.0**127), max_value=2.0**127, allow_nan=False, width=32)


@settings(max_examples=150, deadline=None)
@given(
    values=hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 6), st.integers(1, 3), st.integers(1, 40)),
        elements=wide_floats,
    ),
    row_scale_exponent=st.integers(-140, 100),
)
def test_fp8_scale_is_the_smallest_power_of_two_at_or_above_amax_over_448(values, row_scale_exponent):
    # Scaling whole arrays by 2^k reaches tiny (even subnormal) and huge rows alike.
    values = (values.astype(np.float64) * 2.0**row_scale_exponent).clip(-(2.0**127), 2.0**127)
    values = values.astype(np.float32)
    raw = codecs.encode(fp8_spec(values.shape[1:]), values)
    scale = raw["x.scale"].astype(np.float64)
    assert raw["x.scale"].dtype == np.float32
    mantissa, _ = np.frexp(scale)
    assert np.all(mantissa == 0.5), "every scale is a power of two"
    amax = np.abs(values.astype(np.float64)).max(axis=-1)
    zero, tiny = amax == 0, (amax > 0) & (amax / 448 <= 2.0**-126)
    regular = ~zero & ~tiny
    assert np.all(scale[zero] == 1.0)
    assert np.all(scale[tiny] == 2.0**-126), "tiny rows clamp at the smallest normal float32"
    assert np.all(scale[regular] >= amax[regular] / 448)
    assert np.all(scale[regular] < amax[regular] / 224)


@settings(max_examples=150, deadline=None)
@given(
    values=hnp.arrays(
        np.float32,
        st.tuples(st.integers(0, 6), st.integers(1, 3), st.integers(1, 40)),
        elements=wide_floats,
    ),
    row_scale_exponent=st.integers(-140, 0),
)
def test_fp8_round_trip_error_bound(values, row_scale_exponent):
    """|x' - x| <= max(2^-4 |x|, 2^-10 s) + 2^-134 for |x| <= 2^127.

    With y = x / s exact (s a power of two), e4m3 rounds y to nearest: half an ulp is <= 2^-4 |y|
    in the normal range and 2^-10 among the subnormals (spacing 2^-9). ``e4m3 * s`` is then exact in
    bf16 unless it falls below 2^-126 (rows with amax < 2^-109), where bf16's subnormal spacing
    2^-133 adds at most 2^-134."""
    values = (values.astype(np.float64) * 2.0**row_scale_exponent).astype(np.float32)
    feature = fp8_spec(values.shape[1:])
    raw = codecs.encode(feature, values)
    decoded = codecs.decode_torch(feature, raw).double().numpy()
    exact = values.astype(np.float64)
    scale = raw["x.scale"].astype(np.float64)[..., None]
    bound = np.maximum(np.abs(exact) * 2.0**-4, scale * 2.0**-10) + 2.0**-134
    assert np.all(np.abs(decoded - exact) <= bound)
    # Above bf16's subnormal range nothing is rounded after e4m3: numpy's float32 decode is equal.
    as_numpy = codecs.decode_numpy(feature, raw).astype(np.float64)
    normal = np.abs(as_numpy) >= 2.0**-126
    np.testing.assert_array_equal(as_numpy[normal], decoded[normal])


def test_fp8_encode_of_a_torch_tensor_matches_numpy():
    values = torch.randn(5, 3, 64) * torch.logspace(-30, 30, 5).view(5, 1, 1)
    from_torch = codecs.encode(fp8_spec((3, 64)), values)
    from_numpy = codecs.encode(fp8_spec((3, 64)), values.numpy())
    for name in ("x", "x.scale"):
        np.testing.assert_array_equal(from_torch[name], from_numpy[name])


# --- the CPU decode ---------------------------------------------------------------------------


def test_fp8_decode_is_exact_for_every_code_and_power_of_two_scale():
    """All 256 codes (NaN 0x7f/0xff and the subnormals included) under every float32 power of
    two, one scale per call so that each call is a batch the fast path accepts when it can."""
    codes = np.arange(256, dtype=np.uint8)[None, :]
    feature = fp8_spec((256,))
    for exponent in range(MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT + 1):
        scale = np.array([2.0**exponent], dtype=np.float32)
        decoded = codecs.decode_torch(feature, {"x": codes, "x.scale": scale})
        assert_bits_match(decoded, reference_bf16_bits(codes, scale))


@settings(max_examples=120, deadline=None, suppress_health_check=SHARED_FIXTURE)
@given(
    shape=st.tuples(st.integers(0, 7), st.integers(1, 3), st.integers(1, 50)),
    data=st.data(),
)
def test_fp8_fast_decode_matches_the_reference(tiny_gather_chunks, shape, data):
    """Random codes and scales in the fast path's range, odd sizes (no pair table) and chunked,
    threaded gathers included."""
    bits = data.draw(hnp.arrays(np.uint8, shape))
    exponents = data.draw(hnp.arrays(np.int32, shape[:-1], elements=st.integers(*FAST_SCALE_EXPONENTS)))
    scale = np.ldexp(np.float32(1.0), exponents).astype(np.float32)
    raw = {"x": bits, "x.scale": scale}
    feature = fp8_spec(shape[1:])
    decoded = codecs.decode_torch(feature, raw)
    expected = reference_bf16_bits(bits, scale)
    assert_bits_match(decoded, expected)
    # decode_numpy (no torch) agrees once its float32 values are rounded to bf16.
    np.testing.assert_array_equal(
        codecs.float32_to_bf16_bits(codecs.decode_numpy(feature, raw)), expected
    )


def test_fp8_fast_decode_handles_unaligned_and_non_contiguous_bits(tiny_gather_chunks):
    rng = np.random.default_rng(1)
    backing = rng.integers(0, 256, size=4 * 3 * 64 + 1, dtype=np.uint8)
    unaligned = backing[1:].reshape(4, 3, 64)  # odd address: the pair table cannot be used
    assert unaligned.ctypes.data % 2 == 1
    scale = np.full((4, 3), 2.0**-5, dtype=np.float32)
    feature = fp8_spec((3, 64))
    decoded = codecs.decode_torch(feature, {"x": unaligned, "x.scale": scale})
    assert_bits_match(decoded, reference_bf16_bits(unaligned, scale))
    strided = torch.from_numpy(rng.integers(0, 256, size=(4, 3, 128), dtype=np.uint8))[..., ::2]
    decoded = codecs.decode_torch(feature, {"x": strided, "x.scale": torch.from_numpy(scale)})
    assert_bits_match(decoded, reference_bf16_bits(strided.contiguous().numpy(), scale))


@settings(max_examples=60, deadline=None, suppress_health_check=SHARED_FIXTURE)
@given(shape=st.tuples(st.integers(0, 6), st.integers(1, 33)), data=st.data())
def test_fp8_arbitrary_scales_decode_as_before(tiny_gather_chunks, shape, data):
    """Stores written before scales were powers of two: the float32 route, rounded once to bf16."""
    bits = data.draw(hnp.arrays(np.uint8, shape))
    scale = data.draw(
        hnp.arrays(np.float32, shape[:-1], elements=st.floats(2.0**-100, 2.0**100, width=32))
    )
    decoded = codecs.decode_torch(fp8_spec(shape[1:]), {"x": bits, "x.scale": scale})
    before = (torch.from_numpy(codecs.FP8_E4M3_VALUES[bits]) * torch.from_numpy(scale)[..., None])
    assert_bits_match(decoded, before.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    assert_bits_match(decoded, reference_bf16_bits(bits, scale))


def test_fp8_scale_outside_the_fast_range_takes_the_float32_route(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the bf16 fast path must not run for this batch")

    monkeypatch.setattr(fp8, "_decode_fp8_cpu_bf16", refuse)
    bits = np.arange(256, dtype=np.uint8).reshape(2, 128)
    for odd_scale in (2.0**-118, 2.0**120, 0.75, -(2.0**-40) * 3):
        scale = np.array([1.0, odd_scale], dtype=np.float32)
        decoded = codecs.decode_torch(fp8_spec((128,)), {"x": bits, "x.scale": scale})
        assert_bits_match(decoded, reference_bf16_bits(bits, scale))


def test_fp8_negative_power_of_two_scale_decodes_exactly():
    bits = np.arange(256, dtype=np.uint8).reshape(2, 128)
    scale = np.array([-(2.0**-3), 2.0**7], dtype=np.float32)
    decoded = codecs.decode_torch(fp8_spec((128,)), {"x": bits, "x.scale": scale})
    assert_bits_match(decoded, reference_bf16_bits(bits, scale))


def test_fp8_pair_table_holds_both_values_of_every_byte_pair():
    pairs = fp8._fp8_pair_table()
    as_bytes = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    halves = pairs.view(np.uint16).reshape(-1, 2)
    np.testing.assert_array_equal(halves, codecs.FP8_E4M3_BF16_BITS[as_bytes])


def test_fp8_bf16_table_is_torchs_cast():
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.bfloat16)
    expected = every.view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(codecs.FP8_E4M3_VALUES)
    np.testing.assert_array_equal(codecs.FP8_E4M3_BF16_BITS[~nan], expected[~nan])
    assert np.all(np.isnan(codecs.bf16_bits_to_float32(codecs.FP8_E4M3_BF16_BITS[nan])))


# --- out= -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scale_value", [2.0**-3, 0.3], ids=["power-of-two (fast path)", "arbitrary (float32 route)"]
)
def test_decode_torch_writes_into_out(scale_value):
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 256, size=(5, 2, 16), dtype=np.uint8)
    scale = np.full((5, 2), scale_value, dtype=np.float32)
    raw = {"x": bits, "x.scale": scale}
    out = torch.full((5, 2, 16), 7.0, dtype=torch.bfloat16)
    decoded = codecs.decode_torch(fp8_spec((2, 16)), raw, out=out)
    assert decoded is out
    assert_bits_match(out, reference_bf16_bits(bits, scale))
    as_float = torch.empty((5, 2, 16), dtype=torch.float32)
    decoded = codecs.decode_torch(fp8_spec((2, 16)), raw, dtype=torch.float32, out=as_float)
    assert decoded is as_float
    torch.testing.assert_close(as_float, out.float(), rtol=0, atol=0, equal_nan=True)


def test_decode_torch_out_for_other_codecs():
    source = torch.randn(4, 8).to(torch.bfloat16)
    raw = codecs.encode(FeatureSpec(name="x", shape=(8,), codec="bf16"), source)
    out = torch.empty(4, 8, dtype=torch.bfloat16)
    decoded = codecs.decode_torch(FeatureSpec(name="x", shape=(8,), codec="bf16"), raw, out=out)
    assert decoded is out and torch.equal(out, source)


@pytest.mark.parametrize(
    ("make_out", "message"),
    [
        (lambda: torch.empty(3, 9, dtype=torch.bfloat16), r"shape \(3, 8\) on cpu; got torch.bfloat16 \(3, 9\)"),
        (lambda: torch.empty(3, 8, dtype=torch.float32), r"out must be a contiguous torch.bfloat16 tensor"),
        (lambda: torch.empty(8, 3, dtype=torch.bfloat16).t(), r"\(not contiguous\)"),
    ],
    ids=["shape", "dtype", "layout"],
)
def test_decode_torch_refuses_an_unfit_out(make_out, message):
    raw = codecs.encode(fp8_spec((8,)), np.ones((3, 8), np.float32))
    with pytest.raises(CodecError, match=rf"feature 'x': .*{message}"):
        codecs.decode_torch(fp8_spec((8,)), raw, out=make_out())


# --- GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_fp8_on_a_gpu_matches_the_cpu_bit_for_bit():
    """Scales come from exact exponent arithmetic, so a GPU writer and a CPU writer store the same
    bits; and the GPU's native float8 cast decodes to what the CPU's table gather gives."""
    generator = torch.Generator().manual_seed(3)
    magnitudes = 2.0 ** torch.randint(-110, 110, (64, 3, 1), generator=generator).float()
    values = torch.randn(64, 3, 256, generator=generator) * magnitudes
    values[5] = 0.0
    feature = fp8_spec((3, 256))
    on_cpu = codecs.encode(feature, values)
    on_gpu = codecs.encode(feature, values.cuda())
    for name in ("x", "x.scale"):
        np.testing.assert_array_equal(on_gpu[name], on_cpu[name])
    decoded_cpu = codecs.decode_torch(feature, on_cpu)
    decoded_gpu = codecs.decode_torch(feature, on_cpu, device="cuda")
    assert decoded_gpu.device.type == "cuda"
    assert torch.equal(decoded_gpu.cpu().view(torch.int16), decoded_cpu.view(torch.int16))


def test_fp8_zero_scales_of_batch_padding_keep_the_fast_path(monkeypatch):
    """Loader batches hold scale 0 on padding tokens: that must not send the batch down the float32
    route (it did, and made CPU decoding of fp8 stores 4x slower in bench_store)."""
    calls = []
    fast = fp8._decode_fp8_cpu_bf16
    monkeypatch.setattr(fp8, "_decode_fp8_cpu_bf16", lambda *a: calls.append(1) or fast(*a))
    bits = np.arange(256, dtype=np.uint8).reshape(2, 128)
    bits[1] = 0  # a padding row: zero bits, zero scale
    scale = np.array([2.0**-3, 0.0], dtype=np.float32)
    decoded = codecs.decode_torch(fp8_spec((128,)), {"x": bits, "x.scale": scale})
    assert calls == [1]
    assert_bits_match(decoded, reference_bf16_bits(bits, scale))
