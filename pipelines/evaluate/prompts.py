"""Evaluation prompts: JSONL chat records without an assistant turn, or plain text records.

A chat record ``{"id"?, "messages": [...]}`` (OpenAI ``role``/``content`` turns or ShareGPT
``from``/``value``; ``conversations`` is accepted for ``messages``) goes through the tokenizer's
chat template with the generation prompt added, so the target continues as the assistant; the
rendered text is tokenized without adding special tokens (the template wrote them). A
record that already ends with an assistant turn is refused rather than silently cut: decide
what to evaluate and drop the answer from the file. ``{"id"?, "text": str}`` is tokenized with
the tokenizer's own special tokens, as extraction does for text records.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import fsspec

from hsstore.errors import HsstoreError

ROLE_ALIASES = {"human": "user", "gpt": "assistant", "chatgpt": "assistant", "model": "assistant"}


class PromptError(HsstoreError, ValueError):
    """A prompt record is malformed; the message names the file and line."""


@dataclass(frozen=True)
class Prompt:
    id: str
    input_ids: list[int]


def _messages(record: dict[str, Any], origin: str) -> list[dict[str, str]]:
    raw = record.get("messages", record.get("conversations"))
    if not isinstance(raw, list) or not raw:
        raise PromptError(f"{origin}: 'messages' must be a non-empty list of turns")
    turns = []
    for i, turn in enumerate(raw):
        if not isinstance(turn, dict):
            raise PromptError(f"{origin}: turn {i} is not an object")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if not isinstance(role, str) or not isinstance(content, str):
            raise PromptError(f"{origin}: turn {i} needs string role/content (or from/value)")
        turns.append({"role": ROLE_ALIASES.get(role, role), "content": content})
    if turns[-1]["role"] == "assistant":
        raise PromptError(
            f"{origin}: the chat ends with an assistant turn; evaluation prompts must stop before "
            "the answer (the chat template's generation prompt is added), so remove that turn"
        )
    return turns


def read_prompt_records(url: str, limit: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    """``(origin, record)`` pairs of a JSONL file (any fsspec URL), at most ``limit``."""
    records = []
    with fsspec.open(url, "rt", encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            origin = f"{url}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise PromptError(f"{origin}: not valid JSON: {err}") from err
            if not isinstance(record, dict):
                raise PromptError(f"{origin}: a record must be a JSON object")
            records.append((origin, record))
    if not records:
        raise PromptError(f"{url}: holds no prompt records")
    return records


def load_prompts(url: str, tokenizer: Any, limit: int | None = None) -> list[Prompt]:
    """Tokenize the first ``limit`` records of ``url`` into :class:`Prompt` objects."""
    prompts = []
    for origin, record in read_prompt_records(url, limit):
        prompt_id = str(record.get("id", origin))
        if "text" in record:
            if not isinstance(record["text"], str) or not record["text"]:
                raise PromptError(f"{origin}: 'text' must be a non-empty string")
            ids = tokenizer(record["text"], add_special_tokens=True)["input_ids"]
        elif "messages" in record or "conversations" in record:
            text = tokenizer.apply_chat_template(
                _messages(record, origin), add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            raise PromptError(f"{origin}: a prompt record needs 'messages' (a chat) or 'text'")
        if not ids:
            raise PromptError(f"{origin}: tokenizes to no tokens")
        prompts.append(Prompt(id=prompt_id, input_ids=list(ids)))
    return prompts
