"""``python -m benchmarks.bench_object_store`` at a tiny size: the loader's tokens/s locally and
through moto's S3 endpoint, every read path measured; and the ``profile-reads`` mode on a tiny store:
every phase is timed, S3 and local read the same tokens, and the wrapped functions are put back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("moto")
pytest.importorskip("obstore")
s3fs = pytest.importorskip("s3fs")


def test_quick_run_measures_every_read_path(tmp_path: Path) -> None:
    from benchmarks import bench_object_store

    out = tmp_path / "object-store.json"
    environ = dict(os.environ)
    try:  # the benchmark exports its endpoint's AWS_* variables, as a script may
        assert bench_object_store.main(["--quick", "--repeats", "1", "--out", str(out)]) == 0
    finally:
        os.environ.clear()
        os.environ.update(environ)
    summary = json.loads(out.read_text())["summary"]
    for key in ("local_tokens_per_s", "s3_tokens_per_s", "s3_fsspec_tokens_per_s", "s3_cached_2nd_epoch_tokens_per_s"):
        assert summary[key] > 0
    assert summary["s3_requests_per_epoch"] > 0 and summary["store_bytes"] > 0


def test_tiny_run_times_every_phase_and_restores_the_reader(tmp_path: Path) -> None:
    import hsstore.format.array_reader as array_reader
    import hsstore.storage.base as storage_base
    from benchmarks import bench_object_store
    from hsstore.storage import S3Backend

    plain = (storage_base.scatter, array_reader.crc32c_bytes, S3Backend.read_range)
    out = tmp_path / "profile.json"
    environ = dict(os.environ)
    try:  # the benchmark exports its endpoint's AWS_* variables, as a script may
        argv = ["--threads", "2", "--prefetch-batches", "2,4", "--tokens", "4096", "--hidden", "64", "--repeats", "1"]
        assert bench_object_store.main(["profile-reads", *argv, "--out", str(out)]) == 0
    finally:
        os.environ.clear()
        os.environ.update(environ)
        # fsspec caches filesystems by their arguments, not by the AWS_* environment: drop the one
        # bound to this run's (now stopped) endpoint before later tests build theirs.
        s3fs.S3FileSystem.clear_instance_cache()
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"threads_2_prefetch_2", "threads_2"}
    for series in report["runs"].values():
        (s3,), (local,) = series["s3_obstore"], series["local"]
        assert s3["tokens"] == local["tokens"] > 0
        assert set(s3["phases"]["calls"]) == {"get", "copy", "crc32c"}
        assert s3["phases"]["calls"]["copy"] > 0 and s3["phases"]["seconds"]["get"] > 0
    assert (storage_base.scatter, array_reader.crc32c_bytes, S3Backend.read_range) == plain
