"""Draft vocabulary calibration and the trimmed-vocabulary JSON."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
import torch

from hsstore.errors import RecipeError
from pipelines.train.vocab import (
    DraftVocab,
    calibrate_vocab,
    count_loss_tokens,
    count_loss_tokens_in_table,
    read_vocab_file,
    write_vocab_file,
)
from tests.support.models import tiny_draft


def test_calibration_keeps_the_most_frequent_ids_sorted_with_ties_to_the_lower_id():
    counts = np.array([5, 0, 9, 5, 1, 9, 0, 5])
    vocab = calibrate_vocab(counts, 4)
    # ids 2 and 5 (count 9), then the three-way tie at 5 (ids 0, 3, 7) keeps the lower 0 and 3.
    assert vocab.target_ids.tolist() == [0, 2, 3, 5]
    assert vocab.d2t.dtype == torch.int64 and vocab.t2d.dtype == torch.bool
    assert (torch.arange(4) + vocab.d2t).tolist() == [0, 2, 3, 5]
    assert vocab.t2d.nonzero().flatten().tolist() == [0, 2, 3, 5]
    full = calibrate_vocab(counts, 8)
    assert full.d2t.eq(0).all() and full.t2d.all()
    with pytest.raises(RecipeError, match=r"draft_vocab_size=9 must be in \[1, 8\]"):
        calibrate_vocab(counts, 9)


def test_counts_only_loss_masked_tokens_from_a_sample_table():
    table = pa.table(
        {
            "input_ids": pa.array([[1, 2, 2, 3], [3, 3, 0]], type=pa.list_(pa.int32())),
            "loss_mask": pa.array([[0, 1, 1, 0], [1, 1, 0]], type=pa.list_(pa.uint8())),
        }
    )
    counts = count_loss_tokens_in_table(table, vocab_size=5)
    assert counts.tolist() == [0, 0, 2, 2, 0]
    assert count_loss_tokens([np.array([4, 4])], [np.array([1, 0])], 5).tolist() == [0, 0, 0, 0, 1]
    with pytest.raises(ValueError, match="token id 7 outside the target vocabulary of 5"):
        count_loss_tokens([np.array([7])], [np.array([1])], 5)


def test_vocab_file_round_trip_and_bare_list(tmp_path):
    vocab = DraftVocab.from_target_ids([9, 3, 4], 16)
    path = write_vocab_file(vocab, tmp_path / "vocab.json")
    back = read_vocab_file(path, 16)
    assert back.target_ids.tolist() == [3, 4, 9] and back.vocab_size == 16
    (tmp_path / "list.json").write_text(json.dumps([1, 0, 15]))
    assert read_vocab_file(tmp_path / "list.json", 16).target_ids.tolist() == [0, 1, 15]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            {"format_version": 1, "vocab_size": 32, "draft_vocab_size": 1, "target_ids": [1]},
            "made for a target vocabulary of 32 ids, this target has 16",
        ),
        ({"format_version": 2, "vocab_size": 16, "target_ids": [1]}, "format_version 2 is not 1"),
        ([1, 1, 2], r"repeats 1 id\(s\)"),
        ([3, 16], r"target ids must lie in \[0, 16\)"),
        (["a"], "expected a list of integer target ids"),
        ([], "the draft vocabulary is empty"),
    ],
)
def test_vocab_file_errors_name_the_file(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(RecipeError, match=message):
        read_vocab_file(path, 16)


def test_vocab_installs_into_a_draft():
    draft = tiny_draft()
    counts = np.arange(draft.config.vocab_size)[::-1].copy()  # lower ids are more frequent
    vocab = calibrate_vocab(counts, draft.config.draft_vocab_size)
    draft.set_vocab_mapping(vocab.d2t, vocab.t2d)
    ids = torch.arange(draft.config.draft_vocab_size)
    assert torch.equal(draft.draft_to_target(ids), vocab.target_ids)
    with pytest.raises(ValueError, match="do not match draft_vocab_size=96"):
        draft.set_vocab_mapping(vocab.d2t[:-1], vocab.t2d)
