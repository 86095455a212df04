"""A record the target raises on: rejected (``worker_error``), the rest of its unit kept, the same
rejects after a crash and a resume, and through Ray; what is not one record's fault fails the job
with an ExtractionError naming the unit.

The fault is real: a tokenizer with one added token (id 8192) past the tiny target's 8192-row
embedding table, so the target's forward raises IndexError on any record holding that token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import hsstore
from hsstore.storage import StoreLocation
from pipelines.extract import run_extraction
from pipelines.extract.errors import ExtractionError
from pipelines.extract.target import load_target
from pipelines.extract.units import SampleRow, WorkUnit
from pipelines.extract.worker import ExtractionWorker
from pipelines.extract.worker_spec import WorkerSpec
from tests.pipelines.extract.conftest import write_jsonl
from tests.pipelines.extract.helpers import (
    fatal_problems,
    make_recipe,
    relative_error,
    stored_samples,
)

HOSTILE = "<|hostile|>"
POISON = {"id": "poison", "text": f"x = 1  # a record with a {HOSTILE} token in it\n"}
POISON_LINE = 6  # 1-based line of the poison record in the data file


@pytest.fixture(scope="module")
def hostile_tokenizer(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    tokenizer.add_tokens([HOSTILE])
    assert tokenizer.convert_tokens_to_ids(HOSTILE) == 8192  # one past the embedding table
    path = tmp_path_factory.mktemp("hostile-tokenizer")
    tokenizer.save_pretrained(path)
    return path


def records(count: int) -> list[dict[str, Any]]:
    """Distinct text records of varied lengths (several per unit and per batch)."""
    return [{"id": f"t{i}", "text": f"value_{i} = {i} * 2\n" * (1 + i % 5)} for i in range(count)]


def write_data(path: Path, *, poison: bool = True) -> Path:
    items: list[Any] = records(15)
    if poison:
        items.insert(POISON_LINE - 1, POISON)
    return write_jsonl(path, items)


def recipe_for(target: Path, tokenizer: Path, data: Path, store: Path, **sections: Any) -> Any:
    # Units of ~4 samples, batches of several samples: the poison shares a batch with others.
    sections.setdefault("units", {"max_tokens": 160})
    return make_recipe(target, [data], store, tokenizer={"path": str(tokenizer)}, **sections)


def rejects_lines(store: Path) -> list[dict[str, Any]]:
    text = (store / "rejects" / "extract.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_a_record_the_target_raises_on_is_rejected_and_the_rest_equals_a_clean_run(
    tiny_qwen3: Path, hostile_tokenizer: Path, tmp_path: Path
) -> None:
    clean = run_extraction(
        recipe_for(
            tiny_qwen3,
            hostile_tokenizer,
            write_data(tmp_path / "clean.jsonl", poison=False),
            tmp_path / "clean",
        )
    )
    summary = run_extraction(
        recipe_for(
            tiny_qwen3, hostile_tokenizer, write_data(tmp_path / "data.jsonl"), tmp_path / "store"
        )
    )

    assert summary.rejected == {"worker_error": 1}
    assert (summary.num_samples, summary.num_tokens, summary.num_loss_tokens) == (
        clean.num_samples,
        clean.num_tokens,
        clean.num_loss_tokens,
    )
    assert summary.num_samples_written == clean.num_samples == 15
    [line] = rejects_lines(tmp_path / "store")
    assert line["reason"] == "worker_error" and line["source_id"] == "poison"
    assert line["origin"] == f"data.jsonl:{POISON_LINE}"
    assert line["message"].startswith(
        f"data.jsonl:{POISON_LINE}: the target raised on this record (IndexError"
    )
    assert fatal_problems(tmp_path / "store") == []
    assert hsstore.open_store(str(tmp_path / "store")).verify() == []

    # The poison's batch was rerun sample by sample: each kept sample still has its own features.
    expected = stored_samples(tmp_path / "clean")
    actual = stored_samples(tmp_path / "store")
    assert sorted(actual) == sorted(expected)
    for source_id, sample in actual.items():
        assert sample["sample_id"] == expected[source_id]["sample_id"]
        for name in ("aux_hidden_states", "final_hidden_state"):
            assert relative_error(sample[name], expected[source_id][name]) < 1e-4, (source_id, name)


def test_a_crash_after_the_rejecting_unit_commits_resumes_to_the_same_store_and_rejects(
    tiny_qwen3: Path, hostile_tokenizer: Path, tmp_path: Path
) -> None:
    data = write_data(tmp_path / "data.jsonl")
    reference = run_extraction(
        recipe_for(tiny_qwen3, hostile_tokenizer, data, tmp_path / "reference")
    )

    recipe = recipe_for(tiny_qwen3, hostile_tokenizer, data, tmp_path / "store")

    def crash_after_the_rejecting_unit(result: Any, executor: Any) -> None:
        if result.rejected:
            raise RuntimeError("driver stopped right after the unit's commit")

    with pytest.raises(RuntimeError, match="driver stopped"):
        run_extraction(recipe, on_commit=crash_after_the_rejecting_unit)
    assert [p.name for p in (tmp_path / "store" / "rejects" / "units").iterdir()] != []
    # The rejects file is written when a run ends: the crashed run left none (what planning
    # found is in the plan journal, what the worker found in rejects/units).
    assert not (tmp_path / "store" / "rejects" / "extract.jsonl").exists()
    assert list((tmp_path / "store" / "plan" / "windows").iterdir())

    resumed = run_extraction(recipe)
    assert resumed.num_units_skipped >= 1
    assert resumed.rejected == reference.rejected == {"worker_error": 1}
    assert (resumed.num_samples, resumed.num_tokens) == (
        reference.num_samples,
        reference.num_tokens,
    )
    assert rejects_lines(tmp_path / "store") == rejects_lines(tmp_path / "reference")
    assert sorted(stored_samples(tmp_path / "store")) == sorted(
        stored_samples(tmp_path / "reference")
    )
    assert hsstore.open_store(str(tmp_path / "store")).verify() == []

    # A rerun of a finished store computes nothing and still reports the same rejects.
    again = run_extraction(recipe)
    assert again.num_units_skipped == again.num_units and again.num_samples_written == 0
    assert again.rejected == {"worker_error": 1}
    assert rejects_lines(tmp_path / "store") == rejects_lines(tmp_path / "reference")


def test_a_unit_of_nothing_but_failing_records_fails_the_job_naming_it(
    tiny_qwen3: Path, hostile_tokenizer: Path, tmp_path: Path
) -> None:
    """Every sample of a unit failing is a target/tokenizer mismatch, not bad records: rejecting
    them all would turn a broken setup into an empty store that looks like success."""
    poisoned = [{"id": f"p{i}", "text": f"{HOSTILE} number {i}\n" * (1 + i)} for i in range(3)]
    data = write_jsonl(tmp_path / "data.jsonl", poisoned)
    recipe = recipe_for(
        tiny_qwen3, hostile_tokenizer, data, tmp_path / "store", units={"max_tokens": 4096}
    )
    with pytest.raises(
        ExtractionError,
        match=r"unit 0 \(shard u000000\): the target raised on every one of its 3 samples "
        r"\(first: data.jsonl:3: IndexError",  # units hold length-sorted windows: longest first
    ):
        run_extraction(recipe)
    assert fatal_problems(tmp_path / "store") == []
    assert (
        StoreLocation(str(tmp_path / "store")).list_files("shards") == []
    )  # the attempt was removed


def test_a_target_that_fails_a_probe_too_is_broken_not_its_records(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    """An embedding table with no rows fails every forward, the pad-token probe included."""
    from pipelines.extract.executors import LocalExecutor

    model = load_target(str(tiny_qwen3), dtype="float32", device="cpu")
    model.model.embed_tokens = torch.nn.Embedding(0, 64)
    spec = WorkerSpec(
        target=str(tiny_qwen3),
        store=str(tmp_path / "store"),
        features=(hsstore.FeatureSpec(name="final_hidden_state", shape=(64,)),),
        aux_layer_ids=(),
        device="cpu",
    )
    rows = tuple(
        SampleRow(
            f"s{i}", f"r{i}", np.arange(1, 6 + i, dtype=np.int32), np.ones(5 + i, dtype=np.uint8)
        )
        for i in range(2)
    )
    unit = WorkUnit(3, rows, origins=("data.jsonl:1", "data.jsonl:2"))
    executor = LocalExecutor(spec, worker=ExtractionWorker(spec, model=model))
    results: list[Any] = []
    with pytest.raises(
        ExtractionError,
        match=r"unit 3 \(shard u000003\): all 2 samples of a batch failed alone \(first: "
        r"data.jsonl:2: \w+Error: .*\) and so did a 8-token probe .*: the target is broken, not the records",
    ):
        executor.run([unit], results.append)
    executor.close()
    assert results == []
    assert StoreLocation(str(tmp_path / "store")).list_files("shards") == []


@pytest.mark.slow
def test_a_ray_actor_sends_its_rejections_back_with_the_unit(
    ray_session: Any, tiny_qwen3: Path, hostile_tokenizer: Path, tmp_path: Path
) -> None:
    data = write_data(tmp_path / "data.jsonl")
    local = run_extraction(recipe_for(tiny_qwen3, hostile_tokenizer, data, tmp_path / "local"))
    ray_recipe = recipe_for(
        tiny_qwen3,
        hostile_tokenizer,
        data,
        tmp_path / "ray",
        executor="ray",
        ray={"num_workers": 1, "num_cpus_per_worker": 1},
    )
    summary = run_extraction(ray_recipe)
    assert summary.rejected == local.rejected == {"worker_error": 1}
    assert rejects_lines(tmp_path / "ray") == rejects_lines(tmp_path / "local")
    assert sorted(stored_samples(tmp_path / "ray")) == sorted(stored_samples(tmp_path / "local"))
    assert hsstore.open_store(ray_recipe.store).verify() == []
