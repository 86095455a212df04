"""``profiler.dir``: a torch.profiler trace of each worker's first batches, and nothing else changed."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

import hsstore
from pipelines.extract import run_extraction
from pipelines.extract.profiling import BATCH, SUBMIT, UNIT_SETUP
from tests.pipelines.extract.conftest import write_jsonl
from tests.pipelines.extract.helpers import make_recipe, stored_samples


def _trace_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as handle:
        return json.load(handle)["traceEvents"]


def test_a_trace_of_the_first_units_first_batches_and_the_same_store(tiny_qwen3: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", [{"id": f"r{i}", "text": f"line {i} " * (8 + i)} for i in range(12)])
    # Small batches, so that the first unit holds more batches than are traced.
    small = {"batching": {"max_length": 32, "token_budget": 32, "too_long": "truncate"}, "units": {"max_tokens": 128}}
    traced = make_recipe(
        tiny_qwen3, [data], tmp_path / "traced", profiler={"dir": str(tmp_path / "traces"), "batches": 2}, **small
    )
    untraced = make_recipe(tiny_qwen3, [data], tmp_path / "untraced", **small)
    traced_summary = run_extraction(traced)
    run_extraction(untraced)
    assert traced_summary.num_units > 1
    assert traced_summary.num_samples_written / traced_summary.num_units > 2  # more batches than traced

    traces = list((tmp_path / "traces").iterdir())
    assert len(traces) == 1  # one worker, its first unit only
    assert traces[0].name.endswith("-u000000.pt.trace.json.gz")
    names = [event.get("name") for event in _trace_events(traces[0])]
    assert names.count(UNIT_SETUP) == 1
    assert names.count(BATCH) == 2  # profiler.batches, not the unit's every batch
    assert names.count(SUBMIT) == 2
    assert any(str(name).startswith("aten::") for name in names)  # the forwards' ops are in it

    # The profiler is not part of the lineage, and a traced store holds the same features.
    assert hsstore.open_store(str(tmp_path / "traced")).lineage == hsstore.open_store(str(tmp_path / "untraced")).lineage
    got, want = stored_samples(tmp_path / "traced"), stored_samples(tmp_path / "untraced")
    assert got.keys() == want.keys()
    for sample_id, sample in want.items():
        for name, value in sample.items():
            same = torch.equal(got[sample_id][name], value) if torch.is_tensor(value) else got[sample_id][name] == value
            assert same, (sample_id, name)


def test_an_unwritable_trace_folder_warns_and_the_extraction_goes_on(
    tiny_qwen3: Path, mixed_data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    recipe = make_recipe(tiny_qwen3, [mixed_data], tmp_path / "store", profiler={"dir": str(blocker / "traces")})
    with caplog.at_level("WARNING", logger="pipelines.extract.profiling"):
        summary = run_extraction(recipe)
    assert summary.num_samples_written > 0
    assert f"profiler.dir {blocker / 'traces'}: the trace could not be written" in caplog.text


def test_only_the_first_unit_is_traced_and_a_stop_without_batches_still_writes(tmp_path: Path) -> None:
    from pipelines.extract.profiling import FirstBatchesProfiler

    profiler = FirstBatchesProfiler(str(tmp_path / "traces"), batches=3, device=torch.device("cpu"))
    profiler.start(7)
    torch.ones(4).sum()
    profiler.stop()  # as when a unit fails before its first batch
    assert profiler.written is not None and profiler.written.name.endswith("-u000007.pt.trace.json.gz")
    profiler.start(8)  # a later unit: nothing traced
    profiler.batch_done()
    profiler.stop()
    assert [p.name for p in (tmp_path / "traces").iterdir()] == [profiler.written.name]
    assert any(e.get("name") == "aten::ones" for e in _trace_events(profiler.written))
