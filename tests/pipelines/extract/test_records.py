"""Reading records: formats, ShareGPT/OpenAI roles, and every rejection reason with its message."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.extract.errors import RecordSourceError
from pipelines.extract.records import Record, Rejection, RejectReason, iter_records
from pipelines.extract.tokenize import SampleTokenizer
from tests.pipelines.extract.conftest import write_jsonl
from tests.pipelines.extract.helpers import make_recipe, plan_recipe
from tests.support.paths import REFERENCE_TARGET

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(REFERENCE_TARGET)


def read_one(tmp_path: Path, line: object, **kwargs: object) -> Record | Rejection:
    path = write_jsonl(tmp_path / "data.jsonl", [line])
    (item,) = list(iter_records([str(path)], **kwargs))  # type: ignore[arg-type]
    return item


# Each case: the raw line, the reason, and the message the user reads in the rejects file.
REJECTION_CASES = [
    (b'{"text": "unterminated', RejectReason.NOT_JSON, r"data.jsonl:1: not JSON \(Unterminated string"),
    (b'{"text": "caf\xe9"}', RejectReason.INVALID_UTF8, r"data.jsonl:1: not valid UTF-8 \(invalid continuation byte"),
    ('["a", "list"]', RejectReason.WRONG_TYPE, r"data.jsonl:1: expected a JSON object, found list"),
    ({"text": 42}, RejectReason.WRONG_TYPE, r"'text' must be a string, found int"),
    ({"id": [1], "text": "x"}, RejectReason.WRONG_TYPE, r"'id' must be a string or integer, found list"),
    ({"body": "x"}, RejectReason.WRONG_TYPE, r"has neither 'text' nor 'messages'"),
    ({"text": "x", "messages": CHAT}, RejectReason.WRONG_TYPE, r"has both 'text' and 'messages'; keep one"),
    ({"messages": "hi"}, RejectReason.WRONG_TYPE, r"'messages' must be a list, found str"),
    ({"messages": [{"role": "user", "content": 3}]}, RejectReason.WRONG_TYPE, r"messages\[0\].content must be a string or text parts, found int"),
    ({"messages": [{"content": "x"}]}, RejectReason.WRONG_TYPE, r"messages\[0\] needs a string 'role'"),
    ({"text": "  \n "}, RejectReason.EMPTY, r"data.jsonl:1: 'text' is empty"),
    ({"messages": []}, RejectReason.EMPTY, r"'messages' is an empty list"),
    ({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": " "}]}, RejectReason.EMPTY, r"every turn of 'messages' is empty"),
    ({"messages": [{"role": "narrator", "content": "x"}]}, RejectReason.UNKNOWN_ROLE, r"messages\[0\] has unknown role 'narrator' \(known: assistant, "),
    ({"conversations": [{"from": "bot", "value": "x"}]}, RejectReason.UNKNOWN_ROLE, r"conversations\[0\] has unknown role 'bot'"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, RejectReason.NO_ASSISTANT_TURN, r"has no assistant turn, so no token would carry loss"),
]


@pytest.mark.parametrize(("line", "reason", "message"), REJECTION_CASES)
def test_every_record_level_rejection(tmp_path: Path, line: object, reason: RejectReason, message: str) -> None:
    item = read_one(tmp_path, line)
    assert isinstance(item, Rejection), item
    assert item.reason == reason
    assert item.origin == "data.jsonl:1"
    assert re.search(message, item.message), item.message
    assert set(item.to_json()) == {"reason", "message", "origin", "source_id", "excerpt"}


def test_prompt_only_chats_pass_when_no_assistant_is_required(tmp_path: Path) -> None:
    item = read_one(tmp_path, {"messages": [{"role": "user", "content": "q"}]}, require_assistant=False)
    assert isinstance(item, Record) and item.kind == "chat"


def test_sharegpt_and_openai_forms_normalise_alike(tmp_path: Path) -> None:
    sharegpt = {"id": 7, "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}, {"role": "assistant", "content": "hello"}]}
    path = write_jsonl(tmp_path / "data.jsonl", [sharegpt, {"messages": CHAT, "meta": {"x": 1}}, "", parts])
    items = list(iter_records([str(path)]))
    assert len(items) == 3, "the blank line is not a record"
    assert all(isinstance(i, Record) for i in items)
    assert items[0].source_id == "7" and items[1].source_id == "data.jsonl:2"
    assert items[0].content() == items[1].content() == items[2].content() == {"messages": CHAT}


def test_parquet_and_compressed_jsonl(tmp_path: Path) -> None:
    table = pa.table({"id": ["a", "b", None], "text": ["x = 1", None, "y = 2"], "messages": [None, CHAT, None]})
    pq.write_table(table, tmp_path / "data.parquet")
    items = list(iter_records([str(tmp_path / "data.parquet")]))
    assert [type(i).__name__ for i in items] == ["Record", "Record", "Record"]
    assert [i.source_id for i in items] == ["a", "b", "data.parquet:row 3"]
    assert items[1].messages == tuple(CHAT)

    import gzip

    with gzip.open(tmp_path / "data.jsonl.gz", "wt") as handle:
        handle.write('{"text": "z = 3"}\n')
    (item,) = list(iter_records([f"file://{tmp_path}/data.jsonl.gz"]))
    assert isinstance(item, Record) and item.text == "z = 3"


def test_missing_or_unknown_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(RecordSourceError, match=r"data file .*nope.jsonl does not exist"):
        list(iter_records([str(tmp_path / "nope.jsonl")]))
    with pytest.raises(RecordSourceError, match=r"data.csv: unknown format \(expected .jsonl"):
        list(iter_records([str(tmp_path / "data.csv")]))


def test_tokenization_rejections_and_duplicates(tmp_path: Path) -> None:
    """Through the streaming planner, as ``hsstore extract`` plans."""
    records = [
        {"id": "long", "text": "word " * 50},
        {"id": "ok", "text": "x = 1"},
        {"id": "again", "text": "x = 1"},
        {"id": "cut", "messages": [{"role": "user", "content": "question " * 40}, {"role": "assistant", "content": "a"}]},
        {"id": "bad-order", "messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]},
    ]
    path = write_jsonl(tmp_path / "data.jsonl", records)
    settings = {"tokenizer": {"loss_mask": "prefix_diff"}, "planning": {"num_workers": 1}}
    drop = make_recipe(REFERENCE_TARGET, [path], tmp_path / "store", batching={"max_length": 16, "too_long": "drop"}, **settings)
    plan = plan_recipe(drop)
    assert [s.source_id for s in plan.samples] == ["ok", "bad-order"]
    by_id = {r.source_id: r for r in plan.rejections}
    assert by_id["long"].reason == RejectReason.TOO_LONG
    assert "data.jsonl:1: 51 tokens is over max_length=16 (set batching.too_long: truncate" in by_id["long"].message
    assert by_id["again"].reason == RejectReason.DUPLICATE
    assert "data.jsonl:3: same content as data.jsonl:2" in by_id["again"].message
    assert by_id["cut"].reason == RejectReason.TOO_LONG
    assert plan.rejected_by_reason == {"duplicate": 1, "too_long": 2}

    truncate = make_recipe(REFERENCE_TARGET, [path], tmp_path / "store", batching={"max_length": 16, "too_long": "truncate"}, limit=4, **settings)
    plan = plan_recipe(truncate)
    assert plan.num_records == 4 and plan.num_truncated == 1
    assert [s.source_id for s in plan.samples] == ["long", "ok"]
    assert len(plan.samples[0].input_ids) == 16  # "long" (51 tokens) is the one truncated
    (cut,) = [r for r in plan.rejections if r.source_id == "cut"]
    assert cut.reason == RejectReason.NO_LOSS_TOKENS
    assert cut.message == "data.jsonl:4: no assistant token is left after truncation to max_length to carry loss"


def test_template_errors_are_rejections(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A template that raises (role order, say) rejects the record with jinja's own words."""
    import copy

    strict = copy.copy(tokenizer)
    strict.chat_template = (
        "{% for m in messages %}{% if loop.first and m['role'] != 'user' %}"
        "{{ raise_exception('Conversations must start with a user turn') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    )
    sample_tokenizer = SampleTokenizer(strict, max_length=64)
    record = Record("r", "data.jsonl:9", messages=({"role": "assistant", "content": "a"},))
    rejection = sample_tokenizer(record)
    assert isinstance(rejection, Rejection) and rejection.reason == RejectReason.TEMPLATE_ERROR
    assert rejection.message.startswith("data.jsonl:9: chat template failed: TemplateError: Conversations must start")


def test_sample_ids_are_stable_and_depend_on_settings(tokenizer) -> None:  # type: ignore[no-untyped-def]
    record = Record("a", "f:1", text="x = 1")
    same_content = Record("b", "g:7", text="x = 1")
    first = SampleTokenizer(tokenizer, max_length=64)
    again = SampleTokenizer(tokenizer, max_length=64)
    longer = SampleTokenizer(tokenizer, max_length=65)
    other_template = SampleTokenizer(tokenizer, max_length=64, identity={"chat_template_sha256": "x"})
    assert first.sample_id(record) == again.sample_id(record) == first.sample_id(same_content)
    assert len(first.sample_id(record)) == 32
    assert first.sample_id(record) != longer.sample_id(record)
    assert first.sample_id(record) != other_template.sample_id(record)
    assert first.sample_id(record) != first.sample_id(Record("a", "f:1", text="x = 2"))
