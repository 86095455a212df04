"""The torch-free tokenizer loading picks AutoTokenizer's class and tokenizes byte for byte alike.

Each (model type, declared class) pair of the loader's table is checked against AutoTokenizer on
the reference target's tokenizer files relabelled with that pair, so a transformers upgrade that
changes AutoTokenizer's choice fails here rather than changing samples silently.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from pipelines.extract.records import Record, parse_record
from pipelines.extract.tokenize import SampleTokenizer, TokenizedSample
from pipelines.extract.tokenizer_loader import (
    _TORCH_FREE_CLASSES,
    load_tokenizer,
    tokenizer_module,
    torch_free_tokenizer_class,
)
from tests.pipelines.extract.conftest import MIXED_RECORDS
from tests.support.paths import REFERENCE_TARGET

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def relabelled_target(directory: Path, model_type: str, tokenizer_class: str, **extra: Any) -> str:
    """The reference target's tokenizer under another model type and declared tokenizer class."""
    directory.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(REFERENCE_TARGET / name, directory / name)
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config.update(tokenizer_class=tokenizer_class, **extra)
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(directory)


def auto_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def records() -> list[Record]:
    parsed = [parse_record(obj, f"mixed.jsonl:{i}", f"r{i}") for i, obj in enumerate(MIXED_RECORDS)]
    parsed.append(Record("p0", "mixed.jsonl:p0", text="Q: 2+2?\nA: 4", prompt="Q: 2+2?\nA:"))
    assert all(isinstance(record, Record) for record in parsed)
    return parsed  # type: ignore[return-value]


def samples(tokenizer: Any, max_length: int = 64) -> list[tuple[Any, ...]]:
    """Each record's sample (id, ids, mask, truncated) or rejection, for an exact comparison."""
    sample_tokenizer = SampleTokenizer(tokenizer, max_length=max_length, too_long="drop")
    out: list[tuple[Any, ...]] = []
    for record in records():
        result = sample_tokenizer(record)
        if isinstance(result, TokenizedSample):
            out.append(
                (
                    result.sample_id,
                    result.input_ids.tobytes(),
                    result.loss_mask.tobytes(),
                    result.truncated,
                )
            )
        else:
            out.append((result.reason, result.message))
    return out


def test_reference_target_loads_without_autotokenizer_and_tokenizes_alike() -> None:
    path = str(REFERENCE_TARGET)
    assert torch_free_tokenizer_class(path) is not None
    ours, theirs = load_tokenizer(path), auto_tokenizer(path)
    assert type(ours) is type(theirs)
    assert ours.chat_template == theirs.chat_template
    assert samples(ours) == samples(theirs)
    # A short max_length rejects some records as too long: the rejections agree too.
    short = samples(ours, max_length=12)
    assert short == samples(theirs, max_length=12)
    assert any(item[0] == "too_long" for item in short)
    assert tokenizer_module(path) == type(ours).__module__


@pytest.mark.parametrize(("model_type", "declared"), sorted(_TORCH_FREE_CLASSES))
def test_each_table_pair_is_autotokenizers_choice(
    tmp_path: Path, model_type: str, declared: str
) -> None:
    from transformers import AutoConfig

    path = relabelled_target(tmp_path / "target", model_type, declared)
    # AutoTokenizer reads the model type through AutoConfig: the pair is what it sees.
    assert AutoConfig.from_pretrained(path).model_type == model_type
    ours, theirs = load_tokenizer(path), auto_tokenizer(path)
    assert type(ours) is type(theirs) is torch_free_tokenizer_class(path)
    assert samples(ours) == samples(theirs)
    texts = ["def f(x):\n    return x  # é ✓", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert ours(text, return_offsets_mapping=True) == theirs(text, return_offsets_mapping=True)


def test_other_checkpoints_go_through_autotokenizer(tmp_path: Path) -> None:
    # transformers distrusts a "qwen2" checkpoint's declared class and loads Qwen2Tokenizer: only
    # AutoTokenizer knows that, so the pair is not in the table.
    qwen2 = relabelled_target(tmp_path / "qwen2", "qwen2", "TokenizersBackend")
    assert torch_free_tokenizer_class(qwen2) is None
    assert type(load_tokenizer(qwen2)) is type(auto_tokenizer(qwen2))
    assert tokenizer_module(qwen2) == "transformers.models.auto.tokenization_auto"
    # Remote code, and a directory without the files, also defer.
    remote = relabelled_target(
        tmp_path / "remote", "qwen3", "TokenizersBackend", auto_map={"AutoTokenizer": ["x.Y", None]}
    )
    assert torch_free_tokenizer_class(remote) is None
    assert torch_free_tokenizer_class(str(tmp_path / "missing")) is None
