"""Extraction under faults: a Ray worker SIGKILLed mid-shard, the driver killed and the job rerun,
a record that makes the worker raise. The end state is checked with ``verify`` and exact sample sets
(the extraction's own plan, re-derived, is the expected set).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import hsstore
from hsstore import StoreLocation
from hsstore.verify import verify_store
from tests.reliability.conftest import (
    REFERENCE_TARGET,
    REPO,
    expected_sample_ids,
    extract_overrides,
    load_extract_recipe,
    write_text_records,
)

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


def actor_processes(busy: bool) -> list[int]:
    """Pids of live extraction actors (Ray titles them ``ray::_WorkerActor[.method]``); ``busy``:
    only those executing ``run_unit`` now, i.e. in the middle of writing a shard."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith("ray::_WorkerActor") and (not busy or "run_unit" in title):
            pids.append(int(entry.name))
    return pids


def store_sample_ids(url: str) -> list[str]:
    return hsstore.open_store(url).samples.column("sample_id").to_pylist()


def fatal(url: str) -> list[str]:
    return [str(p) for p in verify_store(StoreLocation(url)) if p.fatal]


def test_a_worker_sigkilled_mid_shard_is_replaced_and_the_store_is_exact(ray_session, tmp_path):
    from pipelines.extract import run_extraction

    url = str(tmp_path / "store")
    data = write_text_records(tmp_path / "records.jsonl", 48)
    recipe = load_extract_recipe(url, data, executor="ray")
    killed: list[int] = []

    def kill_a_busy_worker(result, executor) -> None:
        if killed:
            return
        deadline = time.monotonic() + 30
        while not (busy := actor_processes(busy=True)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert busy, "no actor was writing a shard"
        os.kill(busy[0], signal.SIGKILL)
        killed.append(busy[0])

    summary = run_extraction(recipe, on_commit=kill_a_busy_worker)
    assert killed and killed[0] not in actor_processes(busy=False)
    expected = expected_sample_ids(recipe)
    ids = store_sample_ids(url)
    assert len(ids) == len(expected) and set(ids) == expected  # nothing lost, nothing twice
    assert summary.num_units_skipped == 0 and summary.num_samples_written == len(expected)
    assert fatal(url) == []
    # The killed attempt's files, if any, are unreferenced garbage (listed, never read).
    assert all(p.kind == "unreferenced" for p in verify_store(StoreLocation(url)))


def test_the_driver_killed_then_rerun_resumes_without_loss_or_duplicates(tmp_path):
    from pipelines.extract import run_extraction

    url = str(tmp_path / "store")
    data = write_text_records(tmp_path / "records.jsonl", 48)
    recipe_path = tmp_path / "extract.yaml"
    recipe_path.write_text(yaml.safe_dump({"target": str(REFERENCE_TARGET), "data": [str(data)], "store": url}))
    # The driver: the real CLI in its own process, on the local executor (the worker code the Ray
    # actors run, without a second Ray cluster on a 2-core machine), killed after its first commit.
    overrides = [a for o in extract_overrides(url, data, executor="local") for a in ("--set", o)]
    driver = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli", "extract", str(recipe_path), "--no-progress", *overrides],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and driver.poll() is None:
            try:
                if hsstore.committed_shard_ids(url):
                    break
            except hsstore.HsstoreError:
                pass
            time.sleep(0.05)
        assert driver.poll() is None, "the driver finished before it could be killed"
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    committed = hsstore.committed_shard_ids(url)
    assert committed and fatal(url) == []
    # Rerun the same job (in process: the resume logic is the driver's, whichever executor runs the
    # units; the Ray executor's retries are the previous test's subject): committed units are skipped.
    recipe = load_extract_recipe(url, data, executor="local")
    summary = run_extraction(recipe)
    assert summary.num_units_skipped >= len(committed)
    expected = expected_sample_ids(recipe)
    ids = store_sample_ids(url)
    assert len(ids) == len(expected) and set(ids) == expected
    assert fatal(url) == []


@pytest.fixture
def hostile_tokenizer(tmp_path: Path) -> Path:
    """The reference tokenizer plus one added token whose id (8192) is past the target's
    embedding table: a real tokenizer/model mismatch that makes the worker raise on any record
    holding that token, and only on those."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_TARGET)
    tokenizer.add_tokens(["<|hostile|>"])
    path = tmp_path / "hostile-tokenizer"
    tokenizer.save_pretrained(path)
    assert tokenizer.convert_tokens_to_ids("<|hostile|>") == 8192
    return path


def write_with_poison(tmp_path: Path) -> Path:
    data = write_text_records(tmp_path / "records.jsonl", 24)
    lines = data.read_text().splitlines()
    lines[13] = '{"id": "poison", "text": "a record with a <|hostile|> token in it"}'
    data.write_text("\n".join(lines) + "\n")
    return data


def test_a_record_that_makes_the_worker_raise_fails_clearly_and_keeps_the_store_valid(tmp_path, hostile_tokenizer):
    """Today's contract: the unit holding the record fails the job with an error naming the unit;
    units committed before it stay committed and sound."""
    from pipelines.extract import run_extraction

    url = str(tmp_path / "store")
    recipe = load_extract_recipe(url, write_with_poison(tmp_path), executor="local", **{"tokenizer.path": str(hostile_tokenizer)})
    with pytest.raises(Exception, match=r"index out of range|out of bounds|IndexError") as raised:
        run_extraction(recipe)
    print("error seen by the user:", type(raised.value).__name__, str(raised.value)[:300])
    assert fatal(url) == []
    ids = set(store_sample_ids(url))
    assert ids < expected_sample_ids(recipe)


@pytest.mark.xfail(
    strict=True,
    reason="bug (pipelines/extract/worker.py ExtractionWorker.run_unit): an exception on one record "
    "fails its whole unit and the job; the issue asks for the record to be isolated (retry the batch "
    "sample by sample, reject the failing one with a reason) and the rest to go on",
)
def test_a_record_that_makes_the_worker_raise_is_isolated_and_the_rest_goes_on(tmp_path, hostile_tokenizer):
    from pipelines.extract import run_extraction

    url = str(tmp_path / "store")
    recipe = load_extract_recipe(url, write_with_poison(tmp_path), executor="local", **{"tokenizer.path": str(hostile_tokenizer)})
    summary = run_extraction(recipe)
    expected = expected_sample_ids(recipe)
    ids = set(store_sample_ids(url))
    assert len(ids) == len(expected) - 1 and ids < expected
    assert summary.num_rejected == 1
    rejects = (tmp_path / "store" / "rejects" / "extract.jsonl").read_text()
    assert '"source_id": "poison"' in rejects
