"""Extraction under faults: Ray workers SIGKILLed mid-shard again and again, a record that makes
the worker raise. (One killed actor and a killed driver rerun are the extraction's own tests.) The end state is checked with ``verify`` and exact sample sets
(the extraction's own plan, re-derived, is the expected set).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import hsstore
from tests.reliability.conftest import (
    REFERENCE_TARGET,
    expected_sample_ids,
    load_extract_recipe,
    write_text_records,
)

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


def store_sample_ids(url: str) -> list[str]:
    return hsstore.open_store(url).samples.column("sample_id").to_pylist()


def test_workers_sigkilled_mid_shard_again_and_again_leave_an_exact_store(ray_session, tmp_path):
    """The short version of tests/support/load_extract_kill.py: 2 Ray actors on the reference target,
    a busy one (inside ``run_unit``, i.e. writing a shard) SIGKILLed after every 2 commits. Ray
    restarts it and retries its unit into a fresh attempt folder; the committer keeps one record per
    shard id. (A single kill and a killed driver are tests/pipelines/extract/test_ray_and_crashes.py.)"""
    from tests.support.load_extract_kill import run_load

    data = write_text_records(tmp_path / "records.jsonl", 30)
    result = run_load(tmp_path, records=30, kill_every=2, max_length=64, unit_tokens=120, data_source=data, ray_started=True)
    assert len(result.kills) >= 2, result.kills
    assert result.exact and result.samples == 30
    assert result.verify_fatal == []
    assert all(kill.next_commit_s is not None for kill in result.kills[:-1])  # work went on after each kill


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
