"""The store contract a backend must keep: :class:`StoreTests` (see :mod:`hsstore.testing`)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import hsstore
from hsstore.errors import ManifestError, StoreNotFoundError, StoreWriteError
from hsstore.format import codecs
from hsstore.format.features import Compression
from hsstore.storage import StoreLocation
from hsstore.testing.backend import BackendTests
from hsstore.testing.samples import (
    make_lineage,
    make_sample,
    make_specs,
    stored_values,
    write_samples,
)


class StoreTests(BackendTests):
    """Everything a store on the backend of the ``location`` fixture must do: the byte-level
    operations (:class:`~hsstore.testing.backend.BackendTests`), then whole stores written, committed,
    raced over and read back through them."""

    # Uncompressed (read by ranges straight into the batch) and compressed with a codec's extra array.
    @pytest.mark.parametrize("codec,compression", [("bf16", "none"), ("fp8_e4m3", "zstd")])
    def test_samples_read_back_as_written(self, location: StoreLocation, codec: str, compression: Compression) -> None:
        samples = write_samples(location, 14, codec=codec, compression=compression)
        store = hsstore.open_store(location)
        assert (store.num_samples, store.num_tokens) == (14, sum(len(s["input_ids"]) for s in samples))
        assert len(store.shards) > 1, "the test should span several shards"
        for index, sample in enumerate(samples):
            got = store.read_sample(index, as_numpy=True)
            assert (got["sample_id"], got["source_id"]) == (sample["sample_id"], sample["source_id"])
            np.testing.assert_array_equal(got["input_ids"], sample["input_ids"])
            np.testing.assert_array_equal(got["loss_mask"], sample["loss_mask"].astype(bool))
            for name, values in sample["features"].items():
                np.testing.assert_array_equal(got[name], stored_values(store.features[name], values))
        assert store.verify() == []

    def test_token_ranges_cross_chunks_and_files(self, location: StoreLocation) -> None:
        samples = write_samples(location, 10, shard_max_tokens=10_000)
        store = hsstore.open_store(location)
        (shard,) = store.shards
        stop = shard.num_tokens - 3
        raw = store.read_token_range(shard.shard_id, 5, stop, ["aux_hidden_states", "input_ids"])
        np.testing.assert_array_equal(raw["input_ids"], np.concatenate([s["input_ids"] for s in samples])[5:stop])
        spec = store.features["aux_hidden_states"]
        written = np.concatenate([s["features"]["aux_hidden_states"] for s in samples])
        np.testing.assert_array_equal(codecs.decode_numpy(spec, raw), stored_values(spec, written)[5:stop])
        with pytest.raises(IndexError, match="outside shard"):
            store.read_token_range(shard.shard_id, 0, shard.num_tokens + 1)

    def test_empty_and_one_token_samples(self, location: StoreLocation) -> None:
        with hsstore.StoreWriter(location, make_specs(), make_lineage()) as writer:
            for index, length in enumerate([0, 1, 0, 1]):
                writer.add_sample(**make_sample(index, length))
        store = hsstore.open_store(location)
        assert (store.num_samples, store.num_tokens) == (4, 2)
        assert store.read_sample(0, as_numpy=True)["aux_hidden_states"].shape == (0, 3, 16)
        assert store.read_sample(1, as_numpy=True)["final_hidden_state"].shape == (1, 16)
        assert store.verify() == []

    def test_a_missing_store_is_a_clear_error(self, location: StoreLocation) -> None:
        with pytest.raises(StoreNotFoundError, match=r"no committed store here \(manifest.json not found\)"):
            hsstore.open_store(location)
        assert hsstore.committed_shard_ids(location) == set()

    def test_shards_are_invisible_until_committed_and_commits_are_idempotent(self, location: StoreLocation) -> None:
        specs, lineage = make_specs(), make_lineage()
        records = [self._write_shard(location, unit) for unit in range(3)]
        with pytest.raises(StoreNotFoundError):
            hsstore.open_store(location)
        hsstore.commit_shards(location, records[:2], features=specs, lineage=lineage)
        assert hsstore.committed_shard_ids(location) == {"unit-000", "unit-001"}
        # A retried unit writes a second attempt; committing it again changes nothing.
        retry = hsstore.ShardWriter(location, "unit-001", specs)
        retry.add_sample(**make_sample(99, 3))
        manifest = hsstore.commit_shards(location, [retry.finish(), records[2]], features=specs, lineage=lineage)
        assert [s.shard_id for s in manifest.shards] == ["unit-000", "unit-001", "unit-002"]
        store = hsstore.open_store(location)
        assert sorted(store.samples.column("sample_id").to_pylist()) == [f"sample-{i:05d}" for i in range(12)]
        problems = hsstore.verify_store(location)
        assert problems and all(not p.fatal and p.kind == "unreferenced" for p in problems)

    def test_racing_committers_lose_nothing(self, location: StoreLocation) -> None:
        """Three committers in threads, each shard id written by two of them: the first attempt of
        each id is committed, none is lost, whatever the backend's guard (lock or conditional PUT)."""
        specs, lineage = make_specs(), make_lineage()
        hsstore.ensure_store(location, features=specs, lineage=lineage)
        plans = [[0, 1, 2], [1, 2, 3], [3, 0]]
        errors: list[BaseException] = []

        def committer(units: list[int]) -> None:
            try:
                for unit in units:
                    hsstore.commit_shards(location, [self._write_shard(location, unit)], features=specs, lineage=lineage)
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

        threads = [threading.Thread(target=committer, args=(plan,)) for plan in plans]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        store = hsstore.open_store(location)
        assert [s.shard_id for s in store.shards] == [f"unit-{u:03d}" for u in range(4)]
        assert sorted(store.samples.column("sample_id").to_pylist()) == [f"sample-{i:05d}" for i in range(16)]
        assert [p for p in hsstore.verify_store(location) if p.fatal] == []

    def test_a_commit_of_another_contract_is_refused(self, location: StoreLocation) -> None:
        write_samples(location, 2)
        record = self._write_shard(location, 7)
        other_lineage = make_lineage().model_copy(update={"aux_layer_ids": [1, 2, 3]})
        with pytest.raises(ManifestError, match="lineage field 'aux_layer_ids' differs"):
            hsstore.commit_shards(location, [record], features=make_specs(), lineage=other_lineage)
        with pytest.raises(ManifestError, match="features differ"):
            hsstore.commit_shards(location, [record], features=make_specs(codec="fp8_e4m3"), lineage=make_lineage())

    def test_the_writer_refuses_bad_samples(self, location: StoreLocation) -> None:
        writer = hsstore.ShardWriter(location, "w", make_specs())
        sample = make_sample(0, 5)
        with pytest.raises(StoreWriteError, match="sample sample-00000: loss_mask has 4 tokens, input_ids 5"):
            writer.add_sample(**{**sample, "loss_mask": sample["loss_mask"][:4]})
        with pytest.raises(StoreWriteError, match=r"missing \['final_hidden_state'\]"):
            writer.add_sample(**{**sample, "features": {"aux_hidden_states": sample["features"]["aux_hidden_states"]}})
        writer.add_sample(**sample)
        with pytest.raises(StoreWriteError, match="duplicate sample_id 'sample-00000'"):
            writer.add_sample(**sample)
        writer.abort()
        assert location.list_files("shards") == []

    def test_a_failed_block_commits_nothing_new(self, location: StoreLocation) -> None:
        write_samples(location, 3, shard_max_tokens=10_000)
        before = hsstore.open_store(location).manifest
        with pytest.raises(RuntimeError, match="boom"), hsstore.StoreWriter(location, make_specs(), make_lineage(), shard_prefix="b") as writer:
            writer.add_sample(**make_sample(50, 4))
            raise RuntimeError("boom")
        assert hsstore.open_store(location).manifest.shards == before.shards

    @staticmethod
    def _write_shard(location: StoreLocation, unit: int) -> hsstore.ShardRecord:
        """Shard ``unit-<unit>``: samples ``4 * unit`` to ``4 * unit + 3``, 7 tokens each, not committed."""
        writer = hsstore.ShardWriter(location, f"unit-{unit:03d}", make_specs())
        for index in range(unit * 4, unit * 4 + 4):
            writer.add_sample(**make_sample(index, 7))
        return writer.finish()
