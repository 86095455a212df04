"""Loss masks equal the assistant spans, on hand-written conversations, for both mask methods."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from pipelines.extract.records import Record
from pipelines.extract.tokenize import SampleTokenizer, TokenizedSample, has_generation_markers
from tests.support.paths import REFERENCE_TARGET

CONVERSATION = (
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Square x."},
    {"role": "assistant", "content": "def square(x):\n    return x * x"},
    {"role": "user", "content": "And cube?"},
    {"role": "assistant", "content": "def cube(x):\n    return x ** 3"},
)

# ChatML without generation markers (Qwen2.5-style): the fallback must find the same spans.
CHATML_NO_MARKERS = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3-style: assistant turns after the last user turn get an empty think block, earlier ones
# do not, so a turn renders differently as the last message than inside the full conversation.
THINKING_NO_MARKERS = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' and loop.index0 > ns.last_user %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2.5-style: a default system prompt is injected when the conversation has none.
DEFAULT_SYSTEM_NO_MARKERS = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nBe helpful.<|im_end|>\\n' }}{%- endif %}"
    + CHATML_NO_MARKERS
)


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(REFERENCE_TARGET)


def with_template(tokenizer, template: str):  # type: ignore[no-untyped-def]
    clone = copy.copy(tokenizer)
    clone.chat_template = template
    return clone


def masked_runs(tokenizer, sample: TokenizedSample) -> list[str]:  # type: ignore[no-untyped-def]
    """The text of each contiguous run of loss-masked tokens."""
    runs, current = [], []
    for token, bit in zip(sample.input_ids.tolist(), sample.loss_mask.tolist(), strict=True):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def tokenize(tokenizer, messages, **kwargs) -> TokenizedSample:  # type: ignore[no-untyped-def]
    result = SampleTokenizer(tokenizer, max_length=kwargs.pop("max_length", 512), **kwargs)(
        Record("c", "chat.jsonl:1", messages=tuple(messages))
    )
    assert isinstance(result, TokenizedSample), result
    return result


def test_generation_markers_mask_exactly_the_assistant_turns(tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert has_generation_markers(tokenizer.chat_template)
    sample = tokenize(tokenizer, CONVERSATION, loss_mask="auto")
    assert masked_runs(tokenizer, sample) == [
        "def square(x):\n    return x * x<|im_end|>",
        "def cube(x):\n    return x ** 3<|im_end|>",
    ]
    rendered = tokenizer.apply_chat_template(list(CONVERSATION), tokenize=False)
    assert sample.input_ids.tolist() == tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_prefix_diff_fallback_agrees_with_the_markers(tokenizer) -> None:  # type: ignore[no-untyped-def]
    markers = tokenize(tokenizer, CONVERSATION, loss_mask="generation_markers")
    fallback = tokenize(tokenizer, CONVERSATION, loss_mask="prefix_diff")
    assert np.array_equal(markers.input_ids, fallback.input_ids)
    assert np.array_equal(markers.loss_mask, fallback.loss_mask)


def test_fallback_on_a_template_without_markers(tokenizer) -> None:  # type: ignore[no-untyped-def]
    plain = with_template(tokenizer, CHATML_NO_MARKERS)
    assert not has_generation_markers(plain.chat_template)
    sample_tokenizer = SampleTokenizer(plain, max_length=512)
    assert sample_tokenizer.loss_mask_mode == "prefix_diff"
    sample = tokenize(plain, CONVERSATION)
    assert masked_runs(plain, sample) == [
        "def square(x):\n    return x * x<|im_end|>",
        "def cube(x):\n    return x ** 3<|im_end|>",
    ]
    with pytest.raises(ValueError, match=r"loss_mask=generation_markers but the chat template has no"):
        SampleTokenizer(plain, max_length=512, loss_mask="generation_markers")


def test_fallback_on_a_template_that_rewrites_earlier_turns(tokenizer) -> None:  # type: ignore[no-untyped-def]
    thinking = with_template(tokenizer, THINKING_NO_MARKERS)
    sample = tokenize(thinking, CONVERSATION)
    assert masked_runs(thinking, sample) == [
        "def square(x):\n    return x * x<|im_end|>",
        "<think>\n\n</think>\n\ndef cube(x):\n    return x ** 3<|im_end|>",
    ]


def test_conversation_opening_with_the_assistant(tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "assistant", "content": "Hello, how can I help?"}, {"role": "user", "content": "Bye."}]
    for mode in ("generation_markers", "prefix_diff"):
        sample = tokenize(tokenizer, messages, loss_mask=mode)
        assert masked_runs(tokenizer, sample) == ["Hello, how can I help?<|im_end|>"]
    default_system = with_template(tokenizer, DEFAULT_SYSTEM_NO_MARKERS)
    sample = tokenize(default_system, messages)
    assert tokenizer.decode(sample.input_ids).startswith("<|im_start|>system\nBe helpful.")
    assert masked_runs(default_system, sample) == ["Hello, how can I help?<|im_end|>"]


def test_truncation_cuts_the_mask_with_the_ids(tokenizer) -> None:  # type: ignore[no-untyped-def]
    full = tokenize(tokenizer, CONVERSATION)
    cut_at = int(np.flatnonzero(full.loss_mask)[3]) + 1  # inside the first assistant turn
    cut = tokenize(tokenizer, CONVERSATION, max_length=cut_at, too_long="truncate")
    assert cut.truncated and cut.num_tokens == cut_at
    assert np.array_equal(cut.input_ids, full.input_ids[:cut_at])
    assert np.array_equal(cut.loss_mask, full.loss_mask[:cut_at])
    assert int(cut.loss_mask.sum()) == 4


def test_text_records_carry_loss_everywhere(tokenizer) -> None:  # type: ignore[no-untyped-def]
    result = SampleTokenizer(tokenizer, max_length=64)(Record("t", "f:1", text="print('hi')\n"))
    assert isinstance(result, TokenizedSample)
    assert result.input_ids.tolist() == tokenizer("print('hi')\n")["input_ids"]
    assert result.loss_mask.dtype == np.uint8 and result.loss_mask.all()
