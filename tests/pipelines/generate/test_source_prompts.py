"""The prompt-set builder: reserved files, transformers, eval overlaps and copies never become prompts."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pipelines.generate.source_prompts import (
    USER_PREFIX,
    BuildOptions,
    SourceRoot,
    build_prompts,
    installed_roots,
    is_reserved,
    main,
    read_reserved,
)
from tests.support.paths import SHARED_DATA

CODE = "".join(f"def function_{i}(value):\n    return value * {i} + {i % 7}\n\n\n" for i in range(40))


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture()
def tree(tmp_path: Path) -> dict[str, object]:
    stdlib = tmp_path / "lib" / "python3.11"
    site = tmp_path / "site"
    write(stdlib / "json" / "decoder.py", CODE.replace("value", "doc"))  # reserved
    write(stdlib / "keep.py", CODE.replace("value", "kept"))
    write(stdlib / "test" / "test_keep.py", CODE.replace("value", "tested"))
    write(site / "transformers" / "models" / "llama.py", CODE.replace("value", "hf"))
    write(site / "torch" / "nn" / "linear.py", CODE.replace("value", "weight"))  # reserved
    write(site / "pkg" / "a.py", CODE.replace("value", "a"))
    write(site / "pkg" / "vendored" / "a.py", CODE.replace("value", "a"))  # a copy
    write(site / "pkg" / "evalish.py", "import os\n\n" + CODE.replace("value", "e"))
    write(site / "pkg" / "named.py", CODE.replace("value", "named"))
    write(site / "pkg" / "tiny.py", "x = 1\n")
    reserved = tmp_path / "reserved.sha256"
    reserved.write_text(
        "# header: paths relative to site-packages, or to the stdlib's parent\n"
        + hashlib.sha256(b"python3.11/json/decoder.py").hexdigest()
        + "\n"
        + hashlib.sha256(b"torch/nn/linear.py").hexdigest()
        + "\n"
    )
    overlap = "".join(CODE.replace("value", "e").splitlines(keepends=True)[8:24])
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(
        json.dumps({"id": "eval/pkg/elsewhere.py", "messages": [{"role": "user", "content": USER_PREFIX + overlap}]})
        + "\n"
        + json.dumps({"id": "eval/pkg/named.py", "messages": [{"role": "user", "content": USER_PREFIX + "pass\n"}]})
        + "\n"
    )
    roots = [SourceRoot(stdlib, stdlib.parent), SourceRoot(site, site)]
    return {"roots": roots, "reserved": read_reserved(reserved), "eval": [eval_file]}


def test_a_reserved_standard_library_file_is_skipped_under_another_python_version(tmp_path: Path) -> None:
    """The list hashes 'python3.11/json/decoder.py'; the GPU machine's Python 3.12 has the same
    module at 'python3.12/json/decoder.py', and a package's file of that name stays usable."""
    stdlib = tmp_path / "lib" / "python3.12"
    site = tmp_path / "site"
    write(stdlib / "json" / "decoder.py", CODE.replace("value", "doc"))
    write(stdlib / "keep.py", CODE.replace("value", "kept"))
    write(site / "json" / "decoder.py", CODE.replace("value", "pkg"))  # 'json/decoder.py': not the stdlib's
    reserved = {hashlib.sha256(b"python3.11/json/decoder.py").hexdigest()}
    assert is_reserved("python3.12/json/decoder.py", reserved) and is_reserved("python3.11/json/decoder.py", reserved)
    assert not is_reserved("json/decoder.py", reserved) and not is_reserved("python3.12/keep.py", reserved)
    roots = [SourceRoot(stdlib, stdlib.parent), SourceRoot(site, site)]
    records, summary = build_prompts(roots, reserved, [], BuildOptions(min_chars=100))
    sources = sorted(str(r["id"]).removeprefix("prompts/").rsplit("#", 1)[0] for r in records)
    assert sources == ["json/decoder.py", "python3.12/keep.py"] and summary.skipped["reserved"] == 1


def test_reserved_transformers_eval_and_copies_are_skipped(tree: dict[str, object]) -> None:
    records, summary = build_prompts(tree["roots"], tree["reserved"], tree["eval"], BuildOptions(min_chars=100))  # type: ignore[arg-type]
    sources = sorted(str(r["id"]).removeprefix("prompts/").rsplit("#", 1)[0] for r in records)
    assert sources == ["pkg/a.py", "python3.11/keep.py"]
    assert dict(summary.skipped) == {
        "reserved": 2,
        "transformers": 1,
        "overlaps_eval_prompt": 1,
        "eval_source": 1,
        "duplicate_file": 1,
        "too_short": 1,
        "tests": 1,
    }
    for record in records:
        if "messages" in record:
            messages = record["messages"]
            assert [m["role"] for m in messages] == ["system", "user"]  # type: ignore[index]
            user = messages[1]["content"]  # type: ignore[index]
            assert user.startswith(USER_PREFIX) and user.endswith("\n")  # cut at a line end
            assert CODE.replace("value", "a").startswith(user.removeprefix(USER_PREFIX)) or CODE.replace(
                "value", "kept"
            ).startswith(user.removeprefix(USER_PREFIX))
        else:
            assert isinstance(record["text"], str) and len(record["text"]) > 100
    again, _ = build_prompts(tree["roots"], tree["reserved"], tree["eval"], BuildOptions(min_chars=100))  # type: ignore[arg-type]
    assert again == records  # deterministic


def test_tests_and_windows_options(tree: dict[str, object]) -> None:
    options = BuildOptions(min_chars=100, include_tests=True, windows_per_file=2)
    records, summary = build_prompts(tree["roots"], tree["reserved"], tree["eval"], options)  # type: ignore[arg-type]
    ids = {str(r["id"]) for r in records}
    assert "prompts/python3.11/test/test_keep.py#0" in ids and "tests" not in summary.skipped
    assert {"prompts/pkg/a.py#0", "prompts/pkg/a.py#1"} <= ids
    kinds = {("messages" in r) for r in records if str(r["id"]).startswith("prompts/pkg/a.py")}
    assert kinds == {True, False}  # the two windows alternate kinds


def test_human_answers_continue_the_file_from_the_cut(tree: dict[str, object]) -> None:
    """The raw-data baseline: the same prompts, each answered by the file's own next lines."""
    plain, _ = build_prompts(tree["roots"], tree["reserved"], tree["eval"], BuildOptions(min_chars=100))  # type: ignore[arg-type]
    answered, _ = build_prompts(
        tree["roots"], tree["reserved"], tree["eval"], BuildOptions(min_chars=100, human_answer_chars=200)  # type: ignore[arg-type]
    )
    assert [r["id"] for r in answered] == [r["id"] for r in plain]
    chats = 0
    for before, after in zip(plain, answered, strict=True):
        if "text" in before:
            assert after == before  # raw prefixes are already raw data
            continue
        chats += 1
        assert after["messages"][:2] == before["messages"]  # type: ignore[index]
        assert after["messages"][2]["role"] == "assistant"  # type: ignore[index]
        prefix = after["messages"][1]["content"].removeprefix(USER_PREFIX)  # type: ignore[index]
        answer = after["messages"][2]["content"]  # type: ignore[index]
        source = next(CODE.replace("value", n) for n in ("a", "kept") if CODE.replace("value", n).startswith(prefix))
        assert source.startswith(prefix + answer) and answer.endswith("\n")
        assert 0 < len(answer) <= 200 + source[len(prefix) + 200 :].find("\n") + 1
    assert chats >= 1


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED_DATA / "reserved_sources.sha256").exists(), reason="needs ../shared/data")
def test_the_installed_python_gives_no_reserved_file(tmp_path: Path) -> None:
    out = tmp_path / "prompts.jsonl"
    assert main(["--out", str(out), "--max-files", "3000"]) == 0
    reserved = read_reserved(SHARED_DATA / "reserved_sources.sha256")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) >= 1000
    paths = {r["id"].removeprefix("prompts/").rsplit("#", 1)[0] for r in records}
    assert not {hashlib.sha256(p.encode()).hexdigest() for p in paths} & reserved
    assert not any(p.startswith("transformers/") for p in paths)
    # The reserved list names real files here: the skip is exercised, not vacuous.
    roots = installed_roots()
    on_disk = [
        (f.relative_to(root.relative_to).as_posix())
        for root in roots[:1]
        for f in root.folder.rglob("*.py")
        if "site-packages" not in f.parts
    ]
    assert any(hashlib.sha256(p.encode()).hexdigest() in reserved for p in on_disk)
