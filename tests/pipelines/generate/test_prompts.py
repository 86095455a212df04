"""Fast tests of what is regenerated: prompts from records, rejections, seeds, the sampler, batches,
and the prompt/completion records extraction reads back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hsstore.errors import RecipeError
from pipelines.extract.records import Record, Rejection, RejectReason, parse_record
from pipelines.extract.tokenize import SampleTokenizer
from pipelines.generate.engine import SamplingParams, choose_next, plan_generation_batches
from pipelines.generate.prompts import (
    FINISH_CONTEXT,
    FINISH_LENGTH,
    FINISH_STOP,
    Answer,
    PromptBuilder,
    Request,
    answer_seed,
)
from pipelines.generate.recipe import GenerateRecipe
from pipelines.recipe import build_recipe


@pytest.fixture(scope="module")
def tokenizer(reference_target: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(reference_target)


def builder(tokenizer: Any, **changes: Any) -> PromptBuilder:
    settings: dict[str, Any] = {
        "text_prefix_tokens": 8,
        "max_context": 4096,
        "max_new_tokens": 16,
        "seed": 0,
    }
    settings.update(changes)
    return PromptBuilder(tokenizer, **settings)


def chat(*turns: tuple[str, str], source_id: str = "r1") -> Record:
    return Record(
        source_id=source_id,
        origin="data.jsonl:1",
        messages=tuple({"role": role, "content": content} for role, content in turns),
    )


def test_answer_seed_is_stable_and_distinct() -> None:
    assert answer_seed(0, "a", 0) == answer_seed(0, "a", 0)
    seeds = {answer_seed(s, i, t) for s in (0, 1) for i in ("a", "b") for t in (0, 1)}
    assert len(seeds) == 8
    assert all(0 <= s < 2**63 for s in seeds)


def test_every_assistant_turn_is_regenerated_with_the_earlier_answers(tokenizer: Any) -> None:
    b = builder(tokenizer)
    record = chat(("system", "S"), ("user", "U1"), ("assistant", "old 1"), ("user", "U2"), ("assistant", "old 2"))
    job = b.start(record)
    assert not isinstance(job, Rejection) and job.turns == [2, 4]
    first = b.request(job)
    assert isinstance(first, Request) and first.messages is not None
    assert [m["content"] for m in first.messages] == ["S", "U1"]
    assert first.prompt_text is not None and first.prompt_text.endswith("<|im_start|>assistant\n")
    b.accept(job, first, Answer("new 1", 3, FINISH_STOP))
    second = b.request(job)
    assert isinstance(second, Request) and second.messages is not None
    # The target's own first answer is in the context of the second turn, not the dataset's.
    assert [m["content"] for m in second.messages] == ["S", "U1", "new 1", "U2"]
    assert second.seed != first.seed
    b.accept(job, second, Answer("new 2", 16, FINISH_LENGTH))
    assert job.done
    out = job.to_output()
    assert [m["content"] for m in out["messages"]] == ["S", "U1", "new 1", "U2", "new 2"]
    assert out["generation"] == {"truncated": True, "finish_reasons": ["stop", "length"], "num_new_tokens": 19}


def test_a_prompt_set_gets_its_answer_and_leading_assistant_turns_stay(tokenizer: Any) -> None:
    b = builder(tokenizer)
    job = b.start(chat(("assistant", "hello, ask me"), ("user", "U")))
    assert not isinstance(job, Rejection)
    assert job.turns == [2] and job.messages[0]["content"] == "hello, ask me"


@pytest.mark.parametrize(
    ("record", "reason", "match"),
    [
        (chat(("system", "S"), ("assistant", "A")), RejectReason.NO_USER_TURN, "no user turn"),
        (chat(("system", " "), ("user", "  ")), RejectReason.EMPTY, "prompt .* is empty"),
        (Record(source_id="t", origin="d:2", text="   \n"), RejectReason.EMPTY, "text prompt is empty"),
    ],
)
def test_bad_records_are_rejected_with_a_reason(tokenizer: Any, record: Record, reason: RejectReason, match: str) -> None:
    rejection = builder(tokenizer).start(record)
    assert isinstance(rejection, Rejection) and rejection.reason == reason
    assert rejection.origin == record.origin
    import re

    assert re.search(match, rejection.message), rejection.message


def test_a_prompt_past_the_context_is_rejected_and_a_long_answer_is_capped(tokenizer: Any) -> None:
    record = chat(("user", "x = 1\n" * 40))
    tight = builder(tokenizer, max_context=20)
    job = tight.start(record)
    rejection = tight.request(job)  # type: ignore[arg-type]
    assert isinstance(rejection, Rejection) and rejection.reason == RejectReason.TOO_LONG
    assert "no room in the context of 20" in rejection.message
    roomy = builder(tokenizer, max_context=200, max_new_tokens=500)
    job = roomy.start(record)
    request = roomy.request(job)  # type: ignore[arg-type]
    assert isinstance(request, Request) and request.max_new_tokens == 200 - len(request.prompt_ids)
    roomy.accept(job, request, Answer("y", request.max_new_tokens, FINISH_LENGTH))  # type: ignore[arg-type]
    assert job.finish_reasons == [FINISH_CONTEXT]  # type: ignore[union-attr]


def test_text_records_continue_their_first_tokens(tokenizer: Any) -> None:
    text = "import os\nimport sys\n\n\ndef main():\n    print(os.getcwd())\n"
    b = builder(tokenizer, text_prefix_tokens=6)
    job = b.start(Record(source_id="f.py", origin="d:1", text=text))
    assert not isinstance(job, Rejection) and len(job.prompt_ids) == 6
    assert text.startswith(job.prompt_text) and len(job.prompt_text) < len(text)
    assert tokenizer(job.prompt_text)["input_ids"] == list(job.prompt_ids)
    request = b.request(job)
    assert isinstance(request, Request) and request.messages is None and request.prompt_text == job.prompt_text
    b.accept(job, request, Answer("\n    pass\n", 4, FINISH_STOP))
    assert job.to_output() == {
        "id": "f.py",
        "prompt": job.prompt_text,
        "completion": "\n    pass\n",
        "generation": {"truncated": False, "finish_reasons": ["stop"], "num_new_tokens": 4},
    }


def test_extraction_reads_a_continuation_with_loss_on_the_completion(tokenizer: Any) -> None:
    record = parse_record({"id": "c", "prompt": "def f(x):\n    ret", "completion": "urn x + 1\n"}, "d:1", "d:1")
    assert isinstance(record, Record) and record.prompt == "def f(x):\n    ret"
    sample = SampleTokenizer(tokenizer, max_length=64)(record)
    assert not isinstance(sample, Rejection)
    ids, mask = list(sample.input_ids), list(sample.loss_mask)
    masked = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    unmasked = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    assert masked.strip() == "return x + 1"  # the token straddling the boundary carries loss
    assert unmasked == "def f(x):\n   "
    # A dataset's "prompt" metadata beside its messages is not a continuation (UltraChat's shape).
    both = parse_record(
        {"prompt": "p", "messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]},
        "d:2",
        "d:2",
    )
    assert isinstance(both, Record) and both.messages is not None and both.prompt is None
    bad = parse_record({"prompt": "p", "completion": 3}, "d:3", "d:3")
    assert isinstance(bad, Rejection) and bad.reason == RejectReason.WRONG_TYPE


def test_sampler_rows_follow_their_own_generators() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    assert choose_next(logits, SamplingParams(), [None] * 3).tolist() == logits.argmax(-1).tolist()
    params = SamplingParams(temperature=1.0)

    def draw(seed: int, batch: torch.Tensor) -> int:
        gens = [torch.Generator().manual_seed(seed + r) for r in range(batch.shape[0])]
        return int(choose_next(batch, params, gens)[0])

    # Row 0's draw does not depend on what else is in the batch.
    assert draw(7, logits) == draw(7, logits[:1])
    # top_k=1 and a tiny top_p are greedy whatever the generator.
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    assert choose_next(logits, SamplingParams(temperature=1.0, top_k=1), gens).tolist() == logits.argmax(-1).tolist()
    assert choose_next(logits, SamplingParams(temperature=1.0, top_p=1e-6), gens).tolist() == logits.argmax(-1).tolist()
    # top_k=5 never leaves the 5 most likely tokens.
    top5 = torch.topk(logits, 5).indices
    for seed in range(20):
        gens = [torch.Generator().manual_seed(seed * 3 + r) for r in range(3)]
        picked = choose_next(logits, SamplingParams(temperature=2.0, top_k=5), gens)
        assert all(int(p) in top5[r].tolist() for r, p in enumerate(picked))


def test_sampled_tokens_follow_the_distribution_and_never_a_cut_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """One draw per row through the cumulative distribution: frequencies match the probabilities
    (top-k applied), tokens cut by top-k never come, and a uniform next to 1 still lands on a token
    of mass."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 5.0, -30.0]]).repeat(4000, 1)
    params = SamplingParams(temperature=1.0, top_k=4)
    gens = [torch.Generator().manual_seed(seed) for seed in range(4000)]
    counts = torch.bincount(choose_next(logits, params, gens), minlength=6).double()
    kept = [0, 1, 2, 4]
    expected = torch.softmax(logits[0, kept], dim=-1).double() * 4000
    assert counts[3] == 0 and counts[5] == 0
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # 3 degrees of freedom: p = 0.001
    # u = 1 - 2^-53 rounds to 1.0 in float32; the draw must still be token 1, not one past it.
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0 - 2.0**-53, dtype=torch.float64))
    assert choose_next(torch.tensor([[0.0, 9.0, -1e9, -1e9]]), SamplingParams(temperature=1.0), [None]).tolist() == [1]


def test_batches_are_length_sorted_within_the_token_budget() -> None:
    requests = [Request(prompt_ids=tuple(range(n)), max_new_tokens=10, seed=0) for n in (5, 30, 12, 30, 1)]
    batches = plan_generation_batches(requests, max_batch_size=2, token_budget=80)
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3, 4]
    assert batches[0] == [1, 3]  # longest first
    for batch in batches:
        assert len(batch) <= 2
        assert max(len(requests[i].prompt_ids) + 10 for i in batch) * len(batch) <= 80
    # A request larger than the budget still runs, alone.
    assert plan_generation_batches(requests[1:2], 4, 8) == [[0]]
    # Padding: 30, 30, 12 pad 18 of 90 prefill tokens (20%); adding 5 would pad 43 of 120 (36%),
    # and 5 with 1 pads 4 of 10.
    capped = plan_generation_batches(requests, max_batch_size=8, token_budget=10_000, max_padding_share=0.3)
    assert capped == [[1, 3, 2], [0], [4]]
    assert plan_generation_batches(requests, 8, 10_000) == [[1, 3, 2, 0, 4]]


def test_recipe_refuses_unknown_keys_and_a_budget_under_one_answer(reference_target: Path) -> None:
    base = {"target": str(reference_target), "data": "d.jsonl", "output": "out"}
    recipe = build_recipe(GenerateRecipe, base)
    assert recipe.data == ["d.jsonl"] and recipe.sampling.greedy
    with pytest.raises(RecipeError, match="sampling.temprature: unknown key"):
        build_recipe(GenerateRecipe, base, ["sampling.temprature=1"])
    with pytest.raises(RecipeError, match="token_budget"):
        build_recipe(GenerateRecipe, base, ["batching.token_budget=100", "sampling.max_new_tokens=200"])
