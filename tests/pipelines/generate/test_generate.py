"""End to end on the reference target: hsstore generate in process and on Ray, resumed after a real
SIGKILL, sampled answers regenerated exactly, and the dataset read by hsstore extract."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import hsstore
from hsstore.storage import StoreLocation
from pipelines.extract import run_extraction
from pipelines.extract.recipe import ExtractRecipe
from pipelines.generate.driver import run_generation
from pipelines.generate.manifest import GenerationError, expand_generated_data, read_manifest
from pipelines.generate.recipe import GenerateRecipe
from pipelines.recipe import build_recipe
from tests.support.paths import REPO_ROOT, TRAIN_SLICE

pytestmark = pytest.mark.slow


def slice_records(kind: str, count: int) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in TRAIN_SLICE.read_text().splitlines()]
    return [r for r in rows if (kind in r)][:count]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two files, the good and the bad of every kind the job meets."""
    texts = slice_records("text", 2)
    chats = slice_records("messages", 1)
    two_turns = {
        "id": "two-turns",
        "messages": [
            {"role": "system", "content": "You are a Python coding assistant."},
            {"role": "user", "content": "Continue this Python file:\nimport os\n\n\ndef walk(root):\n"},
            {"role": "assistant", "content": "not the target's words"},
            {"role": "user", "content": "Continue from there."},
            {"role": "assistant", "content": "nor these"},
        ],
    }
    prompt_only = {"id": "prompt-only", "conversations": [{"from": "human", "value": "Continue this Python file:\nclass Queue:\n"}]}
    no_user = {"id": "no-user", "messages": [{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}]}
    too_long = {"id": "too-long", "messages": [{"role": "user", "content": "x = [1, 2, 3]\n" * 200}]}
    folder = tmp_path_factory.mktemp("generate-data")
    first = write_lines(folder / "a.jsonl", [json.dumps(r) for r in [*texts, two_turns, no_user]])
    second = write_lines(
        folder / "b.jsonl", [json.dumps(prompt_only), "{not json", json.dumps(too_long), *map(json.dumps, chats)]
    )
    return folder, [str(first), str(second)]  # type: ignore[return-value]


def make_recipe(data: list[str], output: Path, *overrides: str) -> GenerateRecipe:
    base = {
        "target": str(REPO_ROOT / "examples" / "reference-target"),
        "data": data,
        "output": str(output),
        "model": {"dtype": "float32", "device": "cpu"},
        "prompting": {"text_prefix_tokens": 32, "max_context": 1024},
        "sampling": {"max_new_tokens": 12},
        "units": {"max_records": 3},
        "batching": {"max_batch_size": 4},
    }
    return build_recipe(GenerateRecipe, base, list(overrides))


def read_output(folder: Path) -> list[dict[str, Any]]:
    manifest = read_manifest(StoreLocation(str(folder)))
    assert manifest is not None and manifest.complete
    rows: list[dict[str, Any]] = []
    for shard in manifest.shards:
        rows.extend(json.loads(line) for line in (folder / shard.path).read_text().splitlines())
    return rows


@pytest.fixture(scope="module")
def greedy_run(dataset: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[GenerateRecipe, Any]:
    recipe = make_recipe(dataset[1], tmp_path_factory.mktemp("greedy") / "out")
    return recipe, run_generation(recipe)


def test_generate_answers_rejects_and_marks(greedy_run: Any, reference_target: Path) -> None:
    recipe, summary = greedy_run
    assert summary.num_records == 8 and summary.num_written == 5
    assert summary.rejected == {"no_user_turn": 1, "not_json": 1, "too_long": 1}
    assert summary.num_units == 3 and summary.num_units_written == 3
    rows = {r["id"]: r for r in read_output(Path(recipe.output))}
    assert "prompt-only" in rows and "two-turns" in rows
    texts = [r for r in rows.values() if "prompt" in r]
    assert len(texts) == 2 and all(r["completion"] for r in texts)
    for row in rows.values():
        meta = row["generation"]
        assert meta["truncated"] == any(f != "stop" for f in meta["finish_reasons"])
        assert meta["num_new_tokens"] <= 12 * len(meta["finish_reasons"])
    assert any(r["generation"]["truncated"] for r in rows.values())  # 12 tokens cut most answers
    two = rows["two-turns"]["messages"]
    assert [m["role"] for m in two] == ["system", "user", "assistant", "user", "assistant"]
    assert two[1]["content"].startswith("Continue this Python file") and two[3]["content"] == "Continue from there."
    assert two[2]["content"] != "not the target's words" and two[4]["content"] != "nor these"
    # The second answer was generated after the target's own first answer: regenerate it alone.
    from transformers import AutoTokenizer

    from pipelines.extract.target import load_target
    from pipelines.generate.engine import BatchGenerator, SamplingParams
    from pipelines.generate.prompts import Request

    tokenizer = AutoTokenizer.from_pretrained(reference_target)
    model = load_target(str(reference_target), dtype="float32", device="cpu")
    prompt = tokenizer.apply_chat_template(two[:4], tokenize=False, add_generation_prompt=True)
    ids = tuple(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    generator = BatchGenerator(
        model, tokenizer, stop_token_ids=[2], pad_token_id=0, params=SamplingParams(), max_batch_size=1, token_budget=4096
    )
    assert generator.generate([Request(ids, 12, 0)])[0].text == two[4]["content"]
    # The prompt-only chat gained an assistant turn.
    assert [m["role"] for m in rows["prompt-only"]["messages"]] == ["user", "assistant"]
    rejects = sorted((Path(recipe.output) / "rejects").glob("*.jsonl"))
    reasons = [json.loads(line)["reason"] for path in rejects for line in path.read_text().splitlines()]
    assert sorted(reasons) == ["no_user_turn", "not_json", "too_long"]


def test_greedy_matches_plain_model_generate(reference_target: Path) -> None:
    from transformers import AutoTokenizer

    from pipelines.extract.target import load_target
    from pipelines.generate.engine import BatchGenerator, SamplingParams
    from pipelines.generate.prompts import Request

    tokenizer = AutoTokenizer.from_pretrained(reference_target)
    model = load_target(str(reference_target), dtype="float32", device="cpu")
    prompts = ["import os\nimport sys\n\n\ndef main", "class Foo:\n    def __init__(self", "x = 1\n"]
    requests = [Request(tuple(tokenizer(p)["input_ids"]), n, 0) for p, n in zip(prompts, (20, 7, 14), strict=True)]
    generator = BatchGenerator(
        model, tokenizer, stop_token_ids=[2], pad_token_id=0, params=SamplingParams(), max_batch_size=8, token_budget=4096
    )
    answers = generator.generate(requests)
    for request, answer in zip(requests, answers, strict=True):
        plain = model.generate(
            torch.tensor([request.prompt_ids]), max_new_tokens=request.max_new_tokens, do_sample=False, eos_token_id=2, pad_token_id=0
        )[0, len(request.prompt_ids) :].tolist()
        expected = [t for t in plain if t != 2]
        assert tokenizer.decode(expected) == answer.text and answer.num_new_tokens == len(expected)


def test_rerun_resumes_and_a_changed_recipe_is_refused(greedy_run: Any, dataset: Any) -> None:
    recipe, _ = greedy_run
    before = {p: p.read_bytes() for p in (Path(recipe.output) / "shards").iterdir()}
    summary = run_generation(recipe)
    assert summary.num_units_skipped == 3 and summary.num_units_written == 0 and summary.num_written == 5
    assert {p: p.read_bytes() for p in (Path(recipe.output) / "shards").iterdir()} == before
    changed = make_recipe(dataset[1], Path(recipe.output), "sampling.temperature=0.7")
    with pytest.raises(GenerationError, match="lineage field 'sampling' differs"):
        run_generation(changed)
    with pytest.raises(GenerationError, match="units of 3 records"):
        run_generation(make_recipe(dataset[1], Path(recipe.output), "units.max_records=2"))


def test_sampled_answers_are_regenerated_exactly(dataset: Any, tmp_path: Path) -> None:
    sampled = ("sampling.temperature=1.0", "sampling.top_p=0.95", "sampling.seed=3", "limit=5")
    first = make_recipe(dataset[1], tmp_path / "a", *sampled)
    # Other batches and units: the answers depend only on the record, the turn and the seed.
    second = make_recipe(dataset[1], tmp_path / "b", *sampled, "batching.max_batch_size=1", "units.max_records=2")
    run_generation(first)
    run_generation(second)
    manifest = read_manifest(StoreLocation(first.output))
    assert manifest is not None and manifest.lineage.sampling["sampler"] == "inverse-cdf"
    rows_a, rows_b = read_output(tmp_path / "a"), read_output(tmp_path / "b")
    assert rows_a == rows_b and len(rows_a) == 4
    other_seed = make_recipe(dataset[1], tmp_path / "c", *sampled[:2], "sampling.seed=4", "limit=5")
    run_generation(other_seed)
    assert read_output(tmp_path / "c") != rows_a


def test_extract_reads_the_generated_dataset_and_records_who_wrote_it(greedy_run: Any, tmp_path: Path) -> None:
    recipe, _ = greedy_run
    extract = build_recipe(
        ExtractRecipe,
        {
            "target": recipe.target,
            "data": [recipe.output],
            "store": str(tmp_path / "store"),
            "executor": "local",
            "model": {"dtype": "float32"},
            "batching": {"max_length": 1024, "token_budget": 4096},
        },
    )
    summary = run_extraction(extract)
    assert summary.num_samples == 5 and summary.rejected == {}
    store = hsstore.open_store(extract.store)
    generation = store.lineage.generation
    assert generation is not None and len(generation) == 1
    assert generation[0]["dataset"] == recipe.output and generation[0]["sampling"]["temperature"] == 0.0
    assert generation[0]["target"]["config_sha256"] == store.lineage.target.config_sha256
    # Loss on the answers only: a continuation's prompt and a chat's user turns carry none.
    assert 0 < summary.num_loss_tokens < summary.num_tokens / 2
    from hsstore.commit import read_manifest as read_store_manifest
    from hsstore.info import format_info, store_info

    manifest = read_store_manifest(StoreLocation(extract.store))
    assert manifest is not None
    text = format_info(store_info(manifest, extract.store))
    assert "answers    by this target (" in text and "unfinished" not in text
    # A store built from a generation cut short (allow_unfinished_generation) says so.
    manifest.lineage.generation[0].update(complete=False, units=[0, 1])
    assert "(unfinished: 2 units)" in format_info(store_info(manifest, extract.store))


def test_a_generated_folder_is_answered_again_with_longer_answers(
    greedy_run: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A folder hsstore generate wrote is data for another run (here longer answers): its committed
    shards are read, every assistant turn is written again, and the new lineage keeps the old.
    Greedy decoding continues the same way, so a one-answer record's new answer extends the old."""
    from pipelines.extract.records import RecordSourceError

    recipe, _ = greedy_run
    longer = make_recipe([recipe.output], tmp_path / "longer", "sampling.max_new_tokens=20")
    with caplog.at_level("INFO", logger="pipelines.generate.driver"):
        summary = run_generation(longer)
    assert summary.num_written == 5 and summary.rejected == {}
    # Each commit is logged (a cluster job's log has no progress bar).
    assert [line for line in caplog.messages if " committed: " in line][0].startswith("unit 0 committed: 4 answers")
    old = {r["id"]: r for r in read_output(Path(recipe.output))}
    new = {r["id"]: r for r in read_output(tmp_path / "longer")}
    assert new.keys() == old.keys()
    for key, row in new.items():
        if "prompt" in row:  # a raw prefix and its continuation
            assert row["prompt"] == old[key]["prompt"] and row["completion"].startswith(old[key]["completion"])
        elif len(row["messages"]) == 2:
            assert row["messages"][1]["content"].startswith(old[key]["messages"][1]["content"])
        assert row["generation"]["num_new_tokens"] >= old[key]["generation"]["num_new_tokens"]
    assert any(len(r.get("completion", "")) > len(old[k].get("completion", "")) for k, r in new.items())
    manifest = read_manifest(StoreLocation(longer.output))
    assert manifest is not None and manifest.lineage.sampling["max_new_tokens"] == 20
    (source,) = manifest.lineage.source_generations
    assert source["dataset"] == recipe.output and source["sampling"]["max_new_tokens"] == 12 and source["complete"]
    with pytest.raises(RecordSourceError, match="is a folder: give its JSONL or Parquet files"):
        run_generation(make_recipe([str(tmp_path)], tmp_path / "not-data"))


def test_a_sigkilled_run_resumes_exactly(dataset: Any, tmp_path: Path, greedy_run: Any) -> None:
    """A real SIGKILL of ``hsstore generate`` mid-run; the rerun skips the committed units and
    ends with exactly the dataset an uninterrupted run writes."""
    recipe_path = tmp_path / "recipe.yaml"
    import yaml

    recipe = make_recipe(dataset[1], tmp_path / "out", "units.max_records=1", "sampling.max_new_tokens=40")
    recipe_path.write_text(yaml.safe_dump(recipe.model_dump(mode="json")))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "generate", str(recipe_path), "--no-progress"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    location = StoreLocation(recipe.output)
    deadline = time.monotonic() + 120
    committed = 0
    try:
        while time.monotonic() < deadline and process.poll() is None:
            manifest = read_manifest(location) if location.exists("generation.json") else None
            committed = len(manifest.shards) if manifest else 0
            if committed >= 2:
                break
            time.sleep(0.05)
        assert process.poll() is None, process.stderr.read().decode()[-2000:] if process.stderr else ""
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL and committed >= 2
    killed = read_manifest(location)
    assert killed is not None and not killed.complete and len(killed.shards) < 8
    with pytest.raises(GenerationError, match="generation is not finished"):
        expand_generated_data([recipe.output])  # extraction refuses a partial dataset
    # ... unless told to: the committed units alone, and a lineage that says so
    files, lineage = expand_generated_data([recipe.output], allow_unfinished=True)
    assert [Path(f).name for f in files] == sorted(s.path.split("/")[-1] for s in killed.shards)
    assert lineage[0]["complete"] is False and lineage[0]["units"] == sorted(s.unit_index for s in killed.shards)
    summary = run_generation(recipe)
    assert summary.num_units_skipped == len(killed.shards)
    assert summary.num_units_written == 8 - len(killed.shards)
    reference = make_recipe(dataset[1], tmp_path / "uninterrupted", "units.max_records=1", "sampling.max_new_tokens=40")
    run_generation(reference)
    assert read_output(tmp_path / "out") == read_output(tmp_path / "uninterrupted")
    assert not list((tmp_path / "out").rglob("*.tmp"))


def test_a_sigterm_commits_the_units_in_flight_and_stops(dataset: Any, tmp_path: Path) -> None:
    """SIGTERM (a scheduler's time limit, or ``timeout``) hands out no further unit: the units in
    flight commit, the run exits 143 saying it is not complete, and a rerun finishes it."""
    import yaml

    recipe = make_recipe(dataset[1], tmp_path / "out", "units.max_records=1", "sampling.max_new_tokens=40")
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe.model_dump(mode="json")))
    process = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "generate", str(recipe_path), "--no-progress"],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    location = StoreLocation(recipe.output)
    deadline = time.monotonic() + 120
    committed = 0
    while time.monotonic() < deadline and process.poll() is None and committed < 1:
        manifest = read_manifest(location) if location.exists("generation.json") else None
        committed = len(manifest.shards) if manifest else 0
        time.sleep(0.05)
    assert process.poll() is None and committed >= 1
    process.send_signal(signal.SIGTERM)
    process.send_signal(signal.SIGTERM)  # as GNU timeout does: to the job, then to its process group
    out, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped    by signal 15" in out and "rerun the same command" in out
    stopped = read_manifest(location)
    assert stopped is not None and not stopped.complete
    # the units in flight (at most two: one computing, one writing) committed; no unit started after
    assert committed <= len(stopped.shards) <= committed + 2 < 8
    assert [s.unit_index for s in stopped.shards] == list(range(len(stopped.shards)))
    assert not list((tmp_path / "out").rglob("*.tmp"))
    # What a SIGKILL mid-write leaves (tests a race the SIGKILL test above meets only by chance):
    # the run that completes the dataset removes it, and nothing else.
    dead = ["shards/.u000001.jsonl.0a1b.tmp", "rejects/.u000003.jsonl.0a1b.tmp", ".generation.json.0a1b.tmp"]
    for key in [*dead, "rejects/notes.tmp"]:
        (tmp_path / "out" / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "out" / key).write_text("partial")
    summary = run_generation(recipe)
    assert summary.num_units_skipped == len(stopped.shards) and summary.stopped_by_signal is None
    assert [p.name for p in (tmp_path / "out").rglob("*.tmp")] == ["notes.tmp"]
    assert read_manifest(location).complete  # type: ignore[union-attr]


def test_ray_actors_write_what_the_local_run_writes(ray_session: Any, dataset: Any, greedy_run: Any, tmp_path: Path) -> None:
    recipe, _ = greedy_run
    on_ray = make_recipe(dataset[1], tmp_path / "ray", "executor=ray", "ray.num_workers=2", "ray.num_cpus_per_worker=1")
    summary = run_generation(on_ray)
    assert summary.num_workers == 2 and summary.num_written == 5
    assert read_output(tmp_path / "ray") == read_output(Path(recipe.output))


def test_parquet_shards_read_back_by_extract(dataset: Any, tmp_path: Path) -> None:
    recipe = make_recipe(dataset[1], tmp_path / "out", "output_format.format=parquet", "limit=4", "sampling.max_new_tokens=6")
    summary = run_generation(recipe)
    manifest = read_manifest(StoreLocation(recipe.output))
    assert manifest is not None and all(s.path.endswith(".parquet") for s in manifest.shards)
    import pyarrow.parquet as pq

    rows = [r for s in manifest.shards for r in pq.read_table(tmp_path / "out" / s.path).to_pylist()]
    assert len(rows) == summary.num_written == 3
    extract = build_recipe(
        ExtractRecipe,
        {"target": recipe.target, "data": [recipe.output], "store": str(tmp_path / "store"), "executor": "local",
         "model": {"dtype": "float32"}, "batching": {"max_length": 1024, "token_budget": 4096}},
    )
    assert run_extraction(extract).num_samples == 3
