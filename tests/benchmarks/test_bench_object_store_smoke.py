"""``python -m benchmarks.bench_object_store`` at a tiny size: the loader's tokens/s locally and
through moto's S3 endpoint, every read path measured; and the ``profile-reads`` mode on a tiny store:
every phase is timed, S3 and local read the same tokens, and the wrapped functions are put back."""

from __future__ import annotations

import json
import os
import sys
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
    from benchmarks import bench_object_store
    from hsstore.read_cache import Scatter
    from hsstore.storage import S3Backend

    plain = (Scatter.write, array_reader.crc32c_bytes, S3Backend.read_range, S3Backend.read_range_into)
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
    assert (Scatter.write, array_reader.crc32c_bytes, S3Backend.read_range, S3Backend.read_range_into) == plain


def test_s3_latency_measures_the_loader_and_the_ceiling_and_merges_the_cluster_keys(tmp_path: Path) -> None:
    """The ``s3-latency`` mode at a tiny size: the loader and the bare GETs of the same ranges in one
    run, their ratio, and issue 32's keys merged into an existing results file whose other keys stay."""
    from benchmarks import bench_object_store
    from benchmarks.object_store.s3_latency import ObstoreRangeReader

    plain = (ObstoreRangeReader.read, ObstoreRangeReader.read_into)
    switch_before = sys.getswitchinterval()
    out, cluster = tmp_path / "s3-latency.json", tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"nodes": 3, "node_kill": {"samples_in_store": 58}}))
    environ = dict(os.environ)
    own_cpus = os.sched_getaffinity(0)
    pinned = ["--endpoint-cpus", "1"] if len(own_cpus) >= 2 else []
    try:
        argv = ["--hidden", "64", "--tokens", "4096", "--repeats", "1", "--latency-ms", "5", "--loader-threads", "default,2/stream@0.5",
                "--ceiling-threads", "2,4", "--out", str(out), "--cluster-json", str(cluster), *pinned]
        assert bench_object_store.main(["s3-latency", *argv]) == 0
    finally:
        os.environ.clear()
        os.environ.update(environ)
        s3fs.S3FileSystem.clear_instance_cache()
    report, merged = json.loads(out.read_text()), json.loads(cluster.read_text())
    summary = report["summary"]
    ceilings = summary["ceilings_tokens_per_s"]
    assert set(ceilings) == {f"{client}-{n}" for client in ("get_range", "streamed", "get_range_copy", "read_into_copy") for n in (2, 4)}
    # The ceiling is the best bare client; those that copy each body are beside it, not in it.
    bare_best = max(v for k, v in ceilings.items() if not k.startswith(("get_range_copy", "read_into_copy")))
    assert summary["endpoint_ceiling_tokens_per_s"] == bare_best
    copy_best = max(ceilings["get_range_copy-2"], ceilings["get_range_copy-4"])
    assert summary["loader_share_of_get_and_copy"] == round(summary["loader_tokens_per_s"] / copy_best, 3)
    # Each GET's time and the reads under way, for the loader and for every bare client.
    for row in [summary["loaders"]["default"], *summary["ceiling_gets"].values()]:
        assert row["get_seconds_median"] > 0 and row["gets_in_flight_mean"] > 0, row
    assert set(summary["ceiling_gets"]) == set(ceilings)
    # The variant's switch interval held for its runs only (issue 32's GIL lead, A/B in one run).
    assert summary["loaders"]["2/stream@0.5"]["switch_interval_s"] == 0.0005
    assert summary["loaders"]["default"]["switch_interval_s"] == switch_before == sys.getswitchinterval()
    assert summary["loaders"]["default"]["read_threads"] == 64 and summary["loaders"]["2/stream@0.5"]["read_threads"] == 2
    # The GET bodies whole by default; the variant streamed them (HSSTORE_S3_BODY, restored after).
    assert summary["loaders"]["default"]["body"] == "whole" and summary["loaders"]["2/stream@0.5"]["body"] == "stream"
    assert summary["loader_share_of_ceiling"] == round(summary["loader_tokens_per_s"] / summary["endpoint_ceiling_tokens_per_s"], 3)
    (run,) = report["loader_runs"]["default"]
    (bare,) = report["ceiling_runs"]["get_range-2"]
    assert run["get_bytes"] == bare["bytes"] > 0  # the same GETs, bare
    # Every object read once, untimed: the shards' bytes plus the manifest and metadata files.
    assert report["store"]["bytes"] < report["endpoint_warmup_bytes"] < 1.01 * report["store"]["bytes"]
    assert merged["nodes"] == 3 and merged["node_kill"] == {"samples_in_store": 58}
    assert merged["loader_tokens_per_s"] == summary["loader_tokens_per_s"] and merged["s3_latency_ms"] == 5
    assert merged["trainers_fed_per_process"] == round(summary["loader_tokens_per_s"] / 25_000, 2)
    assert merged["s3_latency"]["details"] == "s3-latency.json"
    assert (ObstoreRangeReader.read, ObstoreRangeReader.read_into) == plain
    # Each run's CPU: this process's seconds per GB and each side's cores' busy share; with
    # --endpoint-cpus the endpoint on the first core, this process on the rest, and its cores
    # given back at the end.
    sides = {"endpoint", "client"} if pinned else {"all"}
    assert set(report["cpus"]) == sides and os.sched_getaffinity(0) == own_cpus
    if pinned:
        assert report["cpus"]["endpoint"] == [min(own_cpus)] and report["pinned_threads"]["endpoint"] >= 1
    for row in [summary["loaders"]["default"], *summary["ceiling_gets"].values()]:
        assert row["process_cpu_s_per_gb"] > 0 and set(row["busy"]) == sides, row


def test_s3_latency_loader_variants_parse_and_refuse_what_they_cannot_mean() -> None:
    from benchmarks.object_store.s3_latency import loader_variant

    assert loader_variant("default") == (None, None, None)
    assert loader_variant("16/stream") == (16, "stream", None)
    assert loader_variant("32@0.5") == (32, None, 0.0005)
    for bad in ("16/sideways", "32@fast", "32@0"):
        with pytest.raises(SystemExit, match="--loader-threads"):
            loader_variant(bad)
