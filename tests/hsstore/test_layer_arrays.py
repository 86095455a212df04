"""A superset of aux layers in one store, read layer by layer (issue 15): ``layer_arrays`` writes one
Zarr array per layer, and a reader of some layers opens and reads only theirs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import hsstore
from hsstore import FeatureSpec
from hsstore.aux_layers import select_aux_layers
from hsstore.errors import AuxLayerError
from hsstore.loader import LoaderError
from tests.support.stores import make_lineage

HIDDEN = 16
NUM_LAYERS = 6
CAPTURED = [1, 2, 3, 4, 5, 6]


def _write(path: Path, *, layer_arrays: bool, codec: str = "bf16", compression: str = "none", layers: list[int] | None = None) -> None:
    chosen = list(range(NUM_LAYERS)) if layers is None else layers
    specs = [
        FeatureSpec(name="aux_hidden_states", shape=(len(chosen), HIDDEN), codec=codec, compression=compression, chunk_tokens=16, layer_arrays=layer_arrays),
        FeatureSpec(name="final_hidden_state", shape=(HIDDEN,), codec=codec, chunk_tokens=16),
    ]
    rng = np.random.default_rng(7)
    lineage = make_lineage().model_copy(update={"aux_layer_ids": [CAPTURED[i] for i in chosen]})
    with hsstore.StoreWriter(str(path), specs, lineage, shard_max_tokens=120) as writer:
        for i in range(10):
            n = int(rng.integers(8, 50))
            aux = np.random.default_rng(i).standard_normal((n, NUM_LAYERS, HIDDEN)).astype(np.float32)
            writer.add_sample(
                sample_id=f"s{i}", source_id=f"r{i}", input_ids=np.arange(n, dtype=np.int32), loss_mask=np.ones(n, np.uint8),
                features={"aux_hidden_states": aux[:, chosen], "final_hidden_state": aux[:, 0] * 2},
            )


@pytest.mark.parametrize(("codec", "compression"), [("bf16", "none"), ("fp8_e4m3", "zstd")])
def test_layer_arrays_hold_the_same_bits_and_a_subset_reads_only_its_arrays(tmp_path: Path, codec: str, compression: str) -> None:
    _write(tmp_path / "whole", layer_arrays=False, codec=codec, compression=compression)
    _write(tmp_path / "split", layer_arrays=True, codec=codec, compression=compression)
    whole, split = hsstore.open_store(str(tmp_path / "whole")), hsstore.open_store(str(tmp_path / "split"))
    assert hsstore.verify_store(split.location) == []
    files = {f.path.split("/features.zarr/")[1].split("/")[0] for f in split.shards[0].files if "/features.zarr/" in f.path}
    expected = {f"aux_hidden_states.{i}" for i in range(NUM_LAYERS)}
    if codec == "fp8_e4m3":
        expected |= {f"aux_hidden_states.{i}.scale" for i in range(NUM_LAYERS)}
    assert expected <= files and "aux_hidden_states" not in files
    for shard in whole.shards:
        a = whole.read_token_range(shard.shard_id, 0, shard.num_tokens)
        b = split.read_token_range(shard.shard_id, 0, shard.num_tokens)
        assert set(a) == set(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    chosen = {"aux_hidden_states": [4, 1, 2]}
    split = hsstore.open_store(str(tmp_path / "split"))  # nothing opened yet
    shard = split.shards[-1]
    subset = split.read_token_range(shard.shard_id, 3, shard.num_tokens - 2, ["aux_hidden_states"], layers=chosen)
    full = whole.read_token_range(shard.shard_id, 3, shard.num_tokens - 2, ["aux_hidden_states"])
    for key in full:
        np.testing.assert_array_equal(subset[key], full[key][:, [4, 1, 2]])
    opened = {name for (sid, name) in split._arrays if sid == shard.shard_id}
    wanted = {f"aux_hidden_states.{i}" for i in (4, 1, 2)}
    assert {name.removesuffix(".scale") for name in opened if name.startswith("aux")} == wanted
    # Decoding takes the spec of what was read.
    sample = split.read_sample(0, ["aux_hidden_states"], as_numpy=True, layers=chosen)
    reference = whole.read_sample(0, ["aux_hidden_states"], as_numpy=True)
    np.testing.assert_array_equal(sample["aux_hidden_states"], reference["aux_hidden_states"][:, [4, 1, 2]])


def test_the_loader_reads_a_layer_subset_from_either_layout(tmp_path: Path) -> None:
    _write(tmp_path / "whole", layer_arrays=False)
    _write(tmp_path / "split", layer_arrays=True)
    _write(tmp_path / "three", layer_arrays=False, layers=[0, 2, 5])
    settings = {"token_budget": 96, "shuffle_window": 4, "seed": 1}
    features = ["aux_hidden_states", "final_hidden_state"]
    chosen = {"aux_hidden_states": [0, 2, 5]}
    runs = [
        list(hsstore.StreamingLoader(str(tmp_path / name), features, layers=layers, **settings).batches(max_epochs=1))
        for name, layers in (("whole", chosen), ("split", chosen), ("three", None))
    ]
    assert len(runs[0]) > 1
    for a, b, c in zip(*runs, strict=True):
        assert a.features["aux_hidden_states"].shape[2] == 3
        for key in a.features:
            np.testing.assert_array_equal(a.features[key], b.features[key])
            np.testing.assert_array_equal(a.features[key], c.features[key])
        assert a.bytes_read == c.bytes_read  # the share of 3 layers, not 6
    with pytest.raises(LoaderError, match=r"layer indices \[6\] outside \[0, 6\)"):
        hsstore.StreamingLoader(str(tmp_path / "split"), features, layers={"aux_hidden_states": [6]}, **settings)


def test_select_aux_layers_names_the_available_ids() -> None:
    assert select_aux_layers(CAPTURED, [2, 4, 5]) == [1, 3, 4]
    assert select_aux_layers(CAPTURED, None) == list(range(6))
    with pytest.raises(AuxLayerError, match=r"aux_layer_ids \[7\] are not in the store.*\[1, 2, 3, 4, 5, 6\]"):
        select_aux_layers(CAPTURED, [2, 7])
    with pytest.raises(AuxLayerError, match="repeats"):
        select_aux_layers(CAPTURED, [2, 2])


def test_layer_arrays_needs_a_leading_axis() -> None:
    with pytest.raises(ValueError, match="layer_arrays splits the leading axis"):
        FeatureSpec(name="final_hidden_state", shape=(HIDDEN,), layer_arrays=True)
