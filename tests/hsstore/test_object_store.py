"""Training reads from object storage (issue 16): the loader on moto's S3 server on loopback.

The server runs in its own process and counts the requests it serves (tests/support/s3.py), so
these tests check what the loader really sends: nothing per shard before the first batch, one
ranged GET per sample and array, nothing of the batches a resumed run has already seen, and no
feature GET at all once a local ReadCache holds the bytes.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hsstore
from hsstore import FeatureSpec
from hsstore.read_cache import ReadCache
from tests.support.paths import REPO_ROOT
from tests.support.stores import make_lineage, make_sample

pytest.importorskip("s3fs")
pytest.importorskip("moto")

FEATURES = ["aux_hidden_states", "final_hidden_state"]
ARRAYS = 2  # bf16: one array per feature


@pytest.fixture
def s3(s3_server: Any) -> Any:
    """The session's S3 endpoint (tests/conftest.py), its request counts reset."""
    s3_server.requests(reset=True)
    return s3_server


@pytest.fixture
def aws_env(s3: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The standard AWS environment pointing at the loopback server, as s3fs reads it."""
    for key, value in s3.environ().items():
        monkeypatch.setenv(key, value)
    return s3


def _write_local(path: Path, num_samples: int = 24) -> None:
    rng = np.random.default_rng(3)
    specs = [
        FeatureSpec(name="aux_hidden_states", shape=(3, 16), chunk_tokens=16),
        FeatureSpec(name="final_hidden_state", shape=(16,), chunk_tokens=16),
    ]
    with hsstore.StoreWriter(str(path), specs, make_lineage(), shard_max_tokens=150) as writer:
        for i in range(num_samples):
            writer.add_sample(**make_sample(i, int(rng.integers(5, 60))))


def _upload(local: Path, fs: Any) -> str:
    bucket = f"hsstore-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    fs.put(str(local), f"{bucket}/store", recursive=True)
    return f"s3://{bucket}/store"


@pytest.fixture
def stores(tmp_path: Path, aws_env: Any) -> tuple[str, str]:
    """(local path, s3:// URL) of the same store."""
    import s3fs

    local = tmp_path / "store"
    _write_local(local)
    return str(local), _upload(local, s3fs.S3FileSystem())


def _settings() -> dict[str, Any]:
    return {"token_budget": 128, "rows_per_batch": 1, "shuffle_window": 8, "seed": 5, "read_threads": 3, "prefetch_batches": 2}


def _snapshot(batch: Any) -> dict[str, Any]:
    return {
        "index": (batch.epoch, batch.index),
        "samples": [list(map(int, row)) for row in batch.sample_indices],
        "input_ids": batch.input_ids.copy(),
        **{key: value.copy() for key, value in batch.features.items()},
    }


def _assert_same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b, strict=True):
        assert x["index"] == y["index"] and x["samples"] == y["samples"]
        for key in x:
            if key not in ("index", "samples"):
                np.testing.assert_array_equal(x[key], y[key])


@pytest.mark.parametrize("reader", ["auto", "fsspec"])
def test_s3_batches_equal_local_ones_with_the_endpoint_from_the_environment(
    stores: tuple[str, str], monkeypatch: pytest.MonkeyPatch, reader: str
) -> None:
    local, url = stores
    monkeypatch.setenv("HSSTORE_RANGE_READER", reader)
    expected = [_snapshot(b) for b in hsstore.StreamingLoader(local, FEATURES, **_settings()).batches(max_epochs=2)]
    loader = hsstore.StreamingLoader(url, FEATURES, **_settings())
    if reader == "fsspec":
        assert loader.store.location.range_reader == "fsspec"
    got = [_snapshot(b) for b in loader.batches(max_epochs=2)]
    _assert_same(expected, got)


def test_more_reads_in_flight_by_default_on_object_storage(stores: tuple[str, str]) -> None:
    from hsstore.packing import LoaderError
    from hsstore.storage import (
        LOCAL_PREFETCH_BATCHES,
        LOCAL_READ_THREADS,
        REMOTE_PREFETCH_BATCHES,
        REMOTE_READ_THREADS,
    )

    local, url = stores
    settings = {k: v for k, v in _settings().items() if k not in ("read_threads", "prefetch_batches")}
    here = hsstore.StreamingLoader(local, FEATURES, **settings)
    assert (here.read_threads, here.prefetch_batches) == (LOCAL_READ_THREADS, LOCAL_PREFETCH_BATCHES) == (4, 4)
    remote = hsstore.StreamingLoader(url, FEATURES, **settings)
    # An object store's latency (and its rate per connection) wants many requests in flight, and
    # they need batches to land in.
    assert (remote.read_threads, remote.prefetch_batches) == (REMOTE_READ_THREADS, REMOTE_PREFETCH_BATCHES) == (64, 8)
    # The same batches whatever the number of reads in flight: each read lands in its own place.
    _assert_same(
        [_snapshot(b) for b in remote.batches(max_epochs=1)],
        [_snapshot(b) for b in hsstore.StreamingLoader(local, FEATURES, **settings, read_threads=1).batches(max_epochs=1)],
    )
    assert hsstore.StreamingLoader(url, FEATURES, **settings, read_threads=2).read_threads == 2
    with pytest.raises(LoaderError, match="read_threads must be >= 1, got 0"):
        hsstore.StreamingLoader(local, FEATURES, **settings, read_threads=0)
    with pytest.raises(LoaderError, match="prefetch_batches must be >= 1, got 0"):
        hsstore.StreamingLoader(local, FEATURES, **settings, prefetch_batches=0)


def test_a_short_response_is_damage_named_by_file(stores: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A ranged GET that returns fewer bytes than asked (a truncated object, a proxy cutting the
    body) is a ShardCorruptError naming the file, which skip_corrupt can skip, not a bare error
    from the copy into the batch."""
    from hsstore.errors import ShardCorruptError
    from hsstore.storage import StoreLocation

    _, url = stores
    backend = type(StoreLocation(url))
    plain, plain_into = backend.read_range, backend.read_range_into

    def short(self: StoreLocation, key: str, start: int, end: int) -> Any:
        data = plain(self, key, start, end)
        return data[:-1] if "aux_hidden_states" in key and end - start > 4096 else data

    def short_into(self: StoreLocation, key: str, offset: int, buffers: list[Any], on_filled: Any = None) -> int:
        # The body ends one byte early: the last buffer (a chunk's crc32c) is not filled to its end,
        # so it is never reported filled (the others are, and their chunks pass their check).
        if "aux_hidden_states" in key and sum(memoryview(b).nbytes for b in buffers) > 4096:
            last = len(buffers) - 1
            buffers = [*buffers[:-1], np.frombuffer(buffers[-1], dtype=np.uint8)[:-1]]
            on_filled = on_filled and (lambda i, report=on_filled: None if i == last else report(i))
        return plain_into(self, key, offset, buffers, on_filled)

    monkeypatch.setattr(backend, "read_range", short)
    monkeypatch.setattr(backend, "read_range_into", short_into)  # the loader's reads (streamed by obstore)
    with pytest.raises(ShardCorruptError, match=r"aux_hidden_states/c/.*expected .*truncated"):
        list(hsstore.StreamingLoader(url, FEATURES, **_settings()).batches(max_epochs=1))
    skipping = hsstore.StreamingLoader(url, FEATURES, **_settings(), skip_corrupt=True)
    list(skipping.batches(max_epochs=1))
    assert skipping.num_skipped_samples > 0


def test_storage_options_reach_the_endpoint_without_the_environment(
    tmp_path: Path, s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    keys = {k: v for k, v in s3.environ().items() if k != "AWS_ENDPOINT_URL"}
    for key, value in keys.items():
        monkeypatch.setenv(key, value)
    options = {"client_kwargs": {"endpoint_url": s3.endpoint}}
    local = tmp_path / "store"
    _write_local(local, num_samples=6)
    url = _upload(local, s3fs.S3FileSystem(**options))
    loader = hsstore.StreamingLoader(url, FEATURES, storage_options=options, **_settings())
    assert sum(b.num_real_tokens for b in loader.batches(max_epochs=1)) > 0


def test_planning_needs_no_request_per_shard(stores: tuple[str, str]) -> None:
    _, url = stores
    server = _server_of(url)
    server.requests(reset=True)
    store = hsstore.open_store(url)
    assert len(store.shards) >= 4
    loader = hsstore.StreamingLoader(store, FEATURES, **_settings())
    assert loader.num_batches(0) > 2
    counts = server.requests(reset=True)
    # The manifest alone (its per-sample lengths plan the epoch; s3fs sizes it with a HEAD first):
    # no sample table read.
    assert counts.get("GET") == 1 and counts.get("HEAD", 0) <= 1, counts


def test_old_manifests_without_sample_lengths_still_plan_the_same(stores: tuple[str, str]) -> None:
    import s3fs

    local, url = stores
    path = Path(local) / "manifest.json"
    manifest = json.loads(path.read_text())
    for shard in manifest["shards"]:
        del shard["sample_tokens"]  # as written before the field existed
    s3fs.S3FileSystem().pipe(url.removeprefix("s3://") + "/manifest.json", json.dumps(manifest).encode())
    path.write_text(json.dumps(manifest))
    old = hsstore.open_store(url)
    assert all(shard.sample_tokens is None for shard in old.shards)
    expected = [_snapshot(b) for b in hsstore.StreamingLoader(local, FEATURES, **_settings()).batches(max_epochs=1)]
    got = [_snapshot(b) for b in hsstore.StreamingLoader(old, FEATURES, **_settings()).batches(max_epochs=1)]
    _assert_same(expected, got)


def test_a_resumed_run_requests_only_what_its_remaining_batches_need(stores: tuple[str, str]) -> None:
    _, url = stores
    server = _server_of(url)
    first = hsstore.StreamingLoader(url, FEATURES, **_settings())
    total = first.num_batches(0)
    assert total >= 4
    consumed = total // 2
    state = None
    for batch in first.batches(max_epochs=1):
        state = first.state_after(batch)
        if batch.index + 1 == consumed:
            break
    assert state is not None and state.batch_in_epoch == consumed

    server.requests(reset=True)
    resumed = hsstore.StreamingLoader(url, FEATURES, **_settings())
    remaining = list(resumed.batches(state, max_epochs=1))
    counts = server.requests(reset=True)
    assert [b.index for b in remaining] == list(range(consumed, total))
    samples = [int(s) for b in remaining for row in b.sample_indices for s in row]
    shards = {int(resumed._catalog.shard_of[s]) for s in samples}
    # manifest + per touched shard (sample table, and per array its zarr.json and index) + one
    # ranged GET per sample and array: nothing for the batches before the resume point.
    expected = 1 + len(shards) * (1 + 2 * ARRAYS) + len(samples) * ARRAYS
    assert counts.get("GET") == expected, (counts, expected)
    # s3fs sizes the manifest before its GET; obstore (the default reader) asks the bucket's region
    # once; nothing else.
    assert counts.get("HEAD", 0) <= 1 + (resumed.store.location.range_reader == "obstore")


def test_a_read_cache_serves_the_second_epoch_without_feature_requests(stores: tuple[str, str], tmp_path: Path) -> None:
    local, url = stores
    server = _server_of(url)
    cache = ReadCache(tmp_path / "cache", 1 << 30)
    one = [_snapshot(b) for b in hsstore.StreamingLoader(url, FEATURES, cache=cache, **_settings()).batches(max_epochs=1)]
    assert cache.num_bytes > 0
    server.requests(reset=True)
    again = [_snapshot(b) for b in hsstore.StreamingLoader(url, FEATURES, cache=ReadCache(tmp_path / "cache", 1 << 30), **_settings()).batches(max_epochs=1)]
    counts = server.requests(reset=True)
    assert counts.get("GET") == 1, counts  # the manifest: tables, metadata and ranges are cached
    _assert_same(one, again)
    expected = [_snapshot(b) for b in hsstore.StreamingLoader(local, FEATURES, **_settings()).batches(max_epochs=1)]
    _assert_same(expected, again)


def test_a_damaged_cache_entry_is_fetched_again(stores: tuple[str, str], tmp_path: Path) -> None:
    local, url = stores
    folder = tmp_path / "cache"
    list(hsstore.StreamingLoader(url, FEATURES, cache=ReadCache(folder, 1 << 30), **_settings()).batches(max_epochs=1))
    for entry in folder.iterdir():
        entry.write_bytes(entry.read_bytes()[:-1] + bytes([entry.read_bytes()[-1] ^ 0xFF]))
    got = [_snapshot(b) for b in hsstore.StreamingLoader(url, FEATURES, cache=ReadCache(folder, 1 << 30), **_settings()).batches(max_epochs=1)]
    expected = [_snapshot(b) for b in hsstore.StreamingLoader(local, FEATURES, **_settings()).batches(max_epochs=1)]
    _assert_same(expected, got)


def _server_of(url: str) -> Any:
    """The module's server (the URL's endpoint comes from the environment the fixture set)."""
    from tests.support.s3 import MotoS3

    server = MotoS3()
    server.port = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    return server


# -- the cache on its own --------------------------------------------------------------------------


def test_read_cache_is_bounded_and_evicts_the_least_recently_used(tmp_path: Path) -> None:
    cache = ReadCache(tmp_path, max_bytes=250)  # entries take 104 bytes (a crc32c each)
    for name in "abc":
        cache.put(ReadCache.key(name), name.encode() * 100)
    assert cache.num_bytes <= 250
    assert cache.get(ReadCache.key("a")) is None  # oldest, evicted
    assert cache.get(ReadCache.key("c")) == b"c" * 100
    assert len([p for p in tmp_path.iterdir() if p.suffix == ".bin"]) == 2
    reopened = ReadCache(tmp_path, max_bytes=110)  # a smaller bound applies to what is on disk
    assert reopened.num_bytes <= 110
    assert len([p for p in tmp_path.iterdir() if p.suffix == ".bin"]) == 1


def test_read_cache_in_memory_and_refuses_a_bad_bound() -> None:
    cache = ReadCache(None, max_bytes=10)
    cache.put("k", b"0123456789")
    assert cache.get("k") == b"0123456789"
    cache.put("big", b"x" * 11)  # larger than the bound: not kept, nothing evicted
    assert cache.get("big") is None and cache.get("k") is not None
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        ReadCache(None, max_bytes=0)


@pytest.mark.parametrize("on_disk", [True, False])
def test_read_cache_reads_a_hit_straight_into_buffers_and_checks_it(tmp_path: Path, on_disk: bool) -> None:
    cache = ReadCache(tmp_path if on_disk else None, max_bytes=1 << 20)
    data = np.arange(1000, dtype=np.uint16).tobytes()
    key = ReadCache.key("file-sha", 0, len(data))
    cache.put(key, data)
    parts = [np.zeros(300, np.uint16), np.zeros(700, np.uint16)]
    reported: list[int] = []  # a hit reports each part filled, as a backend's read does
    assert cache.read_into(key, parts, reported.append)
    assert np.concatenate(parts).tolist() == list(range(1000)) and reported == [0, 1]
    assert not cache.read_into(ReadCache.key("other"), [np.zeros(4, np.uint8)], reported.append)  # a miss
    assert not cache.read_into(key, [np.zeros(10, np.uint8)], reported.append)  # another size: a miss, not a short read
    assert reported == [0, 1]  # a miss reports nothing: the fetch that follows does
    if on_disk:  # a flipped bit: a miss (refetched), never wrong bytes
        entry = tmp_path / key
        damaged = bytearray(entry.read_bytes())
        damaged[5] ^= 0x10
        entry.write_bytes(bytes(damaged))
        assert not cache.read_into(key, [np.zeros(300, np.uint16), np.zeros(700, np.uint16)])
        assert cache.get(key) is None


# -- The range reader (hsstore.storage.s3_reads): obstore by default on s3://, fsspec where it cannot be --


@pytest.mark.parametrize(("endpoint_from", "body"), [("environment", "whole"), ("storage_options", "whole"), ("environment", "stream")])
def test_obstore_reader_gives_the_same_batches_as_local(
    stores: tuple[str, str], s3: Any, monkeypatch: pytest.MonkeyPatch, endpoint_from: str, body: str
) -> None:
    pytest.importorskip("obstore")
    from hsstore.storage import StoreLocation

    local, url = stores
    monkeypatch.setenv("HSSTORE_RANGE_READER", "obstore")
    monkeypatch.setenv("HSSTORE_S3_BODY", body)  # GET bodies copied whole, or streamed piece by piece
    options: dict[str, Any] = {}
    if endpoint_from == "storage_options":
        monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
        options = {"client_kwargs": {"endpoint_url": s3.endpoint}}
    location = StoreLocation(url, options)
    assert location._range_reader is not None and location._range_reader.body == body
    # Rebuilt from the URL and options in another process (Ray, DataLoader workers): reader included.
    assert pickle.loads(pickle.dumps(location))._range_reader is not None
    expected = [_snapshot(b) for b in hsstore.StreamingLoader(local, FEATURES, **_settings()).batches(max_epochs=2)]
    s3.requests(reset=True)
    loader = hsstore.StreamingLoader(url, FEATURES, storage_options=options, **_settings())
    got = [_snapshot(b) for b in loader.batches(max_epochs=2)]
    _assert_same(expected, got)
    assert s3.requests(reset=True).get("GET_ranged", 0) > 0  # obstore's GETs reached the endpoint


def test_the_default_reader_is_obstore_on_s3_where_every_option_maps(aws_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("obstore")
    from hsstore.storage import StoreLocation

    monkeypatch.delenv("HSSTORE_RANGE_READER", raising=False)
    assert StoreLocation("s3://some-bucket/store").range_reader == "obstore"
    assert StoreLocation("s3://some-bucket/store", {"anon": True}).range_reader == "obstore"
    # An option obstore cannot take: the default falls back to fsspec, which takes every option...
    assert StoreLocation("s3://some-bucket/store", {"requester_pays": True}).range_reader == "fsspec"
    assert StoreLocation("memory://store").range_reader == "fsspec"  # ...as on other protocols
    monkeypatch.setenv("HSSTORE_RANGE_READER", "fsspec")
    assert StoreLocation("s3://some-bucket/store").range_reader == "fsspec"
    # Asked for by name, obstore is obstore or an error naming what it cannot map.
    monkeypatch.setenv("HSSTORE_RANGE_READER", "obstore")
    with pytest.raises(ValueError, match="requester_pays"):
        StoreLocation("s3://some-bucket/store", {"requester_pays": True})
    with pytest.raises(ValueError, match="client_kwargs.verify"):
        StoreLocation("s3://some-bucket/store", {"client_kwargs": {"verify": False}})


def test_an_unknown_range_reader_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hsstore.storage import StoreLocation

    monkeypatch.setenv("HSSTORE_RANGE_READER", "curl")
    with pytest.raises(ValueError, match="HSSTORE_RANGE_READER='curl'"):
        StoreLocation("memory://store")
    # A local store never takes the remote path, whatever the variable says.
    monkeypatch.setenv("HSSTORE_RANGE_READER", "obstore")
    assert StoreLocation(str(tmp_path))._range_reader is None
    assert StoreLocation(str(tmp_path)).range_reader == "local"
    with pytest.raises(ValueError, match="reads s3:// stores only"):
        StoreLocation("memory://store")


def test_keys_only_in_a_profile_reach_obstore_through_botocore(
    stores: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys in ~/.aws (a named profile here), none in the environment: s3fs finds them through
    botocore and so does the obstore reader, which obstore alone would not."""
    pytest.importorskip("obstore")
    local, url = stores
    credentials = tmp_path / "credentials"
    key, secret = os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]
    credentials.write_text(f"[hsstore-test]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.delenv("HSSTORE_RANGE_READER", raising=False)
    expected = [_snapshot(b) for b in hsstore.StreamingLoader(local, FEATURES, **_settings()).batches(max_epochs=1)]
    for options, profile_variable in (({"profile": "hsstore-test"}, None), ({}, "hsstore-test")):
        if profile_variable:
            monkeypatch.setenv("AWS_PROFILE", profile_variable)
        loader = hsstore.StreamingLoader(url, FEATURES, storage_options=options, **_settings())
        assert loader.store.location.range_reader == "obstore"
        _assert_same(expected, [_snapshot(b) for b in loader.batches(max_epochs=1)])
        store = loader.store.location._range_reader._store(url.split("/")[2])
        assert store.credential_provider is not None  # the keys came from botocore's chain


def test_obstore_asks_the_bucket_for_its_region(aws_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """object_store does not follow S3's wrong-region redirect (botocore does): the reader asks the
    bucket where it is, once, over any region the environment names; an explicit one wins."""
    pytest.importorskip("obstore")
    import s3fs

    from hsstore.storage import StoreLocation

    bucket = f"hsstore-eu-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem().call_s3("create_bucket", Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("HSSTORE_RANGE_READER", raising=False)
    asked = StoreLocation(f"s3://{bucket}/store")._range_reader._store(bucket)
    assert asked.config["region"] == "eu-west-1"
    given = StoreLocation(f"s3://{bucket}/store", {"client_kwargs": {"region_name": "ap-south-1"}})
    assert given._range_reader._store(bucket).config["region"] == "ap-south-1"


@pytest.mark.parametrize("body", ["whole", "stream"])
def test_a_chunk_from_s3_is_checked_before_or_as_it_is_copied_and_damage_is_named(
    stores: tuple[str, str], monkeypatch: pytest.MonkeyPatch, body: str
) -> None:
    """Issue 32: a whole GET body is taken by the array reader (``read``), which checks each chunk's
    crc32c in the body and then copies it; a streamed one is checked as the GET's copy into the
    batch fills each chunk (``read_into``). Either way no pass over the whole body after it, and a
    damaged chunk is a ShardCorruptError naming the file and the chunk."""
    pytest.importorskip("obstore")
    import s3fs

    from hsstore.errors import ShardCorruptError
    from hsstore.format.array_reader import ArrayReader
    from hsstore.storage.s3_reads import ObstoreRangeReader

    monkeypatch.delenv("HSSTORE_RANGE_READER", raising=False)
    monkeypatch.setenv("HSSTORE_S3_BODY", body)
    _, url = stores
    in_get = threading.local()
    checked_in_get: list[bool] = []
    plain_into, plain_check = ObstoreRangeReader.read_into, ArrayReader._check_chunk

    def read_into(self: ObstoreRangeReader, *args: Any) -> int:
        in_get.now = True
        try:
            return plain_into(self, *args)
        finally:
            in_get.now = False

    def check(self: ArrayReader, *args: Any) -> None:
        checked_in_get.append(getattr(in_get, "now", False))
        plain_check(self, *args)

    monkeypatch.setattr(ObstoreRangeReader, "read_into", read_into)
    monkeypatch.setattr(ArrayReader, "_check_chunk", check)
    assert sum(b.num_real_tokens for b in hsstore.StreamingLoader(url, FEATURES, **_settings()).batches(max_epochs=1)) > 0
    assert checked_in_get and all(checked_in_get) == (body == "stream") and any(checked_in_get) == (body == "stream")
    fs = s3fs.S3FileSystem()
    path = sorted(p for p in fs.find(url) if "/aux_hidden_states/c/" in p)[0]
    damaged = bytearray(fs.cat_file(path))
    damaged[10] ^= 0x10  # in the first chunk's rows
    fs.pipe_file(path, bytes(damaged))
    with pytest.raises(ShardCorruptError, match=rf"{re.escape(path)}: chunk 0 fails its crc32c"):
        list(hsstore.StreamingLoader(url, FEATURES, **_settings()).batches(max_epochs=1))


def test_a_missing_object_through_obstore_is_file_not_found_and_skippable(
    stores: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """obstore's own exceptions are not OSErrors: the reader turns them into the ones fsspec raises,
    naming the file, so the loader's skip_corrupt treats both readers alike."""
    pytest.importorskip("obstore")
    import s3fs

    from hsstore.errors import ShardCorruptError

    monkeypatch.delenv("HSSTORE_RANGE_READER", raising=False)
    _, url = stores
    location = hsstore.open_store(url).location
    assert location.range_reader == "obstore"
    with pytest.raises(FileNotFoundError, match=f"s3://{location.path('shards/no-such-file')}"):
        location.read_range("shards/no-such-file", 0, 10)
    fs = s3fs.S3FileSystem()
    chunks = sorted(path for path in fs.find(url) if "/final_hidden_state/c/" in path)
    assert chunks
    fs.rm(chunks[0])
    with pytest.raises(ShardCorruptError, match="not found"):
        list(hsstore.StreamingLoader(url, FEATURES, **_settings()).batches(max_epochs=1))
    skipping = hsstore.StreamingLoader(url, FEATURES, **_settings(), skip_corrupt=True)
    assert sum(b.num_real_tokens for b in skipping.batches(max_epochs=1)) > 0
    assert skipping.num_skipped_samples > 0


def test_verify_through_obstore_finds_what_fsspec_finds(stores: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """verify hashes S3 files with ranged GETs through the default reader (obstore), in threads:
    a flipped byte and a deleted object are found as through s3fs, in the same order."""
    pytest.importorskip("obstore")
    import s3fs

    from hsstore.storage import StoreLocation
    from hsstore.verify import verify_store

    _, url = stores
    monkeypatch.delenv("HSSTORE_RANGE_READER", raising=False)
    assert verify_store(StoreLocation(url)) == []
    fs = s3fs.S3FileSystem()
    chunks = sorted(path for path in fs.find(url) if "/aux_hidden_states/c/" in path)
    damaged = bytearray(fs.cat_file(chunks[0]))
    damaged[len(damaged) // 2] ^= 0x04
    fs.pipe_file(chunks[0], bytes(damaged))
    fs.rm(chunks[-1])
    found = [str(p) for p in verify_store(StoreLocation(url), threads=4)]
    assert sorted(p.split(":")[0] for p in found) == ["checksum", "missing"], found
    monkeypatch.setenv("HSSTORE_RANGE_READER", "fsspec")
    assert [str(p) for p in verify_store(StoreLocation(url), threads=1)] == found


def test_the_cli_on_an_s3_store_prints_no_botocore_chatter(stores: tuple[str, str]) -> None:
    """botocore logs at INFO where it found the keys each time a client is made (zarr makes one per
    array): the CLI keeps its loggers at WARNING unless -v."""
    import subprocess
    import sys

    _, url = stores
    repo = REPO_ROOT
    quiet = subprocess.run([sys.executable, "-m", "pipelines.cli", "verify", url], cwd=repo, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and quiet.stdout.strip().endswith(": OK"), quiet.stderr[-2000:]
    assert "botocore" not in quiet.stderr, quiet.stderr[-2000:]
    verbose = subprocess.run([sys.executable, "-m", "pipelines.cli", "-v", "info", url], cwd=repo, capture_output=True, text=True, timeout=300)
    assert verbose.returncode == 0 and "botocore" in verbose.stderr


def test_temporary_keys_from_botocore_are_refreshed_for_obstore() -> None:
    """Assumed-role or SSO keys expire: obstore asks the callback again after CREDENTIALS_TTL, and
    the callback hands over what botocore's refreshing credentials hold then (refreshed by botocore
    once within its advisory window), never a stale copy."""
    from datetime import UTC, datetime, timedelta

    from botocore.credentials import RefreshableCredentials

    from hsstore.storage.s3_reads import CREDENTIALS_TTL, _BotocoreCredentials

    issued: list[str] = []

    def refresh() -> dict[str, str]:
        issued.append(f"key-{len(issued)}")
        # Each set expires in 10 minutes: inside botocore's 15-minute advisory window, so every
        # read of the frozen keys refreshes them.
        expiry = datetime.now(UTC) + timedelta(minutes=10)
        return {"access_key": issued[-1], "secret_key": "s", "token": "t", "expiry_time": expiry.isoformat()}

    credentials = RefreshableCredentials.create_from_metadata(refresh(), refresh, "assume-role")
    provider = _BotocoreCredentials(credentials)
    first, second = provider(), provider()
    assert first["access_key_id"] != second["access_key_id"] and second["access_key_id"] == issued[-1]
    assert first["token"] == "t" and first["secret_access_key"] == "s"
    assert timedelta(0) < first["expires_at"] - datetime.now(UTC) <= CREDENTIALS_TTL
