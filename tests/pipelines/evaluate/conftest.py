"""Fixtures: the reference target wrapped for verification, prompts, small random drafts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pipelines.evaluate.target import TargetModel
from tests.pipelines.evaluate.helpers import one_thread

AUX_LAYER_IDS = [2, 4, 5]


@pytest.fixture(scope="session")
def reference_sdpa(reference_target: Path) -> TargetModel:
    return TargetModel.from_pretrained(
        reference_target, AUX_LAYER_IDS, torch.float32, "cpu", "sdpa"
    )


@pytest.fixture(scope="session")
def reference_eager(reference_target: Path) -> TargetModel:
    return TargetModel.from_pretrained(
        reference_target, AUX_LAYER_IDS, torch.float32, "cpu", "eager"
    )


@pytest.fixture(scope="session")
def prompt_ids(reference_target: Path, shared_data: Path) -> list[list[int]]:
    """Tokenized eval prompts (chat template + generation prompt), cut to their last 64 tokens
    to keep the CPU tests fast; the tail keeps the template's assistant header."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(reference_target))
    prompts = []
    with open(shared_data / "eval_prompts.jsonl", encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            text = tokenizer.apply_chat_template(
                record["messages"], add_generation_prompt=True, tokenize=False
            )
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"][-64:])
    return prompts


@pytest.fixture(autouse=True)
def single_torch_thread() -> Iterator[None]:
    """Batch-1 decoding of small models gains nothing from intra-op threads, and on a loaded
    2-core machine OpenMP's spin-waiting made one reference forward 50x slower (2.8 s vs 0.05 s).
    Module-scoped fixtures that run models use :func:`one_thread` themselves."""
    with one_thread():
        yield


@pytest.fixture(scope="session")
def short_prompts_file(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The eval prompts with each message cut to 240 characters: real chats, fast prefills."""
    path = tmp_path_factory.mktemp("prompts") / "short_prompts.jsonl"
    with open(shared_data / "eval_prompts.jsonl", encoding="utf-8") as src, open(path, "w") as dst:
        for line in src:
            record = json.loads(line)
            record["messages"] = [{**m, "content": m["content"][:240]} for m in record["messages"]]
            dst.write(json.dumps(record) + "\n")
    return path
