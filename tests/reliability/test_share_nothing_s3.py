"""Issue 16.2: two extraction processes that share nothing but an ``s3://`` store (moto's S3 server on
loopback), as two nodes would: separate processes, separate temporary folders, each its partition
rank. Every unit is committed once, nothing is lost, ``verify`` finds nothing; then ``hsstore
train`` reads the store from S3."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import hsstore
from hsstore.storage import StoreLocation
from hsstore.verify import verify_store
from tests.reliability.conftest import (
    REFERENCE_TARGET,
    expected_sample_ids,
    extract_overrides,
    write_text_records,
)
from tests.support.paths import REPO_ROOT

pytestmark = [pytest.mark.reliability, pytest.mark.slow]



def test_two_share_nothing_writers_fill_one_s3_store_then_train_reads_it(s3_store, s3_endpoint, tmp_path):
    url, options = s3_store
    data = write_text_records(tmp_path / "records.jsonl", 48, words=20)
    settings = {"executor": "local", "partition.world_size": 2, "units.max_tokens": 200}
    base_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    processes = []
    for rank in range(2):
        temp = tmp_path / f"node{rank}-tmp"
        temp.mkdir()
        env = {**base_env, "TMPDIR": str(temp)}
        overrides = extract_overrides(url, data, **settings, **{"partition.rank": rank})
        if rank == 0:
            # Node 0 finds the endpoint in the standard AWS environment, as s3fs reads it ...
            env["AWS_ENDPOINT_URL"] = s3_endpoint
        else:
            # ... node 1 in the recipe's storage_options.
            overrides.append(f"storage_options={json.dumps(options)}")
        command = [sys.executable, "-m", "pipelines.cli", "extract", "recipes/reference/extract.yaml", "--json", "--no-progress"]
        for override in overrides:
            command += ["--set", override]
        processes.append(subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    summaries = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
        summaries.append(json.loads(stdout[stdout.index("{"):]))

    from pipelines.extract.recipe import ExtractRecipe
    from pipelines.recipe import load_recipe

    recipe = load_recipe(ExtractRecipe, str(REPO_ROOT / "recipes/reference/extract.yaml"), extract_overrides(url, data, **settings))
    num_units = summaries[0]["num_units"]
    assert num_units >= 4 and summaries[1]["num_units"] == num_units
    # Each rank extracted its own units, and between them all of them.
    assert sum(s["num_samples_written"] for s in summaries) == len(expected_sample_ids(recipe))
    manifest_ids = sorted(s.shard_id for s in hsstore.open_store(url, storage_options=options).manifest.shards)
    assert manifest_ids == [f"u{i:06d}" for i in range(num_units)]
    store = hsstore.open_store(url, storage_options=options)
    sample_ids = store.samples.column("sample_id").to_pylist()
    assert len(sample_ids) == len(set(sample_ids)) and set(sample_ids) == expected_sample_ids(recipe)
    assert verify_store(StoreLocation(url, options)) == []
    # The last rank to finish cleaned up; at most one of them saw the other's units still pending.
    assert sorted(s["num_units_elsewhere"] > 0 for s in summaries) in ([False, False], [False, True])

    # Training streams the store from S3 (the endpoint from the environment, as for node 0).
    train = [
        sys.executable, "-m", "pipelines.cli", "train", "recipes/reference/train-eagle3.yaml",
        "--set", f"store={url}", "--set", f"target={REFERENCE_TARGET}", "--set", f"output_dir={tmp_path / 'draft'}",
        "--set", "max_steps=3", "--set", "device=cpu", "--set", "loader.token_budget=256",
        "--set", "draft.vocab.draft_vocab_size=512",
    ]
    done = subprocess.run(train, cwd=REPO_ROOT, env={**base_env, "AWS_ENDPOINT_URL": s3_endpoint},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "draft" / "metrics.jsonl").exists()
    # The shard bytes came through the default reader: obstore where it is installed (hsstore[s3]).
    reader = "obstore" if importlib.util.find_spec("obstore") else "fsspec"
    assert f"reading {url} (" in done.stderr and f"through {reader}:" in done.stderr, done.stderr[-3000:]
