"""A prompt set of the reference target's kind, built from Python source any machine has offline.

    python3 -m pipelines.generate.source_prompts --out runs/source-prompts.jsonl [--max-files N]

then ``hsstore generate`` answers it (docs/generate.md). The sources are the installed Python's
standard library and the packages in its site-packages. Each file gives one record (or
``--windows-per-file`` records, at other places in the file), alternately by a hash of its path:

- a chat "continue this file" prompt, as in ``../shared/data/draft_train.jsonl``: the system turn
  ``You are a Python coding assistant.`` and the user turn ``Continue this Python file:\\n`` plus
  the file's text up to a line boundary (no assistant turn: generate adds the target's answer);
- a raw prefix, ``{"text": ...}``: the file's text from a line boundary on (generate continues its
  first ``prompting.text_prefix_tokens`` tokens).

Never used, counted by reason in the summary:

- a file whose path hash is in ``reserved_sources.sha256`` (held out for evaluation; the path is
  hashed as that file's header says: relative to site-packages for a package, relative to the
  standard library's parent, with its version folder, for the standard library, whose files are
  held out under every ``python3.X`` folder: the GPU machine's Python is another version);
- the whole ``transformers`` package (reserved too);
- a file that shares code with an evaluation prompt (``--eval`` files: 8 consecutive non-blank
  lines in common, or the evaluation prompt's own path), and a file whose text another file
  already gave (vendored copies);
- tests (``test``/``tests`` folders) unless ``--include-tests``, files under ``--min-chars`` or
  over ``--max-bytes``, files that are not UTF-8.

Output order and content are a function of the sources and the options: a rerun writes the same file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import site
import sys
import sysconfig
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = "You are a Python coding assistant."
USER_PREFIX = "Continue this Python file:\n"
EXCLUDED_PACKAGES = ("transformers",)
SHINGLE_LINES = 8


@dataclass(frozen=True)
class SourceRoot:
    """A folder of sources and the folder their hashed path is relative to."""

    folder: Path
    relative_to: Path


@dataclass
class BuildOptions:
    min_chars: int = 400
    max_bytes: int = 1 << 20
    min_prefix_chars: int = 512
    max_prefix_chars: int = 3072
    max_text_chars: int = 6000
    windows_per_file: int = 1
    include_tests: bool = False
    max_files: int | None = None
    # The raw-data baseline of the reference draft's ladder: each chat prompt answered by the
    # file's own continuation (up to this many characters, cut at a line end) instead of no answer.
    human_answer_chars: int | None = None


@dataclass
class BuildSummary:
    files_seen: int = 0
    files_used: int = 0
    records: int = 0
    skipped: Counter[str] = field(default_factory=Counter)


def installed_roots() -> list[SourceRoot]:
    """The standard library (relative to its parent: ``python3.11/json/decoder.py``) and every
    site-packages folder (relative to itself: ``torch/nn/modules/linear.py``)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    roots = [SourceRoot(stdlib, stdlib.parent)]
    for folder in dict.fromkeys(site.getsitepackages() + [site.getusersitepackages()]):
        path = Path(folder).resolve()
        if path.is_dir():
            roots.append(SourceRoot(path, path))
    return roots


def read_reserved(path: Path) -> set[str]:
    """The sha256 hex digests of ``reserved_sources.sha256`` (``#`` lines are its header)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return {line.strip().lower() for line in lines if line.strip() and not line.startswith("#")}


def path_hash(relative: str) -> str:
    return hashlib.sha256(relative.encode("utf-8")).hexdigest()


# The reserved list hashes standard-library paths with the version folder of the Python that wrote
# it ('python3.11/json/decoder.py'); the same module of another Python (the GPU machine runs 3.12)
# is the same held-out file, so a standard-library path is checked under every 3.x folder.
_STDLIB_VERSION = re.compile(r"^python3\.\d+/")
STDLIB_VERSIONS = [f"python3.{minor}/" for minor in range(6, 21)]


def is_reserved(relative: str, reserved: set[str]) -> bool:
    """Whether ``relative`` (as the reserved list's header writes paths) is held out; a standard
    library path whatever its ``python3.X`` folder."""
    if path_hash(relative) in reserved:
        return True
    match = _STDLIB_VERSION.match(relative)
    if match is None:
        return False
    rest = relative[match.end() :]
    return any(path_hash(version + rest) in reserved for version in STDLIB_VERSIONS)


def code_shingles(text: str) -> set[int]:
    """Hashes of every run of SHINGLE_LINES consecutive non-blank lines (whitespace-stripped).
    Python's own string hash: the shingles are compared within one process only, and it is ~4x
    faster than a hashlib digest (a collision could only drop a file, never let one through)."""
    lines = [stripped for stripped in (line.strip() for line in text.splitlines()) if stripped]
    return {hash("\n".join(lines[i : i + SHINGLE_LINES])) for i in range(max(0, len(lines) - SHINGLE_LINES + 1))}


def prompt_id(relative: str, window: int) -> str:
    """A built record's id: ``prompts/<path>#<window>`` (:func:`source_path` reads the path back)."""
    return f"prompts/{relative}#{window}"


def source_path(record_id: object) -> str:
    """The source file a record id names: ``prompts/<path>#<window>`` (and the bundled data's
    ``draft/<path>``) -> ``<path>``."""
    return str(record_id).split("/", 1)[1].rsplit("#", 1)[0]


def eval_fingerprints(files: Iterable[Path]) -> tuple[set[int], set[str]]:
    """Shingles of every evaluation prompt's code, and the source paths its ids name."""
    shingles: set[int] = set()
    paths: set[str] = set()
    for path in files:
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            source_id = str(record.get("id", ""))
            if "/" in source_id:
                paths.add(source_id.split("/", 1)[1])  # "eval/torch/jit/_fuser.py" -> torch/jit/_fuser.py
            turns = record.get("messages") or record.get("conversations") or []
            texts = [t.get("content") or t.get("value") or "" for t in turns] + [record.get("text") or ""]
            for text in texts:
                shingles |= code_shingles(text.removeprefix(USER_PREFIX))
    return shingles, paths


def iter_sources(roots: list[SourceRoot], summary: BuildSummary, include_tests: bool) -> Iterator[tuple[str, Path]]:
    """(hashed relative path, file) of every .py file, sorted; nested roots are not walked twice."""
    seen: set[Path] = set()
    folders = {root.folder for root in roots}
    for root in roots:
        found: list[tuple[str, Path]] = []
        for folder, dirs, files in os.walk(root.folder):
            here = Path(folder)
            dirs[:] = sorted(d for d in dirs if (here / d) not in folders and d != "__pycache__")
            if not include_tests:
                dropped = [d for d in dirs if d in ("test", "tests")]
                summary.skipped["tests"] += len(dropped)
                dirs[:] = [d for d in dirs if d not in ("test", "tests")]
            for name in files:
                if name.endswith(".py") and (here / name) not in seen:
                    seen.add(here / name)
                    found.append(((here / name).relative_to(root.relative_to).as_posix(), here / name))
        yield from sorted(found)


def _stable(key: str, salt: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{salt}\0{key}".encode()).digest()[:8], "little")


def _line_cut(text: str, at: int) -> int:
    """The end of the line holding character ``at`` (a prefix never stops mid-line)."""
    end = text.find("\n", at)
    return len(text) if end < 0 else end + 1


def make_records(relative: str, text: str, options: BuildOptions) -> list[dict[str, object]]:
    """The file's records: chat prompts or raw prefixes, at places derived from its path."""
    records: list[dict[str, object]] = []
    for window in range(options.windows_per_file):
        salt = f"w{window}"
        chat = (_stable(relative, "kind") + window) % 2 == 0
        if chat:
            # The prefix ends between min and max_prefix_chars, and leaves at least a quarter of
            # the file to continue.
            low = min(options.min_prefix_chars, len(text) // 2)
            high = max(low + 1, min(options.max_prefix_chars, len(text) * 3 // 4))
            cut = _line_cut(text, low + _stable(relative, salt) % (high - low))
            if cut >= len(text):
                continue  # nothing left to continue
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": USER_PREFIX + text[:cut]},
            ]
            if options.human_answer_chars is not None:
                end = _line_cut(text, min(len(text) - 1, cut + options.human_answer_chars - 1))
                messages.append({"role": "assistant", "content": text[cut:end]})
            records.append({"id": prompt_id(relative, window), "messages": messages})
        else:
            start = 0 if window == 0 else _line_cut(text, _stable(relative, salt) % max(1, len(text) // 2))
            piece = text[start : start + options.max_text_chars]
            if len(piece.strip()) < options.min_chars // 2:
                continue
            records.append({"id": prompt_id(relative, window), "text": piece})
    return records


def build_prompts(
    roots: list[SourceRoot],
    reserved: set[str],
    eval_files: list[Path],
    options: BuildOptions,
) -> tuple[list[dict[str, object]], BuildSummary]:
    """Every record, in a deterministic order (by path hash), and what was skipped, by reason."""
    summary = BuildSummary()
    eval_shingles, eval_paths = eval_fingerprints(eval_files)
    # First the cheap tests, in walk order (the first copy of a text is the one kept), then the
    # shingle test in output order, only until max_files are taken: on the whole environment it
    # is most of the run. A text that overlaps an evaluation prompt does so in every copy, so
    # keeping the first copy before testing the overlap keeps the same files as testing it first.
    seen_content: set[str] = set()
    candidates: list[tuple[int, str, str]] = []
    for relative, path in iter_sources(roots, summary, options.include_tests):
        summary.files_seen += 1
        reason = _skip_reason(relative, path, reserved, eval_paths, options)
        text = ""
        if reason is None:
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                reason = "not_utf8"
        if reason is None and len(text.strip()) < options.min_chars:
            reason = "too_short"
        if reason is None:
            digest = hashlib.sha256(text.encode()).hexdigest()
            reason = "duplicate_file" if digest in seen_content else None
            seen_content.add(digest)
        if reason is not None:
            summary.skipped[reason] += 1
            continue
        candidates.append((_stable(relative, "order"), relative, text))
    candidates.sort()
    kept: list[tuple[str, str]] = []
    for _, relative, text in candidates:
        if options.max_files is not None and len(kept) >= options.max_files:
            break
        if code_shingles(text) & eval_shingles:
            summary.skipped["overlaps_eval_prompt"] += 1
        else:
            kept.append((relative, text))
    records: list[dict[str, object]] = []
    for relative, text in kept:
        made = make_records(relative, text, options)
        summary.files_used += bool(made)
        records.extend(made)
    summary.records = len(records)
    return records, summary


def _skip_reason(
    relative: str, path: Path, reserved: set[str], eval_paths: set[str], options: BuildOptions
) -> str | None:
    if relative.split("/", 1)[0] in EXCLUDED_PACKAGES:
        return "transformers"
    if is_reserved(relative, reserved):
        return "reserved"
    if relative in eval_paths:
        return "eval_source"
    try:
        size = path.stat().st_size
    except OSError:
        return "unreadable"
    return "too_large" if size > options.max_bytes else None


def main(argv: list[str] | None = None) -> int:
    shared = Path(__file__).resolve().parents[2].parent / "shared" / "data"
    repo_data = Path(__file__).resolve().parents[2] / "examples" / "data"
    parser = argparse.ArgumentParser(description="Build chat and raw-prefix prompts from installed Python source.")
    parser.add_argument("--out", required=True, help="JSONL file to write")
    parser.add_argument("--reserved", default=str(shared / "reserved_sources.sha256"))
    parser.add_argument(
        "--eval",
        action="append",
        default=None,
        help="evaluation prompts to keep out (repeatable; default: ../shared/data/eval_prompts.jsonl "
        "and examples/data/eval_prompts.jsonl, those that exist)",
    )
    parser.add_argument("--max-files", type=int, default=None)
    parser.add_argument("--windows-per-file", type=int, default=1)
    parser.add_argument("--include-tests", action="store_true")
    parser.add_argument(
        "--human-answers",
        type=int,
        default=None,
        metavar="CHARS",
        help="answer each chat prompt with the file's own continuation (up to CHARS, cut at a line "
        "end): the same prompts as raw data, the baseline of the reference draft's ladder",
    )
    args = parser.parse_args(argv)
    reserved_path = Path(args.reserved)
    if not reserved_path.exists():
        print(f"error: {reserved_path} does not exist: reserved files could not be skipped", file=sys.stderr)
        return 2
    eval_files = [Path(p) for p in (args.eval or [shared / "eval_prompts.jsonl", repo_data / "eval_prompts.jsonl"])]
    options = BuildOptions(
        windows_per_file=args.windows_per_file,
        include_tests=args.include_tests,
        max_files=args.max_files,
        human_answer_chars=args.human_answers,
    )
    records, summary = build_prompts(
        installed_roots(), read_reserved(reserved_path), [p for p in eval_files if p.exists()], options
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.with_name(f".{out.name}.tmp")
    temp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    temp.replace(out)
    kinds = Counter("chat" if "messages" in r else "text" for r in records)
    print(
        f"{summary.records} records ({kinds['chat']} chat, {kinds['text']} raw prefix) from "
        f"{summary.files_used} of {summary.files_seen} files -> {out}\n"
        f"skipped: {dict(sorted(summary.skipped.items()))}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
