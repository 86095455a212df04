"""``hsstore export-features``: a store's samples in SpecForge's and speculators' offline layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hsstore
from pipelines.cli import main
from pipelines.export.features import FeatureExportError, export_features, parse_sample_selection
from pipelines.export.peer_layouts import (
    read_specforge_sample,
    read_speculators_sample,
    specforge_sample_path,
    speculators_sample_path,
)
from pipelines.train.target_heads import load_target_heads
from tests.support.stores import write_store


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (bf16 compared as its uint16 bits, so NaNs and -0.0 count too)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bfloat16:
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    return torch.equal(a, b)


@pytest.mark.parametrize("codec", ["bf16", "fp8_e4m3"])
def test_specforge_round_trip_is_bit_exact(tmp_path: Path, codec: str) -> None:
    """store -> SpecForge files -> read back equals what the store decodes, bit for bit, for every
    sample (several shards, so blocks break at shard edges)."""
    url = str(tmp_path / "store")
    write_store(url, num_samples=9, shard_max_tokens=120, codec=codec)
    store = hsstore.open_store(url)
    assert len(store.shards) > 1
    summary = export_features(url, tmp_path / "sf", "specforge", progress=False)
    assert summary.num_samples == 9 and summary.num_tokens == store.num_tokens
    num_layers = store.features["aux_hidden_states"].shape[0]
    for index in range(store.num_samples):
        expected = store.read_sample(index)
        got = read_specforge_sample(tmp_path / "sf" / specforge_sample_path(index), num_layers)
        assert torch.equal(got["input_ids"], expected["input_ids"].to(torch.int64))
        assert torch.equal(got["loss_mask"], expected["loss_mask"].to(torch.int64))
        assert _bits_equal(got["aux_hidden_states"], expected["aux_hidden_states"])
        assert _bits_equal(got["final_hidden_state"], expected["final_hidden_state"])
    index = json.loads((tmp_path / "sf" / "hsstore-export.json").read_text())
    assert [f["sample_id"] for f in index["files"]] == store.samples.column("sample_id").to_pylist()


def test_specforge_files_are_their_own_storage(tmp_path: Path) -> None:
    """A file holds its sample's bytes only (torch.save of a view would carry the whole block)."""
    url = str(tmp_path / "store")
    write_store(url, num_samples=6, shard_max_tokens=10_000)
    summary = export_features(url, tmp_path / "sf", "specforge", progress=False)
    store = hsstore.open_store(url)
    per_token = sum(2 * store.features[name].values_per_token for name in ("aux_hidden_states", "final_hidden_state"))
    # payload + input_ids/loss_mask (16 B/token) + torch.save's zip overhead (a few KB per file)
    assert summary.bytes_written < store.num_tokens * (per_token + 16) + 6 * 8192


def test_selection_limit_and_samples(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    write_store(url, num_samples=8, shard_max_tokens=100)
    store = hsstore.open_store(url)
    assert parse_sample_selection("5,0-2", store) == [5, 0, 1, 2]
    ids = store.samples.column("sample_id").to_pylist()
    (tmp_path / "ids.txt").write_text(f"{ids[7]}\n{ids[3]}\n")
    assert parse_sample_selection(f"@{tmp_path / 'ids.txt'}", store) == [7, 3]
    with pytest.raises(FeatureExportError, match="index 99 outside"):
        parse_sample_selection("99", store)
    with pytest.raises(FeatureExportError, match="neither an index nor a range"):
        parse_sample_selection("a-b", store)
    export_features(url, tmp_path / "sf", "specforge", samples=[5, 0, 1, 2], limit=3, progress=False)
    files = sorted(p.name for p in (tmp_path / "sf").rglob("*.ckpt"))
    assert files == ["data_0.ckpt", "data_1.ckpt", "data_2.ckpt"]
    got = read_specforge_sample(tmp_path / "sf" / specforge_sample_path(0), 3)
    assert torch.equal(got["input_ids"], store.read_sample(5)["input_ids"].to(torch.int64))


def test_refusals(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    write_store(url, num_samples=2)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(FeatureExportError, match="not empty"):
        export_features(url, tmp_path / "busy", "specforge", progress=False)
    with pytest.raises(FeatureExportError, match="unknown feature format"):
        export_features(url, tmp_path / "o", "eagle", progress=False)
    with pytest.raises(FeatureExportError, match="needs --target"):
        export_features(url, tmp_path / "o2", "speculators", progress=False)


@pytest.mark.slow
def test_reference_store_cli_both_formats(tmp_path: Path, reference_store: str, reference_target: Path) -> None:
    """The CLI on real features: SpecForge files bit-exact; speculators' pre-norm slot maps back
    to the stored post-norm state through the target's own final norm (to bf16 rounding), and the
    datasets folder speculators loads has the ids and masks."""
    out = tmp_path / "sf"
    assert main(["export-features", reference_store, "--format", "specforge", "--out", str(out), "--limit", "4", "--no-progress"]) == 0
    store = hsstore.open_store(reference_store)
    got = read_specforge_sample(out / specforge_sample_path(3), 3)
    assert _bits_equal(got["aux_hidden_states"], store.read_sample(3)["aux_hidden_states"])
    readme = (out / "README.md").read_text()
    assert "[2, 4, 5]" in readme and "[1, 3, 4]" in readme  # both numberings of the aux layers

    spec_out = tmp_path / "spec"
    argv = ["export-features", reference_store, "--format", "speculators", "--out", str(spec_out),
            "--samples", "2,0", "--target", str(reference_target), "--no-progress"]
    assert main(argv) == 0
    heads = load_target_heads(reference_target)
    for file_index, store_index in enumerate([2, 0]):
        expected = store.read_sample(store_index)
        hs = read_speculators_sample(spec_out / speculators_sample_path(file_index))
        assert torch.equal(hs["token_ids"], expected["input_ids"].to(torch.int64))
        assert _bits_equal(hs["hidden_states"][:, :3], expected["aux_hidden_states"])
        renormed = heads.apply_norm(hs["hidden_states"][:, 3].float()).float()
        want = expected["final_hidden_state"].float()
        rel = (renormed - want).norm() / want.norm()
        assert rel < 1e-2, rel  # two bf16 roundings
    datasets = pytest.importorskip("datasets")
    dataset = datasets.load_from_disk(str(spec_out))
    assert len(dataset) == 2
    assert torch.equal(dataset[0]["input_ids"], store.read_sample(2)["input_ids"].to(torch.int64))
    assert int(dataset[1]["seq_len"]) == int(store.read_sample(0)["input_ids"].numel())
