"""Fixtures for the extraction tests: tiny random targets, data files, and one Ray session."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support import models
from tests.support.paths import REFERENCE_TARGET

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_target(directory: Path, architecture: str, seed: int = 0) -> Path:
    """A random 3-layer, hidden-64 model of ``architecture`` saved as a real model directory,
    with the reference target's tokenizer and chat template (vocab 8192 matches it)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    common: dict[str, Any] = dict(
        vocab_size=8192,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        pad_token_id=0,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    # Random init gives tiny hidden states; scale the embeddings so that values exercise bf16.
    if architecture == "qwen3":
        model = models.tiny_qwen3(seed, embed_scale=20.0, head_dim=16, **common)
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**common), dtype=torch.float32)
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(20.0)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copy(REFERENCE_TARGET / name, directory / name)
    return directory


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=1)


def write_jsonl(path: Path, records: list[Any]) -> Path:
    """Write records as JSON lines; a ``bytes`` or ``str`` item is written verbatim as a line."""
    with open(path, "wb") as handle:
        for record in records:
            if isinstance(record, bytes):
                line = record
            elif isinstance(record, str):
                line = record.encode()
            else:
                line = json.dumps(record).encode()
            handle.write(line + b"\n")
    return path


MIXED_RECORDS: list[dict[str, Any]] = [
    {"id": "t0", "text": "def add(a, b):\n    return a + b\n"},
    {
        "id": "c0",
        "messages": [
            {"role": "system", "content": "You are a Python coding assistant."},
            {"role": "user", "content": "Write a function that squares x."},
            {"role": "assistant", "content": "def square(x):\n    return x * x"},
        ],
    },
    {"id": "t1", "text": "import os\n\nprint(os.getcwd())\n" * 3},
    {
        "id": "c1",
        "conversations": [
            {"from": "human", "value": "Say hi."},
            {"from": "gpt", "value": "hi"},
            {"from": "human", "value": "Again, longer."},
            {"from": "gpt", "value": "hello there, again"},
        ],
    },
    {"id": "t2", "text": "x = 1\n"},
    {"id": "t3", "text": "class A:\n    pass\n\n\nclass B(A):\n    def f(self):\n        return 3\n"},
]


@pytest.fixture()
def mixed_data(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "mixed.jsonl", MIXED_RECORDS)
