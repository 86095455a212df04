"""benchmarks/bench_verify.py at a tiny size: every row measured, the store found sound each time."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("moto")
s3fs = pytest.importorskip("s3fs")


def test_quick_run_times_every_row(tmp_path: Path) -> None:
    from benchmarks import bench_verify

    out = tmp_path / "verify.json"
    environ = dict(os.environ)
    try:  # the benchmark exports its endpoint's AWS_* variables, as a script may
        assert bench_verify.main(["--quick", "--out", str(out)]) == 0
    finally:
        os.environ.clear()
        os.environ.update(environ)
    summary = json.loads(out.read_text())["summary"]
    for key in ("local_1", "local_default", "s3_fsspec_1", "s3_fsspec_default", "s3_1", "s3_default"):
        assert summary[f"{key}_seconds"] > 0
    assert summary["shards"] >= 2 and summary["s3_reader"] in ("obstore", "fsspec")
