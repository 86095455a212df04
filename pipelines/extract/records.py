"""Input records: read JSONL / Parquet (local paths or fsspec URLs), validate, reject with a reason.

A record is either plain text, ``{"id"?, "text": str}``, a continuation, ``{"id"?, "prompt": str,
"completion": str}`` (text whose loss covers the completion only: what ``hsstore generate`` writes
for text records), or a chat, ``{"id"?, "messages": [...]}`` with OpenAI ``{"role", "content"}``
turns or ShareGPT ``{"from", "value"}`` turns (ShareGPT's ``conversations`` key is accepted for
``messages``). Anything else is a :class:`Rejection` with
one of the :class:`RejectReason` values and a message that names the file, the line and the
problem: a bad record is never dropped silently, it is counted and written to the rejects file.

Other keys of a record are ignored (datasets carry metadata); only ``id`` is kept, as the
sample's ``source_id`` (default ``<file name>:<line>``).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import fsspec

from pipelines.extract.errors import RecordSourceError


class RejectReason(StrEnum):
    """Why a record was not extracted; the rejects file and the summary count by these."""

    NOT_JSON = "not_json"
    INVALID_UTF8 = "invalid_utf8"
    WRONG_TYPE = "wrong_type"
    EMPTY = "empty"
    UNKNOWN_ROLE = "unknown_role"
    NO_ASSISTANT_TURN = "no_assistant_turn"
    NO_USER_TURN = "no_user_turn"  # hsstore generate: a chat with nothing to answer
    TEMPLATE_ERROR = "template_error"
    TOO_LONG = "too_long"
    NO_LOSS_TOKENS = "no_loss_tokens"
    DUPLICATE = "duplicate"
    WORKER_ERROR = "worker_error"  # the target raised on the record (pipelines/extract/isolation.py)
    GENERATION_ERROR = "generation_error"  # hsstore generate: the backend failed on the record


# ShareGPT speaker names mapped onto OpenAI roles; OpenAI roles map onto themselves.
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "developer": "developer",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}

_EXCERPT_CHARS = 200


@dataclass(frozen=True)
class Record:
    """A validated input record: exactly one of ``text`` and ``messages`` is set.

    A continuation record is text whose first ``len(prompt)`` characters are the prompt (no loss).
    """

    source_id: str
    origin: str  # "<file>:<line>" (JSONL) or "<file>:row <n>" (Parquet), for messages
    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    prompt: str | None = None  # continuations: text == prompt + completion

    @property
    def kind(self) -> str:
        return "text" if self.text is not None else "chat"

    def content(self) -> dict[str, Any]:
        """The record's content, normalised (roles mapped), for hashing into the sample id."""
        if self.prompt is not None and self.text is not None:
            return {"prompt": self.prompt, "completion": self.text[len(self.prompt) :]}
        if self.text is not None:
            return {"text": self.text}
        return {"messages": [dict(m) for m in self.messages or ()]}


@dataclass(frozen=True)
class Rejection:
    """A record that was not extracted, and why (one line of the rejects file)."""

    reason: RejectReason
    message: str
    origin: str
    source_id: str | None = None
    excerpt: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "reason": str(self.reason),
            "message": self.message,
            "origin": self.origin,
            "source_id": self.source_id,
            "excerpt": self.excerpt,
        }


def _excerpt(raw: Any) -> str:
    text = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False, default=str)
    return text[:_EXCERPT_CHARS]


def _content_text(content: Any) -> str | None:
    """A turn's text: a string, or OpenAI content parts that are all ``{"type": "text"}``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    return None


def _is_utf8(text: str) -> bool:
    """JSON escapes can produce lone surrogates (``"\\ud800"``) that no tokenizer accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _Reject(Exception):
    """Raised by the validators below; :func:`parse_record` turns it into a :class:`Rejection`."""

    def __init__(self, reason: RejectReason, problem: str):
        super().__init__(problem)
        self.reason = reason
        self.problem = problem


def parse_record(
    obj: Any, origin: str, default_id: str, *, require_assistant: bool = True
) -> Record | Rejection:
    """Validate one decoded record; ``require_assistant`` rejects chats without an assistant turn.

    A rejection names the record's source id once it is known (a record whose ``id`` is itself
    wrong is rejected without one)."""
    source_id: str | None = None
    try:
        source_id = _source_id(obj, default_id)
        return _parse_content(obj, origin, source_id, require_assistant)
    except _Reject as reject:
        return Rejection(reject.reason, f"{origin}: {reject.problem}", origin, source_id, _excerpt(obj))


def _source_id(obj: Any, default_id: str) -> str:
    if not isinstance(obj, dict):
        raise _Reject(RejectReason.WRONG_TYPE, f"expected a JSON object, found {type(obj).__name__}")
    raw_id = obj.get("id")
    if raw_id is None:
        return default_id
    if isinstance(raw_id, str | int) and not isinstance(raw_id, bool):
        return str(raw_id)
    raise _Reject(
        RejectReason.WRONG_TYPE, f"'id' must be a string or integer, found {type(raw_id).__name__}"
    )


def _parse_content(
    obj: dict[str, Any], origin: str, source_id: str, require_assistant: bool
) -> Record:
    """Which kind of record ``obj`` is (text, continuation, chat), and that kind validated."""
    messages_key = (
        "messages" if "messages" in obj else "conversations" if "conversations" in obj else None
    )
    if "prompt" in obj and "completion" in obj and messages_key is None and obj.get("text") is None:
        # Only then: datasets carry a "prompt" key beside their messages (UltraChat) as metadata.
        return _parse_continuation(obj, origin, source_id)
    has_text = obj.get("text") is not None
    if has_text and messages_key:
        raise _Reject(RejectReason.WRONG_TYPE, f"has both 'text' and '{messages_key}'; keep one")
    if has_text:
        return Record(source_id=source_id, origin=origin, text=_parse_text(obj["text"]))
    if messages_key is None:
        raise _Reject(RejectReason.WRONG_TYPE, "has neither 'text' nor 'messages'")
    messages = _parse_messages(obj[messages_key], messages_key, require_assistant)
    return Record(source_id=source_id, origin=origin, messages=messages)


def _parse_text(text: Any) -> str:
    if not isinstance(text, str):
        raise _Reject(RejectReason.WRONG_TYPE, f"'text' must be a string, found {type(text).__name__}")
    if not text.strip():
        raise _Reject(RejectReason.EMPTY, "'text' is empty")
    if not _is_utf8(text):
        raise _Reject(RejectReason.INVALID_UTF8, "'text' holds a lone surrogate (not UTF-8)")
    return text


def _parse_messages(
    turns: Any, messages_key: str, require_assistant: bool
) -> tuple[dict[str, str], ...]:
    """OpenAI or ShareGPT turns, roles mapped onto OpenAI's (:data:`ROLE_ALIASES`)."""
    if not isinstance(turns, list):
        raise _Reject(
            RejectReason.WRONG_TYPE, f"'{messages_key}' must be a list, found {type(turns).__name__}"
        )
    if not turns:
        raise _Reject(RejectReason.EMPTY, f"'{messages_key}' is an empty list")
    messages = [_parse_turn(turn, f"{messages_key}[{n}]") for n, turn in enumerate(turns)]
    if not any(m["content"].strip() for m in messages):
        raise _Reject(RejectReason.EMPTY, f"every turn of '{messages_key}' is empty")
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise _Reject(
            RejectReason.NO_ASSISTANT_TURN, "has no assistant turn, so no token would carry loss"
        )
    return tuple(messages)


def _parse_turn(turn: Any, where: str) -> dict[str, str]:
    """One turn (``where``: ``messages[3]``) as ``{"role", "content"}``."""
    if not isinstance(turn, dict):
        raise _Reject(RejectReason.WRONG_TYPE, f"{where} must be an object, found {type(turn).__name__}")
    role_key, content_key = ("role", "content") if "role" in turn else ("from", "value")
    role = turn.get(role_key)
    if not isinstance(role, str):
        raise _Reject(RejectReason.WRONG_TYPE, f"{where} needs a string 'role' (or ShareGPT 'from')")
    mapped = ROLE_ALIASES.get(role.lower())
    if mapped is None:
        known = ", ".join(sorted(ROLE_ALIASES))
        raise _Reject(RejectReason.UNKNOWN_ROLE, f"{where} has unknown role {role!r} (known: {known})")
    text = _content_text(turn.get(content_key))
    if text is None:
        found = type(turn.get(content_key)).__name__
        raise _Reject(
            RejectReason.WRONG_TYPE, f"{where}.{content_key} must be a string or text parts, found {found}"
        )
    if not _is_utf8(text):
        raise _Reject(RejectReason.INVALID_UTF8, f"{where}.{content_key} holds a lone surrogate (not UTF-8)")
    return {"role": mapped, "content": text}


def _parse_continuation(obj: dict[str, Any], origin: str, source_id: str) -> Record:
    """``{"prompt": str, "completion": str}``: text, loss on the completion only."""
    prompt, completion = obj.get("prompt"), obj.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise _Reject(
            RejectReason.WRONG_TYPE,
            f"'prompt' and 'completion' must both be strings, found {type(prompt).__name__} and "
            f"{type(completion).__name__}",
        )
    if not (prompt + completion).strip():
        raise _Reject(RejectReason.EMPTY, "'prompt' and 'completion' are empty")
    if not _is_utf8(prompt + completion):
        raise _Reject(RejectReason.INVALID_UTF8, "'prompt' or 'completion' holds a lone surrogate")
    return Record(source_id=source_id, origin=origin, text=prompt + completion, prompt=prompt)


def _iter_jsonl(url: str, require_assistant: bool) -> Iterator[Record | Rejection]:
    name = posixpath.basename(url.rstrip("/"))
    with fsspec.open(url, "rb", compression="infer") as handle:
        for line_no, raw in enumerate(handle, start=1):
            origin = f"{name}:{line_no}"
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as err:
                excerpt = raw[:_EXCERPT_CHARS].decode("utf-8", errors="replace")
                yield Rejection(
                    RejectReason.INVALID_UTF8,
                    f"{origin}: not valid UTF-8 ({err.reason} at byte {err.start})",
                    origin,
                    None,
                    excerpt,
                )
                continue
            if not line.strip():
                continue  # blank lines separate nothing in JSONL; they are not records
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, RecursionError, ValueError) as err:
                # RecursionError: absurdly deep nesting; ValueError: integers past Python's digit
                # limit. Both are bad records, not reasons to stop the job.
                detail = (
                    f"{err.msg} at column {err.colno}"
                    if isinstance(err, json.JSONDecodeError)
                    else f"{type(err).__name__}: {str(err)[:120]}"
                )
                yield Rejection(
                    RejectReason.NOT_JSON, f"{origin}: not JSON ({detail})", origin, None, line[:_EXCERPT_CHARS]
                )
                continue
            yield parse_record(obj, origin, origin, require_assistant=require_assistant)


def _iter_parquet(url: str, require_assistant: bool) -> Iterator[Record | Rejection]:
    import pyarrow.parquet as pq

    name = posixpath.basename(url.rstrip("/"))
    row = 0
    with fsspec.open(url, "rb") as handle:
        for batch in pq.ParquetFile(handle).iter_batches(batch_size=1024):
            for obj in batch.to_pylist():
                row += 1
                origin = f"{name}:row {row}"
                # Parquet has no "absent": a column missing from this record reads as null.
                obj = {k: v for k, v in obj.items() if v is not None}
                yield parse_record(obj, origin, origin, require_assistant=require_assistant)


def iter_records(
    urls: Iterable[str], *, require_assistant: bool = True
) -> Iterator[Record | Rejection]:
    """Every record of every file, in order: a :class:`Record` or a :class:`Rejection` each.

    The format comes from the name: ``.parquet`` is Parquet, ``.jsonl``/``.json``/``.ndjson``
    (optionally ``.gz``/``.zst``/``.bz2``/``.xz``) is JSON lines.
    """
    for url in urls:
        lowered = url.lower()
        for suffix in (".gz", ".zst", ".bz2", ".xz"):
            lowered = lowered.removesuffix(suffix)
        if lowered.endswith(".parquet"):
            reader = _iter_parquet
        elif lowered.endswith((".jsonl", ".json", ".ndjson")):
            reader = _iter_jsonl
        else:
            raise RecordSourceError(
                f"data file {url}: unknown format (expected .jsonl, .json, .ndjson or .parquet)"
            )
        try:
            yield from reader(url, require_assistant)
        except FileNotFoundError as err:
            raise RecordSourceError(f"data file {url} does not exist") from err
