"""codecs.encode_torch: the encoder the extraction worker runs on its GPU before the copy to the host.

Checked against an independent numpy encoder (power-of-two scale from exact float64 arithmetic,
round-to-nearest-even onto the e4m3 value table), on the CPU and, with a GPU, on the device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hsstore import CodecError, FeatureSpec, ShardWriter, open_store
from hsstore.errors import StoreWriteError
from hsstore.format import codecs


def fp8_spec(shape: tuple[int, ...]) -> FeatureSpec:
    return FeatureSpec(name="x", shape=shape, codec="fp8_e4m3")


def numpy_fp8_encode(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reference: scale 2^k, the smallest power of two >= amax / 448 (k >= -126; 1 for zero rows);
    bits: x / scale rounded to the nearest e4m3 value, ties to the even code, sign kept."""
    x = values.astype(np.float64)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    ratio = amax / 448.0
    mantissa, exponent = np.frexp(ratio)  # ratio = m * 2^e, m in [0.5, 1)
    k = np.where(mantissa == 0.5, exponent - 1, exponent)  # smallest 2^k >= ratio
    k = np.maximum(k, -126)
    k = np.where(amax > 0, k, 0)
    scale = np.ldexp(1.0, k)
    y = x / scale
    positive = codecs.FP8_E4M3_VALUES[:0x7F].astype(np.float64)  # codes 0..126, ascending
    magnitude = np.abs(y)
    upper = np.clip(np.searchsorted(positive, magnitude), 1, len(positive) - 1)
    lower = upper - 1
    below, above = magnitude - positive[lower], positive[upper] - magnitude
    code = np.where(below < above, lower, np.where(above < below, upper, np.where(lower % 2 == 0, lower, upper)))
    code = np.where(magnitude >= positive[-1], len(positive) - 1, code)
    bits = code.astype(np.uint8) | np.where(np.signbit(y), 0x80, 0).astype(np.uint8)
    return bits, scale.squeeze(-1).astype(np.float32)


def sample_values(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """bf16 features as the target emits them: rows of very different magnitudes, outlier channels,
    a zero row, and values exactly halfway between two e4m3 values (ties)."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = 2.0 ** torch.randint(-40, 40, (*shape[:-1], 1), generator=generator).float()
    values = torch.randn(*shape, generator=generator) * magnitudes
    values[..., 3] *= 300.0  # outlier channel
    values[0] = 0.0
    # Ties: 448 * 2^0 sets the scale to 1 for row 1; 1.0625 lies halfway between 1.0 and 1.125.
    values[1, ..., 0] = 448.0
    values[1, ..., 1] = 1.0625
    values[1, ..., 2] = -1.1875  # halfway between 1.125 (odd code) and 1.25 (even): rounds to 1.25
    return values.to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(64, 3, 256), (37, 128)])
def test_torch_encoder_matches_the_numpy_reference_on_the_cpu(shape: tuple[int, ...]) -> None:
    values = sample_values(1, shape)
    encoded = codecs.encode_torch(fp8_spec(shape[1:]), values)
    bits, scale = numpy_fp8_encode(values.float().numpy())
    np.testing.assert_array_equal(encoded["x.scale"].numpy(), scale)
    np.testing.assert_array_equal(encoded["x"].numpy(), bits)
    # The same bits as the numpy-facing encoder the writer uses for add_sample.
    np.testing.assert_array_equal(codecs.encode(fp8_spec(shape[1:]), values)["x"], bits)


def test_bf16_bits_are_the_values_bits() -> None:
    values = sample_values(2, (16, 64))
    bits = codecs.encode_torch(FeatureSpec(name="x", shape=(64,)), values)["x"]
    assert bits.dtype == torch.int16
    assert torch.equal(bits, values.view(torch.int16))


def test_non_finite_rows_are_flagged_and_refused_on_the_host() -> None:
    values = torch.ones(4, 8)
    values[2, 5] = float("inf")
    encoded = codecs.encode_torch(fp8_spec((8,)), values)
    scale = encoded["x.scale"].numpy()
    assert np.isnan(scale[2]) and np.isfinite(scale[[0, 1, 3]]).all()
    with pytest.raises(CodecError, match="cannot store NaN or infinity"):
        codecs.check_encoded(fp8_spec((8,)), {k: v.numpy() for k, v in encoded.items()})


def test_shard_writer_takes_encoded_batches(tmp_path) -> None:
    """add_encoded_samples writes what add_sample writes, and refuses arrays that do not fit."""
    features = [fp8_spec((2, 32)), FeatureSpec(name="y", shape=(32,))]
    values_x, values_y = sample_values(3, (30, 2, 32)), sample_values(4, (30, 32))
    rows = [(f"s{i}", f"r{i}", np.arange(n, dtype=np.int32), np.ones(n, np.uint8)) for i, n in enumerate((10, 20))]
    encoded = {**codecs.encode_torch(features[0], values_x), **codecs.encode_torch(features[1], values_y)}
    arrays = {name: (t.numpy().view(np.uint16) if t.dtype == torch.int16 else t.numpy()) for name, t in encoded.items()}
    writers = {}
    for how in ("encoded", "plain"):
        writer = ShardWriter(tmp_path / how, "u000000", features)
        if how == "encoded":
            writer.add_encoded_samples(rows, arrays)
        else:
            offset = 0
            for sample_id, source_id, ids, mask in rows:
                part = slice(offset, offset + len(ids))
                writer.add_sample(sample_id=sample_id, source_id=source_id, input_ids=ids, loss_mask=mask,
                                  features={"x": values_x[part], "y": values_y[part]})
                offset += len(ids)
        writers[how] = writer.finish()
    from hsstore import Lineage, commit_shards

    stores = {}
    for how, record in writers.items():
        commit_shards(str(tmp_path / how), [record], features=features, lineage=Lineage())
        stores[how] = open_store(str(tmp_path / how))
    for index in range(2):
        a, b = stores["encoded"].read_sample(index), stores["plain"].read_sample(index)
        for name in ("x", "y", "input_ids"):
            assert np.array_equal(np.asarray(a[name].view(torch.int16) if a[name].dtype == torch.bfloat16 else a[name]),
                                  np.asarray(b[name].view(torch.int16) if b[name].dtype == torch.bfloat16 else b[name]))

    writer = ShardWriter(tmp_path / "bad", "u000001", features)
    with pytest.raises(StoreWriteError, match=r"encoded arrays must be exactly \['x', 'x.scale', 'y'\]"):
        writer.add_encoded_samples(rows, {"x": arrays["x"]})
    with pytest.raises(StoreWriteError, match=r"encoded array 'y' is uint16 \(29, 32\); expected uint16 \(30, 32\)"):
        writer.add_encoded_samples(rows, {**arrays, "y": arrays["y"][:29]})
    writer.abort()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(512, 3, 4096), (300, 4096)])
def test_gpu_encoder_bits_equal_the_cpu_encoders(shape: tuple[int, ...]) -> None:
    """What the extraction worker stores from the GPU is bit for bit what the CPU encoder stores."""
    values = sample_values(5, shape)
    spec = fp8_spec(shape[1:])
    on_gpu = codecs.encode_torch(spec, values.cuda())
    assert on_gpu["x"].device.type == "cuda"
    on_cpu = codecs.encode(spec, values)
    for name in ("x", "x.scale"):
        np.testing.assert_array_equal(on_gpu[name].cpu().numpy(), on_cpu[name])
    bits, scale = numpy_fp8_encode(values.float().numpy())
    np.testing.assert_array_equal(on_gpu["x"].cpu().numpy(), bits)
    np.testing.assert_array_equal(on_gpu["x.scale"].cpu().numpy(), scale)
