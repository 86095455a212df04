"""Only hsstore/storage/ knows which backend a store is on: everything else asks the backend for a
capability (``prefers_threads``, ``uses_read_cache``, ``read_threads`` ...) or an operation
(``commit_lock``, ``staging_folder`` ...), never for its type (issue 29)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.paths import REPO_ROOT

STORAGE = REPO_ROOT / "hsstore" / "storage"
# Tests of the backend's type or filesystem: what is_local was, in its other spellings.
BACKEND_TESTS = re.compile(
    r"\bis_local\b|\bis_remote\b|\bcommit_guard\b|\bLocalFileSystem\b"
    r"|isinstance\([^)]*\b(?:LocalBackend|S3Backend|MemoryBackend|FsspecBackend|S3FileSystem|MemoryFileSystem)\b"
    r"|\.fs\.protocol\b|\bprotocol\s*(?:==|!=|in)\s*[\"'({]"
)


def test_no_module_outside_storage_asks_which_backend_it_is_on() -> None:
    found = []
    for folder in ("hsstore", "pipelines", "benchmarks", "tests", "tools"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            if STORAGE in path.parents or path == Path(__file__).resolve():
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if BACKEND_TESTS.search(line):
                    found.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
    assert found == [], "ask the backend for a capability instead (hsstore/storage/base.py):\n" + "\n".join(found)


def test_the_pattern_catches_what_it_is_for() -> None:
    for line in ("if location.is_local:", "isinstance(location, LocalBackend)", "fs.protocol == 's3'", "location.commit_guard == 'local'"):
        assert BACKEND_TESTS.search(line), line
    for line in ("if location.prefers_threads:", "cache if location.uses_read_cache else None"):
        assert not BACKEND_TESTS.search(line), line
