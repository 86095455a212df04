"""Planning in a stream: parallel tokenization gives the plan one process gives; a resume skips the
committed windows without tokenizing them; --dry-run plans, counts and writes nothing."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

import hsstore
from pipelines.extract import run_extraction
from pipelines.extract.planner import StreamPlanner
from pipelines.extract.tokenize import SampleTokenizer
from tests.pipelines.extract.conftest import MIXED_RECORDS, write_jsonl
from tests.pipelines.extract.helpers import make_recipe


def many_records(path: Path, count: int) -> Path:
    """Text records of varied length, a few duplicates and bad lines among them."""
    records: list[Any] = []
    for n in range(count):
        records.append({"id": f"r{n}", "text": f"def f{n}(x):\n    return x + {n}\n" * (1 + n % 7)})
        if n % 17 == 5:
            records.append(b"{not json")
        if n % 23 == 7:
            records.append({"id": f"dup{n}", "text": f"def f{n}(x):\n    return x + {n}\n" * (1 + n % 7)})
    records.extend(MIXED_RECORDS[1:2])
    return write_jsonl(path, records)


def plan_of(recipe: Any) -> list[tuple[int, list[str], list[str]]]:
    from pipelines.extract.tokenizer_pool import make_sample_tokenizer

    planner = StreamPlanner(recipe, make_sample_tokenizer(recipe, recipe.target), recipe.target)
    return [
        (w.num_records, [r.message for r in w.rejections], [r.sample_id for u in w.units for r in u.rows])
        for w in planner.windows()
    ]


def test_a_process_pool_plans_what_one_process_plans(tiny_qwen3: Path, tmp_path: Path) -> None:
    data = many_records(tmp_path / "data.jsonl", 60)
    units = {"max_tokens": 256, "sort_window_tokens": 700}
    alone = make_recipe(tiny_qwen3, [data], tmp_path / "a", units=units, planning={"num_workers": 1})
    pooled = make_recipe(tiny_qwen3, [data], tmp_path / "b", units=units, planning={"num_workers": 2, "block_records": 5})
    plan = plan_of(alone)
    assert len(plan) >= 4  # several windows
    assert sum(n for n, _, _ in plan) == 60 + 4 + 3 + 1
    assert any("same content as" in m for _, messages, _ in plan for m in messages)
    assert plan_of(pooled) == plan


def test_a_resume_skips_committed_windows_without_tokenizing_them(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = many_records(tmp_path / "data.jsonl", 40)
    settings: dict[str, Any] = {"units": {"max_tokens": 200, "sort_window_tokens": 400}, "planning": {"num_workers": 1}}
    reference = run_extraction(make_recipe(tiny_qwen3, [data], tmp_path / "reference", **settings))
    recipe = make_recipe(tiny_qwen3, [data], tmp_path / "store", **settings)

    calls = {"n": 0}
    tokenize = SampleTokenizer.__call__

    def counting(self: SampleTokenizer, record: Any) -> Any:
        calls["n"] += 1
        return tokenize(self, record)

    monkeypatch.setattr(SampleTokenizer, "__call__", counting)
    committed: list[int] = []

    def crash_midway(result: Any, executor: Any) -> None:
        committed.append(result.unit_index)
        if len(committed) == reference.num_units // 2:
            raise RuntimeError("driver killed midway")

    with pytest.raises(RuntimeError, match="driver killed midway"):
        run_extraction(recipe, on_commit=crash_midway)
    journal = sorted((tmp_path / "store" / "plan" / "windows").iterdir())
    windows = [json.loads(p.read_text()) for p in journal]
    done = {f"u{i:06d}" for i in committed}
    skippable = [w for w in windows if all(f"u{i:06d}" in done for i in range(w["first_unit"], w["first_unit"] + w["num_units"]))]
    assert skippable, "the crash came after at least one whole window was committed"

    calls["n"] = 0
    resumed = run_extraction(recipe)
    # The records of fully committed windows were read past, not tokenized (rejected lines never
    # reach the tokenizer, so the count is of parsed records).
    parsed_records = reference.num_records - reference.rejected.get("not_json", 0)
    skipped_records = sum(w["num_records"] - sum(r["reason"] == "not_json" for r in w["rejections"]) for w in skippable)
    assert calls["n"] == parsed_records - skipped_records
    for field in ("num_records", "num_samples", "num_tokens", "num_loss_tokens", "num_units", "rejected"):
        assert getattr(resumed, field) == getattr(reference, field), field
    assert resumed.num_units_skipped == len(committed)
    stored = hsstore.open_store(str(tmp_path / "store"))
    assert sorted(stored.samples.column("sample_id").to_pylist()) == sorted(
        hsstore.open_store(str(tmp_path / "reference")).samples.column("sample_id").to_pylist()
    )
    assert stored.verify() == []
    rejects = (tmp_path / "store" / "rejects" / "extract.jsonl").read_text()
    assert rejects == (tmp_path / "reference" / "rejects" / "extract.jsonl").read_text()


def test_dry_run_counts_what_a_run_would_and_writes_nothing(
    tiny_qwen3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipelines.cli import main

    data = many_records(tmp_path / "data.jsonl", 30)
    store = tmp_path / "store"
    recipe_path = tmp_path / "recipe.yaml"
    recipe = make_recipe(tiny_qwen3, [data], store, units={"max_tokens": 200, "sort_window_tokens": 400})
    recipe_path.write_text(json.dumps(recipe.model_dump(mode="json")))
    assert main(["extract", str(recipe_path), "--dry-run", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert not store.exists()
    assert main(["extract", str(recipe_path), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "dry run          planned only; nothing extracted" in text
    assert f"records read     {planned['num_records']}" in text
    assert "rejected         3: duplicate 1, not_json 2" in text
    ran = run_extraction(recipe)
    for field in ("num_records", "num_samples", "num_tokens", "num_loss_tokens", "num_units", "rejected", "num_truncated"):
        assert planned[field] == getattr(ran, field), field
    assert planned["padding_waste"] == pytest.approx(ran.padding_waste)
    assert planned["rejected"] == {"duplicate": 1, "not_json": 2}


def test_the_pool_starts_early_only_when_the_first_block_is_full(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full first block starts the pool on a thread (more blocks may follow); a smaller input
    never starts one. A start that planning outlives (close before every process came up) is quiet."""
    import threading

    from pipelines.extract.records import iter_records
    from pipelines.extract.tokenizer_pool import BlockTokenizer, make_sample_tokenizer

    thread_errors: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": f"r{n}", "text": f"x = {n}\n"} for n in range(3)])
    recipe = make_recipe(tiny_qwen3, [data], tmp_path / "s", planning={"num_workers": 2, "block_records": 3})
    records = list(iter_records([str(data)]))
    tokenizer = make_sample_tokenizer(recipe, recipe.target)
    expected = [(s.sample_id, s.input_ids.tolist()) for s in (tokenizer(record) for record in records)]

    def tokens(blocks: Any) -> list[Any]:
        return [[(s.sample_id, s.input_ids.tolist()) for s in block] for block in blocks]

    small = BlockTokenizer(tokenizer, recipe, recipe.target, num_workers=2)
    assert tokens(small.map([records[:2]])) == [expected[:2]]
    assert small._pool is None
    small.close()

    full = BlockTokenizer(tokenizer, recipe, recipe.target, num_workers=2)
    results = full.map(iter([records, records]))
    assert tokens([next(results)]) == [expected]  # in this process; the second block not read yet
    started = time.monotonic()
    while full._pool is None and time.monotonic() - started < 30:  # the pool starting on its thread
        time.sleep(0.01)
    assert full._pool is not None
    assert tokens(results) == [expected]  # in the pool
    full.close()
    full_only = BlockTokenizer(tokenizer, recipe, recipe.target, num_workers=2)
    assert tokens(full_only.map([records])) == [expected]
    full_only.close()  # may come before the starting thread's submits: they stop quietly
    # A start that close() overtakes (its thread runs only after the close) opens no pool.
    late = BlockTokenizer(tokenizer, recipe, recipe.target, num_workers=2)
    deferred: list[Any] = []

    class DeferredThread:
        def __init__(self, target: Any, **_: Any) -> None:
            deferred.append(target)

        def start(self) -> None:
            pass

    with monkeypatch.context() as patch:
        patch.setattr(threading, "Thread", DeferredThread)
        late._start_in_background()
    late.close()
    deferred[0]()
    for thread in threading.enumerate():
        if thread.name == "tokenizer-pool-start":
            thread.join(timeout=60)
    assert full_only._pool is None and late._pool is None
    assert thread_errors == []
