"""The store contract (hsstore.testing.StoreTests), run against every backend: local paths, file://,
memory:// and S3 on loopback (moto's server); which backend a URL gets; reads through torch."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

import hsstore
from hsstore.storage import (
    FsspecBackend,
    LocalBackend,
    MemoryBackend,
    S3Backend,
    StoreLocation,
    register_backend,
)
from hsstore.testing import StoreTests
from tests.support.stores import write_store


class TestLocalStore(StoreTests):
    @pytest.fixture
    def location(self, tmp_path: Path) -> Iterator[StoreLocation]:
        yield StoreLocation(str(tmp_path / "store"))


class TestFileUrlStore(StoreTests):
    @pytest.fixture
    def location(self, tmp_path: Path) -> Iterator[StoreLocation]:
        yield StoreLocation(f"file://{tmp_path}/store")


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def location(self) -> Iterator[StoreLocation]:
        url = f"memory://hsstore-test-{uuid.uuid4().hex}"
        yield StoreLocation(url)
        memory = fsspec.filesystem("memory")
        if memory.exists(url):
            memory.rm(url, recursive=True)


class TestS3Store(StoreTests):
    """S3 through s3fs (conditional PUTs) and obstore (ranged reads), on moto's server on loopback."""

    @pytest.fixture
    def location(self, s3_store: tuple[str, dict[str, Any]]) -> Iterator[StoreLocation]:
        url, options = s3_store
        location = StoreLocation(url, options)
        if importlib.util.find_spec("obstore") is not None:
            assert location.range_reader == "obstore"
        yield location


def test_the_url_scheme_picks_the_backend(tmp_path: Path) -> None:
    assert type(StoreLocation(str(tmp_path))) is LocalBackend
    assert type(StoreLocation(f"file://{tmp_path}")) is LocalBackend
    assert type(StoreLocation("memory://x")) is MemoryBackend
    assert type(StoreLocation("s3://bucket/store", {"anon": True})) is S3Backend
    assert type(StoreLocation(f"simplecache::file://{tmp_path}")) is FsspecBackend
    assert hsstore.StoreLocation is StoreLocation


def test_a_registered_backend_serves_its_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    import hsstore.storage.base as storage_base

    class Custom(MemoryBackend):
        prefers_threads = False

    monkeypatch.setattr(storage_base, "_BACKENDS", dict(storage_base._BACKENDS))
    register_backend("memory", Custom)
    assert type(StoreLocation("memory://x")) is Custom and not StoreLocation("memory://x").prefers_threads


@pytest.mark.parametrize("codec,compression", [("bf16", "none"), ("bf16", "zstd"), ("fp8_e4m3", "blosc"), ("fp8_e4m3", "zstd")])
def test_reads_return_what_torch_expects(tmp_path: Path, codec: str, compression: str) -> None:
    """bf16 is exact; fp8 within its error bound (the codecs' own tests hold the details)."""
    url = str(tmp_path / "store")
    samples = write_store(url, num_samples=14, codec=codec, compression=compression)
    store = hsstore.open_store(url)
    assert len(store.shards) > 1
    for index, sample in enumerate(samples):
        got = store.read_sample(index)
        for name, values in sample["features"].items():
            assert got[name].dtype == torch.bfloat16 and got[name].shape == values.shape
            expected = torch.from_numpy(values).to(torch.bfloat16).float()
            if codec == "bf16":
                assert torch.equal(got[name].float(), expected)
            else:
                tolerance = np.abs(values).max(axis=-1, keepdims=True) * 2**-4 + 1e-6
                assert np.all(np.abs(got[name].float().numpy() - values) <= tolerance + np.abs(values) * 2**-6)


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
