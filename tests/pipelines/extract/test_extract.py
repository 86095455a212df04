"""End to end, in process: what lands in the store equals a plain transformers forward."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import hsstore
from hsstore.errors import LineageMismatchError
from pipelines.cli import main as cli_main
from pipelines.extract import run_extraction
from pipelines.extract.records import Record
from pipelines.extract.target import load_target
from pipelines.extract.tokenizer_pool import make_sample_tokenizer
from tests.pipelines.extract.conftest import MIXED_RECORDS, write_jsonl
from tests.pipelines.extract.helpers import (
    as_array,
    fatal_problems,
    make_recipe,
    plain_hidden_states,
    relative_error,
    stored_samples,
)
from tests.support.paths import REFERENCE_TARGET, REPO_ROOT


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama"])
def test_store_equals_plain_forward(fixture: str, request: pytest.FixtureRequest, mixed_data: Path, tmp_path: Path) -> None:
    """Text and chat records, several per batch and several units: features, ids and masks."""
    target: Path = request.getfixturevalue(fixture)
    recipe = make_recipe(target, [mixed_data], tmp_path / "store")
    summary = run_extraction(recipe)
    assert summary.num_samples == summary.num_samples_written == len(MIXED_RECORDS)
    assert summary.num_units > 1 and summary.num_rejected == 0
    # The run's timeline: forwards took part of the run, the rest is the head and the tail.
    assert 0 < summary.compute_seconds <= summary.extract_seconds
    assert 0 < summary.compute_busy_fraction <= 1
    assert summary.head_seconds >= 0 and summary.tail_seconds >= 0
    assert summary.head_seconds + summary.tail_seconds < summary.extract_seconds
    # The last batch's features reached the host after the first forward and before the end.
    assert 0 < summary.tail_after_landed_seconds < summary.extract_seconds - summary.head_seconds
    assert "forwards" in summary.format()
    store = hsstore.open_store(recipe.store)
    assert store.lineage.aux_layer_ids == [0, 2, 4]
    assert store.lineage.target.architecture == ("Qwen3ForCausalLM" if fixture == "tiny_qwen3" else "LlamaForCausalLM")
    assert store.features["aux_hidden_states"].shape == (3, 64)

    model = load_target(str(target), dtype="float32")
    sample_tokenizer = make_sample_tokenizer(recipe, str(target))
    stored = stored_samples(recipe.store)
    assert sorted(stored) == sorted(r["id"] for r in MIXED_RECORDS)
    for raw in MIXED_RECORDS:
        sample = stored[raw["id"]]
        messages = raw.get("messages") or [{"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]} for t in raw.get("conversations", [])]
        record = Record(raw["id"], "x", text=raw.get("text"), messages=tuple(messages) if messages else None)
        expected = sample_tokenizer(record)
        assert sample["sample_id"] == expected.sample_id
        assert as_array(sample["input_ids"]).tolist() == expected.input_ids.tolist()
        assert as_array(sample["loss_mask"]).astype(np.uint8).tolist() == expected.loss_mask.tolist()
        hidden = plain_hidden_states(model, sample["input_ids"])
        # Stored in bf16 from a float32 forward: bf16 rounding (2^-9 relative) is the only error.
        for k, layer_id in enumerate([0, 2, 4]):
            assert relative_error(sample["aux_hidden_states"][:, k], hidden[layer_id]) < 5e-3
        assert relative_error(sample["final_hidden_state"], hidden[-1]) < 5e-3
    assert fatal_problems(recipe.store) == []


def test_reference_target_end_to_end(tmp_path: Path) -> None:
    """The real target in its own bf16, text and chat records, default aux ids, batched."""
    data = write_jsonl(tmp_path / "data.jsonl", MIXED_RECORDS)
    recipe = make_recipe(
        REFERENCE_TARGET,
        [data],
        tmp_path / "store",
        model={"dtype": "bfloat16"},
        capture={"aux_layer_ids": None},
        units={"max_tokens": 128},
    )
    summary = run_extraction(recipe)
    assert summary.num_samples_written == summary.num_samples > 0
    assert summary.num_samples == len(MIXED_RECORDS) and summary.num_units > 1
    store = hsstore.open_store(recipe.store)
    assert store.lineage.aux_layer_ids == [2, 4, 5]
    model32 = load_target(str(REFERENCE_TARGET), dtype="float32")
    model16 = load_target(str(REFERENCE_TARGET), dtype="bfloat16")
    kinds = set()
    for sample in stored_samples(recipe.store).values():
        kinds.add("text" if as_array(sample["loss_mask"]).all() else "chat")
        truth = plain_hidden_states(model32, sample["input_ids"])
        alone = plain_hidden_states(model16, sample["input_ids"])
        # Batched bf16 extraction is as close to the float32 truth as an unbatched bf16 forward.
        for k, layer_id in enumerate([2, 4, 5]):
            own = relative_error(alone[layer_id], truth[layer_id])
            assert relative_error(sample["aux_hidden_states"][:, k], truth[layer_id]) < 1.5 * own + 2e-3
        own = relative_error(alone[-1], truth[-1])
        assert relative_error(sample["final_hidden_state"], truth[-1]) < 1.5 * own + 2e-3
    assert kinds == {"text", "chat"}


def test_rejects_file_summary_and_resume(tiny_qwen3: Path, tmp_path: Path) -> None:
    data = write_jsonl(
        tmp_path / "data.jsonl",
        [
            *MIXED_RECORDS[:3],
            b"{not json",
            {"messages": [{"role": "user", "content": "no answer"}]},
            MIXED_RECORDS[0],
            {"text": "y = 2\n" * 200},
        ],
    )
    store = tmp_path / "store"
    recipe = make_recipe(tiny_qwen3, [data], store, batching={"max_length": 64, "token_budget": 128, "too_long": "drop"})
    first = run_extraction(recipe)
    assert first.num_records == 7 and first.num_samples == 3
    assert first.rejected == {"duplicate": 1, "no_assistant_turn": 1, "not_json": 1, "too_long": 1}
    rejects = [json.loads(line) for line in (store / "rejects" / "extract.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in rejects] == ["not_json", "no_assistant_turn", "duplicate", "too_long"]
    assert rejects[1]["message"] == "data.jsonl:5: has no assistant turn, so no token would carry loss"
    assert rejects[3]["message"].startswith("data.jsonl:7: 800 tokens is over max_length=64 (set batching.too_long: truncate")
    text = first.format()
    assert "rejected         4: duplicate 1, no_assistant_turn 1, not_json 1, too_long 1" in text
    assert f"rejects file     {store}/rejects/extract.jsonl" in text
    assert first.bytes_per_token > first.feature_bytes_per_token == 2 * (3 * 64 + 64)
    manifest = (store / "manifest.json").read_text()
    assert "rejects" not in manifest, "the manifest never names the rejects file"

    again = run_extraction(recipe)
    assert again.num_samples_written == 0 and again.num_units_skipped == again.num_units == first.num_units
    assert again.num_samples == 3 and again.rejected == first.rejected
    assert hsstore.open_store(str(store)).num_samples == 3
    assert hsstore.open_store(str(store)).verify() == []

    other = make_recipe(tiny_qwen3, [data], store, batching={"max_length": 65, "token_budget": 130, "too_long": "drop"})
    with pytest.raises(LineageMismatchError, match=r"lineage field '[\w.]*max_length' is 64 in the store and 65 .* \(\d+ field\(s\) differ\)\. A rerun resumes only the same recipe"):
        run_extraction(other)
    # Other data (one more record): the data fingerprint (the files' bytes) differs.
    more = tmp_path / "more.jsonl"
    more.write_bytes(data.read_bytes() + b'{"text": "one more record"}\n')
    with pytest.raises(LineageMismatchError, match=r"lineage field 'data_fingerprint' is .* A rerun resumes only the same recipe"):
        run_extraction(make_recipe(tiny_qwen3, [more], store, batching={"max_length": 64, "token_budget": 128, "too_long": "drop"}))


def test_topk_distribution(tiny_llama: Path, mixed_data: Path, tmp_path: Path) -> None:
    recipe = make_recipe(tiny_llama, [mixed_data], tmp_path / "store", capture={"target_distribution": "topk", "topk_k": 4})
    run_extraction(recipe)
    store = hsstore.open_store(recipe.store)
    assert store.lineage.target_distribution == "topk"
    assert store.features["topk_ids"].codec == "int32" and store.features["topk_logits"].shape == (4,)
    model = load_target(str(tiny_llama), dtype="float32")
    sample = store.read_sample(0)
    logits = model(input_ids=sample["input_ids"][None].long()).logits[0]
    top = logits.topk(4, dim=-1)
    assert np.array_equal(as_array(sample["topk_ids"]), top.indices.numpy())
    assert relative_error(sample["topk_logits"], top.values.detach()) < 1e-5


def test_cli_runs_a_recipe_and_reports_bad_keys(tiny_qwen3: Path, mixed_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe_path = tmp_path / "extract.yaml"
    recipe_path.write_text(f"target: {tiny_qwen3}\ndata: [{mixed_data}]\nstore: {tmp_path / 'store'}\nexecutor: ray\n")
    overrides = ["--set", "executor=local", "--set", "model.device=cpu", "--set", "limit=2", "--set", "capture.aux_layer_ids=[1,2]"]
    assert cli_main(["extract", str(recipe_path), *overrides, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "records read     2" in out and "samples          2 (2 written now" in out
    assert hsstore.open_store(str(tmp_path / "store")).lineage.aux_layer_ids == [1, 2]
    assert cli_main(["extract", str(recipe_path), "--set", "capture.bogus=1"]) == 1
    assert "capture.bogus: unknown key" in capsys.readouterr().err
    assert cli_main(["extract", str(recipe_path), "--set", "batching.token_budget=8"]) == 1
    assert "token_budget (8) must be >= max_length (4096)" in capsys.readouterr().err


def test_auto_runs_a_lone_worker_in_process(tiny_qwen3: Path, mixed_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``executor: auto`` (the default): one worker on this machine runs in process, anything more
    (a cluster address, several actors, several GPUs) on Ray; the GPUs are counted without torch."""
    from pipelines.extract.executor_choice import resolve_executor, visible_gpu_count
    from pipelines.extract.recipe import RaySection

    lone = RaySection()
    assert [resolve_executor("auto", lone, gpus=n) for n in (0, 1, 2)] == ["local", "local", "ray"]
    assert resolve_executor("auto", RaySection(address="auto"), gpus=0) == "ray"
    assert resolve_executor("auto", RaySection(num_workers=2), gpus=1) == "ray"
    assert resolve_executor("auto", RaySection(num_workers=1), gpus=0) == "local"
    assert resolve_executor("ray", lone, gpus=0) == "ray" and resolve_executor("local", lone, gpus=8) == "local"
    for visible, count in (("0,1", 2), ("3", 1), ("", 0), ("-1", 0), ("0,-1,1", 1)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert visible_gpu_count() == count, visible
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    summary = run_extraction(make_recipe(tiny_qwen3, [mixed_data], tmp_path / "store", executor="auto", limit=2))
    assert summary.executor == "local" and summary.num_samples == 2
    assert "executor (local)" in summary.format()


@pytest.mark.parametrize("path", ["recipes/reference/extract.yaml", "recipes/qwen3/qwen3-8b-eagle3-extract.yaml"])
def test_shipped_recipes_validate(path: str) -> None:
    from pipelines.extract.recipe import ExtractRecipe
    from pipelines.recipe import load_recipe

    recipe = load_recipe(ExtractRecipe, REPO_ROOT / path)
    assert recipe.executor == "auto" and recipe.capture.target_distribution == "final_hidden"


def test_reference_recipe_runs_from_the_repo_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped recipe as a user runs it on a fresh clone (relative paths from the repository
    root, the bundled data: nothing outside the repository)."""
    monkeypatch.chdir(REPO_ROOT)
    overrides = ["limit=6", "executor=local", f"store={tmp_path / 'store'}", "batching.max_length=256", "batching.too_long=truncate"]
    from pipelines.extract.recipe import ExtractRecipe
    from pipelines.recipe import load_recipe

    summary = run_extraction(load_recipe(ExtractRecipe, "recipes/reference/extract.yaml", overrides))
    assert summary.num_records == 6 and summary.num_samples + summary.num_rejected == 6
    assert hsstore.open_store(str(tmp_path / "store")).lineage.aux_layer_ids == [2, 4, 5]
