"""tests/support/s3.py's frozen endpoint: a store written to one moto process, then served by
several forked read-only processes, reads back exactly; the requests of all of them are counted
together; and a write after the freeze is refused with a message that says why."""

from __future__ import annotations

import hashlib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hsstore
from hsstore import FeatureSpec
from tests.support.stores import make_lineage, make_sample

pytest.importorskip("s3fs")
pytest.importorskip("moto")

FEATURES = ["aux_hidden_states", "final_hidden_state"]


def _epoch(store: str) -> list[dict[str, Any]]:
    loader = hsstore.StreamingLoader(store, FEATURES, token_budget=256, read_threads=4, shuffle_window=64, seed=0)
    return [{"input_ids": b.input_ids.copy(), **{k: v.copy() for k, v in b.features.items()}} for b in loader.batches(max_epochs=1)]


def test_a_frozen_endpoint_of_three_processes_serves_the_store_and_counts_every_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    from tests.support.s3 import MotoS3, upload

    local = tmp_path / "store"
    specs = [FeatureSpec(name="aux_hidden_states", shape=(3, 16), chunk_tokens=16), FeatureSpec(name="final_hidden_state", shape=(16,), chunk_tokens=16)]
    rng = np.random.default_rng(0)
    with hsstore.StoreWriter(str(local), specs, make_lineage(), shard_max_tokens=150) as writer:
        for i in range(30):
            writer.add_sample(**make_sample(i, int(rng.integers(5, 60))))
    # s3fs caches its filesystems by their arguments, not by the environment's endpoint: this
    # test's server must not outlive it in that cache (other modules run servers of their own).
    monkeypatch.setattr(s3fs.S3FileSystem, "_cache", {})
    with MotoS3(processes=3) as s3:
        for key, value in s3.environ().items():
            monkeypatch.setenv(key, value)
        upload(local, "s3://frozen/store")
        s3.freeze()
        s3.requests(reset=True)
        single = _epoch(str(local))
        got = _epoch("s3://frozen/store")
        counted = s3.requests(reset=True)
        assert len(got) == len(single) > 1
        for want_batch, got_batch in zip(single, got, strict=True):
            assert want_batch.keys() == got_batch.keys()
            for name in want_batch:
                np.testing.assert_array_equal(got_batch[name], want_batch[name])
        # Every ranged GET is counted, whichever process answered it: at least one per sample
        # range and array, with the shard files' other reads besides.
        assert counted["GET_ranged"] >= 2 * len(hsstore.open_store(str(local)).shards)
        assert counted["GET"] >= counted["GET_ranged"]

        request = urllib.request.Request(f"{s3.endpoint}/frozen/late-object", data=b"x", method="PUT")
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(request, timeout=10)
        assert http.value.code == 405
        assert "frozen into several read-only processes" in http.value.read().decode()
        assert not s3fs.S3FileSystem(skip_instance_cache=True).exists("frozen/late-object")
        group = s3.process.pid if s3.process else 0
    with pytest.raises(ProcessLookupError):  # stop() ended the forked processes too
        _wait_for_group_to_end(group)


def _wait_for_group_to_end(group: int) -> None:
    import os
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        os.killpg(group, 0)  # raises ProcessLookupError once no process of the group is left
        time.sleep(0.05)


def test_an_added_latency_delays_each_request_and_requests_on_other_connections_wait_together() -> None:
    import time
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from tests.support.s3 import MotoS3

    with MotoS3(latency_ms=200) as s3:
        def head_bucket_list() -> float:
            started = time.perf_counter()
            with urllib.request.urlopen(f"{s3.endpoint}/", timeout=10) as response:  # ListBuckets
                response.read()
            return time.perf_counter() - started

        assert head_bucket_list() >= 0.2
        started = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            alone = list(pool.map(lambda _: head_bucket_list(), range(8)))
        assert min(alone) >= 0.2
        assert time.perf_counter() - started < 8 * 0.2 / 2  # the waits overlap, not queue
        assert s3.requests()["GET"] == 9


def test_a_folder_loaded_server_side_reads_as_uploaded_and_the_latency_changes_for_every_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MotoS3.load puts a store's files as upload() does (same keys, same bytes, the bucket made),
    and set_latency after a freeze delays the requests of every forked process."""
    import time
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    import s3fs

    from tests.support.s3 import MotoS3

    local = tmp_path / "store"
    specs = [FeatureSpec(name="aux_hidden_states", shape=(3, 16), chunk_tokens=16), FeatureSpec(name="final_hidden_state", shape=(16,), chunk_tokens=16)]
    with hsstore.StoreWriter(str(local), specs, make_lineage(), shard_max_tokens=150) as writer:
        for i in range(12):
            writer.add_sample(**make_sample(i, 20 + i))
    monkeypatch.setattr(s3fs.S3FileSystem, "_cache", {})
    with MotoS3(processes=2) as s3:
        for key, value in s3.environ().items():
            monkeypatch.setenv(key, value)
        files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
        loaded = s3.load(local, "s3://loaded/deep/store")
        assert loaded == {"files": len(files), "bytes": sum((local / f).stat().st_size for f in files)}
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        assert sorted(p.removeprefix("loaded/deep/store/") for p in fs.find("loaded/deep/store")) == files
        for name in files:
            assert fs.cat_file(f"loaded/deep/store/{name}") == (local / name).read_bytes()
        s3.freeze()
        with pytest.raises(RuntimeError, match=r"load\(\) before freeze\(\)"):
            s3.load(local, "s3://loaded/again")
        fs.invalidate_cache()
        for name in files:  # the ETags (computed by load, before the fork) are each file's md5, as S3's
            etag = fs.info(f"loaded/deep/store/{name}")["ETag"].strip('"')
            assert etag == hashlib.md5((local / name).read_bytes()).hexdigest()

        def list_buckets() -> float:
            started = time.perf_counter()
            with urllib.request.urlopen(f"{s3.endpoint}/", timeout=10) as response:
                response.read()
            return time.perf_counter() - started

        assert max(list_buckets() for _ in range(4)) < 0.15
        s3.set_latency(150)
        with ThreadPoolExecutor(8) as pool:  # whichever process answers waits
            assert min(pool.map(lambda _: list_buckets(), range(16))) >= 0.15
        s3.set_latency(0)
        assert min(list_buckets() for _ in range(4)) < 0.15
        with pytest.raises(ValueError, match="latency_ms must be >= 0, got -1"):
            s3.set_latency(-1)
        for want, got in zip(_epoch(str(local)), _epoch("s3://loaded/deep/store"), strict=True):
            for name in want:
                np.testing.assert_array_equal(got[name], want[name])
