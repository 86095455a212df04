"""Property-based fuzzing (Hypothesis) of the record reader and of manifests inside a real store.

Extends tests/hsstore/test_manifest.py (parser on random JSON, random bytes, value-mutated
manifests) with what it does not do: structural mutations (deleted keys, duplicated or reordered
entries) of a manifest *in a store*, driven through ``open_store`` and ``verify``; and the JSONL
record reader on arbitrary lines. Invariants: no crash, every line accounted for, errors are the
project's own and name their source.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hsstore
from hsstore import HsstoreError, StoreLocation
from hsstore.verify import verify_store
from pipelines.extract.records import ROLE_ALIASES, Record, Rejection, iter_records, parse_record
from tests.support.stores import write_store

pytestmark = pytest.mark.reliability

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=16,
)
roles = st.sampled_from([*ROLE_ALIASES, "Assistant", "USER", "wizard", "", "system "])
contents = st.text(max_size=20) | st.integers() | st.none() | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]), "text": st.text(max_size=5)}), max_size=2)
turns = st.fixed_dictionaries({"role": roles, "content": contents}) | st.fixed_dictionaries({"from": roles, "value": contents})
record_like = st.fixed_dictionaries(
    {},
    optional={
        "id": st.text(max_size=8) | st.integers() | st.booleans() | st.none(),
        "text": st.text(max_size=30) | st.integers() | st.none(),
        "messages": st.lists(turns, max_size=4) | st.text(max_size=4),
        "conversations": st.lists(turns, max_size=3),
        "meta": json_values,
    },
)


def check_item(item: Record | Rejection, origin: str) -> None:
    assert item.origin == origin
    if isinstance(item, Rejection):
        assert item.message.startswith(f"{origin}: ") and len(item.excerpt) <= 200
        json.dumps(item.to_json())  # the rejects file can always hold it
    else:
        assert (item.text is None) != (item.messages is None)
        if item.text is not None:
            assert isinstance(item.text, str) and item.text.strip()
        else:
            assert item.messages and all(m["role"] in set(ROLE_ALIASES.values()) and isinstance(m["content"], str) for m in item.messages)


@settings(max_examples=400, deadline=None)
@given(record_like | json_values)
def test_parse_record_accepts_or_rejects_anything_decoded(obj):
    check_item(parse_record(obj, "f.jsonl:1", "f.jsonl:1"), "f.jsonl:1")


line_bytes = (
    st.binary(max_size=60).map(lambda b: b.replace(b"\n", b" "))
    | (record_like | json_values).map(lambda v: json.dumps(v).encode())
    | (record_like).map(lambda v: json.dumps(v, ensure_ascii=False).encode())
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(line_bytes, min_size=1, max_size=12), st.booleans())
def test_the_jsonl_reader_accounts_for_every_line(tmp_path, lines, crlf):
    path = tmp_path / "fuzz.jsonl"
    ending = b"\r\n" if crlf else b"\n"
    path.write_bytes(ending.join(lines) + ending)
    items = list(iter_records([str(path)]))
    expected_lines = []
    for number, raw in enumerate(lines, start=1):
        try:
            blank = not raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            blank = False
        if not blank:
            expected_lines.append(number)
    assert [int(item.origin.rsplit(":", 1)[1]) for item in items] == expected_lines
    for item in items:
        check_item(item, item.origin)


# -- manifests inside a store ------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    url = tmp_path_factory.mktemp("fuzz") / "store"
    write_store(str(url), num_samples=10, shard_max_tokens=100)
    return url


def mutate(data: dict, draw) -> str:  # type: ignore[no-untyped-def]
    """One structural mutation somewhere in the manifest; returns a description."""
    path: list = []
    node: object = data
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else list(range(len(node)))))
        if not isinstance(node[key], (dict, list)):  # type: ignore[index]
            break
        path.append(key)
        node = node[key]  # type: ignore[index]
    if not isinstance(node, (dict, list)) or not node:
        return "nothing"
    keys = sorted(node) if isinstance(node, dict) else list(range(len(node)))
    key = draw(st.sampled_from(keys))
    action = draw(st.sampled_from(["delete", "duplicate", "replace", "swap"]))
    if action == "delete":
        del node[key]  # type: ignore[arg-type]
    elif action == "duplicate" and isinstance(node, list):
        node.append(json.loads(json.dumps(node[key])))
    elif action == "swap" and isinstance(node, list) and len(node) > 1:
        node.reverse()
    else:
        node[key] = draw(json_values | st.just("../escape") | st.just(-1) | st.just(10**12))  # type: ignore[index]
    return f"{action} {'.'.join(map(str, [*path, key]))}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_mutated_manifests_in_a_store_fail_cleanly_through_open_and_verify(pristine, tmp_path_factory, data):
    store = tmp_path_factory.mktemp("mutant") / "store"
    shutil.copytree(pristine, store)
    manifest = json.loads((store / "manifest.json").read_text())
    what = mutate(manifest, data.draw)
    (store / "manifest.json").write_text(json.dumps(manifest))
    problems = verify_store(StoreLocation(str(store)))  # never raises
    try:
        opened = hsstore.open_store(str(store))
    except HsstoreError as err:
        assert "manifest.json" in str(err), what
        assert any(p.fatal and p.kind == "manifest" for p in problems), (what, problems)
        return
    # Accepted by the parser: reading every sample either works or fails with the project's error.
    try:
        for index in range(opened.num_samples):
            opened.read_sample(index, as_numpy=True)
    except (HsstoreError, KeyError, IndexError) as err:
        assert any(p.fatal for p in problems), (what, err, problems)
