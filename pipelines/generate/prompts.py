"""Records to prompts, and answers back into records: what is regenerated and how the output looks.

- A chat record: every assistant turn is regenerated in order, each with the conversation so far
  (user and system turns as they are, earlier assistant turns as the target wrote them) rendered
  by the chat template with the generation prompt. A conversation that does not end with an
  assistant turn gains one (a prompt set of user turns gets its answers). Assistant turns before
  the first user turn answer nothing and are kept as written. The output is a chat record.
- A text record: its first ``text_prefix_tokens`` tokens are the prompt of a continuation. The
  output is a ``{"prompt", "completion"}`` record, which extraction reads as text with the loss on
  the completion only (pipelines/extract/records.py).

Every output record carries ``generation``: ``truncated`` (some answer was cut at max_new_tokens
or the context), ``finish_reasons`` per answer, ``num_new_tokens``. Extraction ignores the key.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from pipelines.extract.records import Record, Rejection, RejectReason

# Why an answer ended: a stop token, max_new_tokens, or the target's context.
FINISH_STOP, FINISH_LENGTH, FINISH_CONTEXT = "stop", "length", "context"


def answer_seed(recipe_seed: int, source_id: str, turn: int) -> int:
    """A 63-bit seed per answer, from the recipe seed, the record id and the turn: stable across
    reruns, batchings and workers, so sampled answers are regenerated exactly."""
    digest = hashlib.sha256(f"{recipe_seed}\0{source_id}\0{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class Request:
    """One answer to generate: the prompt as token ids (transformers) and as the server sees it
    (OpenAI: ``messages`` for a chat, ``prompt_text`` for a continuation)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    seed: int
    messages: tuple[dict[str, str], ...] | None = None
    prompt_text: str | None = None


@dataclass(frozen=True)
class Answer:
    """What the backend returns for a request."""

    text: str
    num_new_tokens: int
    finish_reason: str  # FINISH_STOP, FINISH_LENGTH or FINISH_CONTEXT
    error: str | None = None  # the backend refused the request (openai: a 4xx): reject the record


@dataclass
class RecordJob:
    """One record's answers, generated one turn per round (a turn's prompt holds the earlier answers)."""

    record: Record
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)  # indices in messages to (re)generate
    prompt_text: str = ""  # text records
    prompt_ids: tuple[int, ...] = ()
    next_turn: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    num_new_tokens: int = 0
    completion: str = ""

    @property
    def done(self) -> bool:
        return self.next_turn >= max(1, len(self.turns))

    def to_output(self) -> dict[str, Any]:
        meta = {
            "truncated": any(r != FINISH_STOP for r in self.finish_reasons),
            "finish_reasons": list(self.finish_reasons),
            "num_new_tokens": self.num_new_tokens,
        }
        if self.record.text is not None:
            return {
                "id": self.record.source_id,
                "prompt": self.prompt_text,
                "completion": self.completion,
                "generation": meta,
            }
        return {"id": self.record.source_id, "messages": self.messages, "generation": meta}


class PromptBuilder:
    """Builds each round's requests with the target's tokenizer and chat template."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        text_prefix_tokens: int,
        max_context: int,
        max_new_tokens: int,
        seed: int,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.text_prefix_tokens = text_prefix_tokens
        self.max_context = max_context
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def start(self, record: Record) -> RecordJob | Rejection:
        """The record's job, or its rejection (no user turn, empty prompt)."""
        if record.text is not None:
            return self._start_text(record)
        messages = [dict(m) for m in record.messages or ()]
        roles = [m["role"] for m in messages]
        if "user" not in roles:
            return _reject(record, RejectReason.NO_USER_TURN, "has no user turn: nothing to answer")
        first_user = roles.index("user")
        if not any(m["content"].strip() for m in messages[: first_user + 1]):
            return _reject(record, RejectReason.EMPTY, "the prompt (turns up to the first user turn) is empty")
        if roles[-1] != "assistant":
            messages.append({"role": "assistant", "content": ""})
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant" and k > first_user]
        return RecordJob(record=record, messages=messages, turns=turns)

    def _start_text(self, record: Record) -> RecordJob | Rejection:
        text = record.text or ""
        if getattr(self.tokenizer, "is_fast", False):
            encoded = self.tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
            ids = list(encoded["input_ids"])[: self.text_prefix_tokens]
            offsets = list(encoded["offset_mapping"])[: len(ids)]
            # The prompt is the source's own characters up to the last prompt token.
            prompt_text = text[: max((end for _, end in offsets), default=0)]
        else:
            ids = list(self.tokenizer(text, add_special_tokens=True)["input_ids"])[: self.text_prefix_tokens]
            prompt_text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if not ids or not prompt_text.strip():
            return _reject(record, RejectReason.EMPTY, "the text prompt is empty")
        return RecordJob(record=record, prompt_text=prompt_text, prompt_ids=tuple(ids))

    def request(self, job: RecordJob) -> Request | Rejection:
        """The job's next request; a prompt that leaves no room for one token is rejected."""
        if job.record.text is not None:
            ids, messages, prompt_text = job.prompt_ids, None, job.prompt_text
        else:
            k = job.turns[job.next_turn]
            messages = tuple(dict(m) for m in job.messages[:k])
            try:
                rendered = self.tokenizer.apply_chat_template(
                    list(messages), tokenize=False, add_generation_prompt=True, **self.chat_template_kwargs
                )
            except Exception as err:  # noqa: BLE001 - jinja raises anything; the record is at fault
                return _reject(job.record, RejectReason.TEMPLATE_ERROR, f"chat template failed: {type(err).__name__}: {err}")
            ids = tuple(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])
            prompt_text = rendered
        room = self.max_context - len(ids)
        if room < 1:
            turn = "" if job.record.text is not None else f" (assistant turn {job.next_turn + 1})"
            return _reject(
                job.record,
                RejectReason.TOO_LONG,
                f"prompt{turn} of {len(ids)} tokens leaves no room in the context of {self.max_context}",
            )
        return Request(
            prompt_ids=ids,
            max_new_tokens=min(self.max_new_tokens, room),
            seed=answer_seed(self.seed, job.record.source_id, job.next_turn),
            messages=messages,
            prompt_text=prompt_text,
        )

    def accept(self, job: RecordJob, request: Request, answer: Answer) -> None:
        """Put the answer in place; the next round's prompt holds it."""
        finish = answer.finish_reason
        if finish == FINISH_LENGTH and request.max_new_tokens < self.max_new_tokens:
            finish = FINISH_CONTEXT  # cut by the context, not by max_new_tokens
        job.finish_reasons.append(finish)
        job.num_new_tokens += answer.num_new_tokens
        if job.record.text is not None:
            job.completion = answer.text
        else:
            job.messages[job.turns[job.next_turn]] = {"role": "assistant", "content": answer.text}
        job.next_turn += 1


def _reject(record: Record, reason: RejectReason, problem: str) -> Rejection:
    excerpt = (record.text or str(record.content()))[:200]
    return Rejection(reason, f"{record.origin}: {problem}", record.origin, record.source_id, excerpt)
