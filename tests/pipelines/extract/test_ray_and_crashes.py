"""The Ray path with 2 CPU actors (one SIGKILLed mid-run), and a SIGKILLed driver that is rerun."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hsstore
from pipelines.extract import run_extraction
from tests.pipelines.extract.conftest import MIXED_RECORDS, write_jsonl
from tests.pipelines.extract.helpers import as_array, make_recipe, stored_samples
from tests.support.paths import REPO_ROOT


def many_records(count: int) -> list[dict[str, Any]]:
    """Distinct text and chat records of varied lengths."""
    records: list[dict[str, Any]] = []
    for i in range(count):
        if i % 3 == 0:
            chat = [{"role": "user", "content": f"Task {i}?"}, {"role": "assistant", "content": f"answer = {i}\n" * (1 + i % 4)}]
            records.append({"id": f"c{i}", "messages": chat})
        else:
            records.append({"id": f"t{i}", "text": f"value_{i} = {i} * 2\n" * (1 + i % 7)})
    return records


@pytest.mark.slow
def test_ray_actors_survive_a_killed_worker(ray_session: Any, tiny_qwen3: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", [*MIXED_RECORDS, *many_records(18)])
    ray_recipe = make_recipe(
        tiny_qwen3,
        [data],
        tmp_path / "ray-store",
        executor="ray",
        ray={"num_workers": 2, "num_cpus_per_worker": 1, "max_restarts": 2, "max_task_retries": 2},
    )
    killed: list[int] = []

    def kill_a_busy_actor(result: Any, executor: Any) -> None:
        # After the first commit the other actor still has units queued: kill it mid-work.
        if not killed:
            pid = executor.pids[1]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    summary = run_extraction(ray_recipe, on_commit=kill_a_busy_actor)
    assert killed and summary.num_units > 4
    assert summary.num_samples_written == summary.num_samples == len(MIXED_RECORDS) + 18
    store = hsstore.open_store(ray_recipe.store)
    assert store.verify() == [], "retried units are committed once and dead attempts are removed"
    assert sorted(store.samples["source_id"].to_pylist()) == sorted(r["id"] for r in [*MIXED_RECORDS, *many_records(18)])

    # The same units, in process: identical shards, sample by sample.
    local_recipe = make_recipe(tiny_qwen3, [data], tmp_path / "local-store")
    run_extraction(local_recipe)
    by_ray, by_local = stored_samples(ray_recipe.store), stored_samples(local_recipe.store)
    assert by_ray.keys() == by_local.keys()
    for source_id, ray_sample in by_ray.items():
        local_sample = by_local[source_id]
        assert ray_sample["sample_id"] == local_sample["sample_id"]
        for name in ("input_ids", "loss_mask", "aux_hidden_states", "final_hidden_state"):
            assert np.array_equal(as_array(ray_sample[name].float()), as_array(local_sample[name].float())), name
    assert hsstore.open_store(ray_recipe.store).lineage == hsstore.open_store(local_recipe.store).lineage.model_copy(
        update={"target": hsstore.open_store(ray_recipe.store).lineage.target}
    )


@pytest.mark.slow
def test_sigkilled_driver_then_rerun_gives_exactly_the_input(tiny_qwen3: Path, tmp_path: Path) -> None:
    records = many_records(60)
    data = write_jsonl(tmp_path / "data.jsonl", records)
    store = tmp_path / "store"
    recipe_path = tmp_path / "extract.yaml"
    recipe_path.write_text(
        f"target: {tiny_qwen3}\ndata: [{data}]\nstore: {store}\nexecutor: local\n"
        "model: {dtype: float32, device: cpu}\ncapture: {aux_layer_ids: [0, 2, 4]}\n"
        "batching: {max_length: 256, token_budget: 512}\nunits: {max_tokens: 48}\n"
        "codecs: {chunk_bytes: 16384}\n"
    )
    # A random point: after a random number of committed units plus a random fraction of one.
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    kill_after_units, delay = rng.randint(1, 20), rng.uniform(0.0, 0.08)
    log = open(tmp_path / "driver.log", "wb")  # noqa: SIM115 - closed below, after the child is gone
    driver = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "extract", str(recipe_path), "--no-progress"],
        cwd=REPO_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while len(hsstore.committed_shard_ids(str(store))) < kill_after_units and driver.poll() is None:
            assert time.monotonic() < deadline, "the driver did not get far enough in 120 s"
            time.sleep(0.005)
        time.sleep(delay)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
        log.close()
    committed_before = hsstore.committed_shard_ids(str(store))
    assert committed_before, (tmp_path / "driver.log").read_text()

    from pipelines.extract.recipe import ExtractRecipe
    from pipelines.recipe import load_recipe

    summary = run_extraction(load_recipe(ExtractRecipe, recipe_path))
    context = f"seed {seed}: killed with {len(committed_before)} of {summary.num_units} units committed"
    assert len(committed_before) < summary.num_units, f"{context}: the driver finished before the kill"
    assert summary.num_units_skipped == len(committed_before), context
    assert summary.num_samples == len(records), context
    opened = hsstore.open_store(str(store))
    source_ids = opened.samples["source_id"].to_pylist()
    assert sorted(source_ids) == sorted(r["id"] for r in records), context
    assert len(set(opened.samples["sample_id"].to_pylist())) == len(records), context
    assert opened.verify() == [], context
