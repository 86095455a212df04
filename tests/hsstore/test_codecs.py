"""Codec round trips: bf16 exact, fp8 within its stated bound, NaN/inf handled or refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hsstore import CodecError, FeatureSpec
from hsstore.format import codecs

finite_floats = st.floats(min_value=-3e4, max_value=3e4, allow_nan=False, width=32)
shapes = st.tuples(st.integers(0, 9), st.integers(1, 4), st.integers(1, 33))


def spec(codec: str, shape: tuple[int, ...]) -> FeatureSpec:
    return FeatureSpec(name="x", shape=shape, codec=codec)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, data=st.data())
def test_bf16_round_trip_is_exact(shape, data):
    values = data.draw(hnp.arrays(np.float32, shape, elements=st.floats(width=32, allow_nan=True, allow_infinity=True)))
    source = torch.from_numpy(values).to(torch.bfloat16)
    raw = codecs.encode(spec("bf16", shape[1:]), source)
    decoded = codecs.decode_torch(spec("bf16", shape[1:]), raw)
    assert decoded.dtype == torch.bfloat16
    # Bit-exact, NaN and infinities included.
    assert torch.equal(decoded.view(torch.int16), source.view(torch.int16))
    as_float = codecs.decode_numpy(spec("bf16", shape[1:]), raw)
    np.testing.assert_array_equal(as_float, source.float().numpy())


@settings(max_examples=60, deadline=None)
@given(shape=shapes, data=st.data())
def test_numpy_float32_to_bf16_matches_torch_rounding(shape, data):
    values = data.draw(hnp.arrays(np.float32, shape, elements=finite_floats))
    ours = codecs.float32_to_bf16_bits(values)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)


@settings(max_examples=80, deadline=None)
@given(shape=shapes, data=st.data())
def test_fp8_round_trip_within_bound(shape, data):
    """Bound: |x' - x| <= |x| * (2^-4 + 2^-7) + s * 2^-9, s = row amax / 448.

    2^-4 is half an e4m3 ulp for normal values, 2^-7 covers the bf16 rounding of the decoded value,
    and s * 2^-9 the subnormal spacing for values far below the row maximum."""
    values = data.draw(hnp.arrays(np.float32, shape, elements=finite_floats))
    feature = spec("fp8_e4m3", shape[1:])
    raw = codecs.encode(feature, values)
    assert raw["x"].dtype == np.uint8 and raw["x.scale"].shape == shape[:-1]
    decoded = codecs.decode_torch(feature, raw).float().numpy()
    scale = np.abs(values).max(axis=-1, keepdims=True) / 448.0 if shape[-1] else 0
    bound = np.abs(values) * (2**-4 + 2**-7) + scale * 2**-9 + 1e-30
    assert np.all(np.abs(decoded - values) <= bound)
    # The numpy decoder (no torch) agrees up to the bf16 rounding of the torch path.
    as_numpy = codecs.decode_numpy(feature, raw)
    np.testing.assert_allclose(as_numpy, decoded, rtol=2**-7, atol=1e-30)


def test_fp8_table_matches_torch():
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(np.isnan(codecs.FP8_E4M3_VALUES), np.isnan(every))
    finite = ~np.isnan(every)
    np.testing.assert_array_equal(codecs.FP8_E4M3_VALUES[finite], every[finite])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_fp8_refuses_non_finite(bad):
    values = np.ones((2, 4), np.float32)
    values[1, 2] = bad
    with pytest.raises(CodecError, match="fp8_e4m3 cannot store NaN or infinity"):
        codecs.encode(spec("fp8_e4m3", (4,)), values)


def test_fp8_zero_rows_decode_to_zero():
    raw = codecs.encode(spec("fp8_e4m3", (3, 5)), np.zeros((2, 3, 5), np.float32))
    assert np.all(raw["x.scale"] == 1.0)
    assert np.all(codecs.decode_numpy(spec("fp8_e4m3", (3, 5)), raw) == 0)


def test_wrong_shape_is_refused_with_the_feature_name():
    with pytest.raises(CodecError, match=r"feature 'x': expected per-token shape \(4,\), got \(5,\)"):
        codecs.encode(spec("bf16", (4,)), np.zeros((3, 5), np.float32))


def test_int32_and_float32_pass_through():
    ids = np.arange(12, dtype=np.int64).reshape(3, 4)
    raw = codecs.encode(spec("int32", (4,)), ids)
    assert raw["x"].dtype == np.int32
    assert torch.equal(codecs.decode_torch(spec("int32", (4,)), raw), torch.from_numpy(ids).int())
    values = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_array_equal(codecs.decode_numpy(spec("float32", (4,)), codecs.encode(spec("float32", (4,)), values)), values)


def test_a_codec_missing_a_method_is_refused_when_registered() -> None:
    from hsstore.format.registry import FeatureCodec, codec_for, register_codec

    class HalfCodec(FeatureCodec):  # encodes, cannot decode
        name = "half_done"
        storage_dtype = "uint16"
        logical_dtype = "bfloat16"

        def encode_numpy(self, spec, values):  # noqa: ANN001, ANN202
            return {spec.name: values}

        def encode_torch(self, spec, tensor):  # noqa: ANN001, ANN202
            return {spec.name: tensor}

    with pytest.raises(TypeError, match="decode_numpy"):
        register_codec(HalfCodec)
    with pytest.raises(CodecError, match="half_done"):
        codec_for("half_done")
