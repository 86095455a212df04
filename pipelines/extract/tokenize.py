"""Records to token ids and loss masks, with the chat template, truncation and the sample id.

Text records: the tokenizer's own encoding (``add_special_tokens=True``), loss on every token;
for a continuation (``prompt`` + ``completion``), loss on the tokens that overlap the completion.

Chat records go through the tokenizer's chat template; the loss mask covers assistant turns only.
Two ways to find the assistant tokens (``loss_mask`` in the recipe, ``auto`` picks):

- ``generation_markers``: the template wraps assistant text in ``{% generation %}`` ...
  ``{% endgeneration %}`` and transformers returns ``assistant_masks``
  (``return_assistant_tokens_mask=True``). Exact, and what the template author meant.
- ``prefix_diff`` (the fallback for templates without markers, Qwen3's and Llama-3's among them):
  for assistant turn k, render ``messages[:k]`` with the generation prompt (P) and ``messages[:k+1]``
  (F); the assistant's span is ``F[len(P):]`` with trailing whitespace removed, so it holds the
  content and the template's end-of-turn text (``<|im_end|>``, ``<|eot_id|>``) but not the header
  (``<|im_start|>assistant\\n``) nor the newline after the turn. The span is then located in the
  full render: at ``len(P)`` when the template renders prefixes consistently; otherwise (Qwen3
  drops the ``<think>`` block of earlier turns) at the turn's content, searched forward from the
  previous turn, extended by the end-of-turn text. Tokens whose characters overlap a span carry
  loss (the same rule transformers uses for the markers). A turn that cannot be found is a
  ``template_error`` rejection, never a silent mask of zeros.

The ``sample_id`` is the sha256 of the canonical record content plus these tokenization settings,
so a rerun or a retried unit recognises a sample, and changing the template or max length makes
new ids rather than silently reusing old ones.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from pipelines.extract.records import Record, Rejection, RejectReason
from pipelines.target_identity import canonical_json, sha256_bytes

LossMaskMode = Literal["auto", "generation_markers", "prefix_diff"]
TooLongPolicy = Literal["drop", "truncate"]

_GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")


def has_generation_markers(chat_template: str | None) -> bool:
    """Whether a chat template marks assistant text with ``{% generation %}``."""
    return bool(chat_template and _GENERATION_MARKER.search(chat_template))


@dataclass(frozen=True)
class TokenizedSample:
    """One accepted record, ready for the target: what a store row is made of."""

    sample_id: str
    source_id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    truncated: bool
    origin: str = ""  # the record's "<file>:<line>", for messages
    excerpt: str = ""  # the record's first characters, for a duplicate's rejection

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


class SampleTokenizer:
    """Tokenizes records for one extraction run; its ``settings`` go into every sample id."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_length: int,
        too_long: TooLongPolicy = "drop",
        loss_mask: LossMaskMode = "auto",
        chat_template_kwargs: dict[str, Any] | None = None,
        identity: dict[str, Any] | None = None,
    ) -> None:
        """``identity``: tokenizer / template hashes to fold into sample ids (see settings)."""
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.too_long = too_long
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        template = getattr(tokenizer, "chat_template", None)
        if loss_mask == "auto":
            loss_mask = "generation_markers" if has_generation_markers(template) else "prefix_diff"
        elif loss_mask == "generation_markers" and not has_generation_markers(template):
            raise ValueError(
                "loss_mask=generation_markers but the chat template has no {% generation %} markers; "
                "use loss_mask: auto or prefix_diff"
            )
        self.loss_mask_mode: LossMaskMode = loss_mask
        self.settings: dict[str, Any] = {
            "max_length": max_length,
            "too_long": too_long,
            "loss_mask": loss_mask,
            "chat_template_kwargs": self.chat_template_kwargs,
            "text_add_special_tokens": True,
            **(identity or {}),
        }
        self._settings_json = canonical_json(self.settings)

    # -- ids -----------------------------------------------------------------------------------

    def sample_id(self, record: Record) -> str:
        """sha256 (first 32 hex digits) of the record's content and the tokenization settings."""
        return sha256_bytes(canonical_json(record.content()) + b"\0" + self._settings_json)[:32]

    # -- tokenization ----------------------------------------------------------------------------

    def __call__(self, record: Record) -> TokenizedSample | Rejection:
        """Tokenize one record, or reject it (template error, too long, nothing to learn)."""

        def excerpt() -> str:
            return (record.text or json.dumps(record.content(), ensure_ascii=False))[:200]

        def reject(reason: RejectReason, problem: str) -> Rejection:
            return Rejection(
                reason, f"{record.origin}: {problem}", record.origin, record.source_id, excerpt()
            )

        if record.prompt is not None and record.text is not None:
            try:
                ids, mask = self.tokenize_continuation(record.text, len(record.prompt))
            except TemplateSpanError as err:
                return reject(RejectReason.TEMPLATE_ERROR, str(err))
        elif record.text is not None:
            ids = list(self.tokenizer(record.text, add_special_tokens=True)["input_ids"])
            mask = [1] * len(ids)
        else:
            try:
                ids, mask = self.tokenize_chat(list(record.messages or ()))
            except TemplateSpanError as err:
                return reject(RejectReason.TEMPLATE_ERROR, str(err))
            except Exception as err:  # noqa: BLE001 - jinja raises anything; the record is at fault
                return reject(
                    RejectReason.TEMPLATE_ERROR,
                    f"chat template failed: {type(err).__name__}: {err}",
                )
        if not ids:
            return reject(RejectReason.EMPTY, "tokenizes to zero tokens")
        truncated = False
        if len(ids) > self.max_length:
            if self.too_long == "drop":
                return reject(
                    RejectReason.TOO_LONG,
                    f"{len(ids)} tokens is over max_length={self.max_length} "
                    "(set batching.too_long: truncate to keep the first max_length tokens)",
                )
            ids, mask, truncated = ids[: self.max_length], mask[: self.max_length], True
        if not any(mask):
            why = "after truncation to max_length " if truncated else ""
            return reject(
                RejectReason.NO_LOSS_TOKENS, f"no assistant token is left {why}to carry loss"
            )
        return TokenizedSample(
            sample_id=self.sample_id(record),
            source_id=record.source_id,
            input_ids=np.asarray(ids, dtype=np.int32),
            loss_mask=np.asarray(mask, dtype=np.uint8),
            truncated=truncated,
            origin=record.origin,
            excerpt=excerpt(),
        )

    def tokenize_continuation(self, text: str, prompt_chars: int) -> tuple[list[int], list[int]]:
        """Ids of ``text`` and a mask on the tokens overlapping ``text[prompt_chars:]``."""
        if not getattr(self.tokenizer, "is_fast", False):
            raise TemplateSpanError("a prompt/completion record needs a fast tokenizer (offset mapping)")
        encoded = self.tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        # Special tokens have empty offsets (0, 0): never loss.
        mask = [int(end > prompt_chars and end > start) for start, end in encoded["offset_mapping"]]
        return ids, mask

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.chat_template_kwargs,
        )

    def tokenize_chat(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        """Token ids and assistant mask of a conversation, by the configured loss-mask mode."""
        if self.loss_mask_mode == "generation_markers":
            out = self.tokenizer.apply_chat_template(
                messages,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                **self.chat_template_kwargs,
            )
            return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
        return self._tokenize_chat_prefix_diff(messages)

    def assistant_char_spans(
        self, messages: list[dict[str, str]], rendered: str
    ) -> list[tuple[int, int]]:
        """Character spans of the assistant turns in ``rendered`` (the prefix-diff fallback)."""
        spans: list[tuple[int, int]] = []
        cursor = 0
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self._render_prompt(messages[:k])
            full = self.render(messages[: k + 1])
            # The turn as the template renders it when it is the last message.
            turn_text = full[len(prompt) :].rstrip() if full.startswith(prompt) else ""
            if turn_text and len(prompt) >= cursor and rendered.startswith(turn_text, len(prompt)):
                start = len(prompt)
                end = start + len(turn_text)
            else:
                # Not prefix-consistent (Qwen3 renders earlier turns without <think>; some
                # templates inject a default system prompt): find the content itself, searching
                # forward from the previous turn, then the end-of-turn text that follows it.
                content = message["content"].strip()
                if not content:
                    continue  # an empty turn: nothing to find and nothing to learn
                start = rendered.find(content, cursor)
                if start < 0:
                    raise TemplateSpanError(
                        f"turn {k}: the assistant's content is not in the rendered conversation "
                        "(the template rewrites it); use a template with {% generation %} markers"
                    )
                end = start + len(content)
                # The end-of-turn text: what follows the content when this turn renders last.
                alone = turn_text or full
                where = alone.rfind(content)
                tail = alone[where + len(content) :].rstrip() if where >= 0 else ""
                if tail and rendered.startswith(tail, end):
                    end += len(tail)
            spans.append((start, end))
            cursor = end
        return spans

    def _render_prompt(self, messages: list[dict[str, str]]) -> str:
        """The conversation so far plus the assistant header.

        For a conversation that opens with the assistant there is no "so far": transformers
        refuses to render ``[]``, so the header is learned from a probe instead, as the text that
        ``add_generation_prompt`` appends to a one-turn conversation.
        """
        if messages:
            return self.render(messages, add_generation_prompt=True)
        probe = [{"role": "user", "content": "probe"}]
        try:
            with_header = self.render(probe, add_generation_prompt=True)
            without = self.render(probe)
        except Exception:  # noqa: BLE001 - a template may refuse the probe; then no header is known
            return ""
        return with_header[len(without) :] if with_header.startswith(without) else ""

    def _tokenize_chat_prefix_diff(
        self, messages: list[dict[str, str]]
    ) -> tuple[list[int], list[int]]:
        rendered = self.render(messages)
        spans = self.assistant_char_spans(messages, rendered)
        if not getattr(self.tokenizer, "is_fast", False):
            raise TemplateSpanError(
                "the prefix_diff loss mask needs a fast tokenizer (offset mapping)"
            )
        encoded = self.tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        mask = [0] * len(ids)
        span_index = 0
        for t, (char_start, char_end) in enumerate(encoded["offset_mapping"]):
            while span_index < len(spans) and spans[span_index][1] <= char_start:
                span_index += 1
            if span_index == len(spans):
                break
            start, end = spans[span_index]
            # Overlap, so a token straddling the span edge (a merged "\n") counts as assistant.
            if char_end > start and char_start < end and char_end > char_start:
                mask[t] = 1
        return ids, mask


class TemplateSpanError(ValueError):
    """The assistant turns of a conversation cannot be located in its rendered text."""
