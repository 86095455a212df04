"""The store contract, run against every backend: local paths, file:// and memory://."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import fsspec
import numpy as np
import pytest
import torch

import hsstore
from hsstore import ManifestError, StoreNotFoundError, StoreWriteError
from tests.factories import make_lineage, make_sample, make_specs, write_store


@pytest.fixture(params=["local", "file", "memory"])
def store_url(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "store")
    elif request.param == "file":
        yield f"file://{tmp_path}/store"
    else:
        url = f"memory://hsstore-test-{uuid.uuid4().hex}"
        yield url
        memory = fsspec.filesystem("memory")
        if memory.exists(url):
            memory.rm(url, recursive=True)


class TestStoreContract:
    @pytest.mark.parametrize("codec,compression", [("bf16", "none"), ("bf16", "zstd"), ("fp8_e4m3", "blosc"), ("fp8_e4m3", "zstd")])
    def test_round_trip(self, store_url, codec, compression):
        samples = write_store(store_url, num_samples=14, codec=codec, compression=compression)
        store = hsstore.open_store(store_url)
        assert store.num_samples == 14
        assert store.num_tokens == sum(len(s["input_ids"]) for s in samples)
        assert len(store.shards) > 1, "the test should span several shards"
        assert store.samples.num_rows == 14
        for index, sample in enumerate(samples):
            got = store.read_sample(index)
            assert got["sample_id"] == sample["sample_id"] and got["source_id"] == sample["source_id"]
            np.testing.assert_array_equal(got["input_ids"].numpy(), sample["input_ids"])
            np.testing.assert_array_equal(got["loss_mask"].numpy(), sample["loss_mask"].astype(bool))
            for name, values in sample["features"].items():
                assert got[name].dtype == torch.bfloat16
                assert got[name].shape == values.shape
                expected = torch.from_numpy(values).to(torch.bfloat16).float()
                if codec == "bf16":
                    assert torch.equal(got[name].float(), expected)
                else:
                    tolerance = np.abs(values).max(axis=-1, keepdims=True) * 2**-4 + 1e-6
                    assert np.all(np.abs(got[name].float().numpy() - values) <= tolerance + np.abs(values) * 2**-6)
        assert store.verify() == []

    def test_numpy_reads_need_no_torch_types(self, store_url):
        samples = write_store(store_url, num_samples=3)
        got = hsstore.open_store(store_url).read_sample(2, as_numpy=True)
        assert isinstance(got["aux_hidden_states"], np.ndarray) and got["aux_hidden_states"].dtype == np.float32
        expected = torch.from_numpy(samples[2]["features"]["aux_hidden_states"]).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(got["aux_hidden_states"], expected)

    def test_token_range_reads_cross_chunks(self, store_url):
        samples = write_store(store_url, num_samples=10, shard_max_tokens=10_000)
        store = hsstore.open_store(store_url)
        assert len(store.shards) == 1
        shard = store.shards[0]
        raw = store.read_token_range(shard.shard_id, 5, shard.num_tokens - 3, ["aux_hidden_states", "input_ids"])
        assert raw["aux_hidden_states"].dtype == np.uint16
        all_ids = np.concatenate([s["input_ids"] for s in samples])
        np.testing.assert_array_equal(raw["input_ids"], all_ids[5 : shard.num_tokens - 3])
        all_aux = np.concatenate([s["features"]["aux_hidden_states"] for s in samples])
        decoded = hsstore.format.codecs.decode_numpy(store.features["aux_hidden_states"], raw)
        expected = torch.from_numpy(all_aux[5 : shard.num_tokens - 3]).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(decoded, expected)
        with pytest.raises(IndexError, match="outside shard"):
            store.read_token_range(shard.shard_id, 0, shard.num_tokens + 1)

    def test_empty_and_one_token_samples(self, store_url):
        specs, lineage = make_specs(), make_lineage()
        with hsstore.StoreWriter(store_url, specs, lineage) as writer:
            for index, length in enumerate([0, 1, 0, 1]):
                writer.add_sample(**make_sample(index, length))
        store = hsstore.open_store(store_url)
        assert (store.num_samples, store.num_tokens) == (4, 2)
        assert store.read_sample(0)["aux_hidden_states"].shape == (0, 3, 16)
        assert store.read_sample(1)["final_hidden_state"].shape == (1, 16)
        assert store.verify() == []

    def test_missing_store_is_a_clear_error(self, store_url):
        with pytest.raises(StoreNotFoundError, match="no committed store here"):
            hsstore.open_store(store_url)

    def test_distributed_writers_and_idempotent_commit(self, store_url):
        specs, lineage = make_specs(), make_lineage()
        records = []
        for unit in range(3):
            writer = hsstore.ShardWriter(store_url, f"unit-{unit:03d}", specs)
            for index in range(unit * 4, unit * 4 + 4):
                writer.add_sample(**make_sample(index, 7))
            records.append(writer.finish())
        # Invisible until committed.
        with pytest.raises(StoreNotFoundError):
            hsstore.open_store(store_url)
        hsstore.commit_shards(store_url, records[:2], features=specs, lineage=lineage)
        assert hsstore.committed_shard_ids(store_url) == {"unit-000", "unit-001"}
        # A retried unit writes a second attempt; committing it again changes nothing.
        retry = hsstore.ShardWriter(store_url, "unit-001", specs)
        retry.add_sample(**make_sample(99, 3))
        manifest = hsstore.commit_shards(store_url, [retry.finish(), records[2]], features=specs, lineage=lineage)
        assert [s.shard_id for s in manifest.shards] == ["unit-000", "unit-001", "unit-002"]
        store = hsstore.open_store(store_url)
        assert store.num_samples == 12
        assert sorted(store.samples.column("sample_id").to_pylist()) == [f"sample-{i:05d}" for i in range(12)]
        problems = hsstore.verify_store(store.location)
        assert problems and all(not p.fatal and p.kind == "unreferenced" for p in problems)

    def test_commit_refuses_another_contract(self, store_url):
        write_store(store_url, num_samples=2)
        writer = hsstore.ShardWriter(store_url, "other", make_specs())
        writer.add_sample(**make_sample(0, 3))
        record = writer.finish()
        with pytest.raises(ManifestError, match="lineage field 'aux_layer_ids' differs"):
            hsstore.commit_shards(store_url, [record], features=make_specs(), lineage=make_lineage().model_copy(update={"aux_layer_ids": [1, 2, 3]}))
        with pytest.raises(ManifestError, match="features differ"):
            hsstore.commit_shards(store_url, [record], features=make_specs(codec="fp8_e4m3"), lineage=make_lineage())

    def test_writer_refuses_bad_samples(self, store_url):
        writer = hsstore.ShardWriter(store_url, "w", make_specs())
        sample = make_sample(0, 5)
        with pytest.raises(StoreWriteError, match="sample sample-00000: loss_mask has 4 tokens, input_ids 5"):
            writer.add_sample(**{**sample, "loss_mask": sample["loss_mask"][:4]})
        with pytest.raises(StoreWriteError, match=r"missing \['final_hidden_state'\]"):
            writer.add_sample(**{**sample, "features": {"aux_hidden_states": sample["features"]["aux_hidden_states"]}})
        writer.add_sample(**sample)
        with pytest.raises(StoreWriteError, match="duplicate sample_id 'sample-00000'"):
            writer.add_sample(**sample)
        writer.abort()

    def test_failed_block_commits_nothing_new(self, store_url):
        write_store(store_url, num_samples=3, shard_max_tokens=10_000)
        before = hsstore.open_store(store_url).manifest
        with pytest.raises(RuntimeError, match="boom"), hsstore.StoreWriter(store_url, make_specs(), make_lineage(), shard_prefix="b") as writer:
            writer.add_sample(**make_sample(50, 4))
            raise RuntimeError("boom")
        after = hsstore.open_store(store_url).manifest
        assert after.shards == before.shards


def test_import_is_light():
    code = "import sys, hsstore; print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_info_reports_bytes_per_token(tmp_path):
    url = str(tmp_path / "store")
    write_store(url, num_samples=6, codec="fp8_e4m3", compression="zstd")
    info = hsstore.open_store(url).info()
    for key in ("num_samples", "num_tokens", "bytes_per_token", "features", "lineage"):
        assert key in info
    assert info["features"]["aux_hidden_states"]["codec"] == "fp8_e4m3"
    total = sum(f["bytes"] for f in info["features"].values()) + info["sample_table_bytes"] + info["metadata_bytes"]
    assert total == info["bytes_on_disk"]
    assert info["bytes_per_token"] == pytest.approx(info["bytes_on_disk"] / info["num_tokens"], rel=1e-3)
    assert json.loads(json.dumps(info)) == info
