"""Tiny random models for unit tests: a Qwen3 target and EAGLE-3 drafts.

One builder each, so that every test's model is built (and seeded, and made non-trivial) the same
way; a test passes the shape it needs as overrides.
"""

from __future__ import annotations

from typing import Any

import torch

from pipelines.models.eagle3 import Eagle3Config, Eagle3Draft

# A Qwen3 small enough to run in milliseconds on a CPU; tests override what they need.
TINY_QWEN3 = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)


def tiny_qwen3(seed: int = 0, *, embed_scale: float | None = None, dtype: torch.dtype = torch.float32, **config: Any) -> torch.nn.Module:
    """A random Qwen3 causal LM (sdpa attention, eval mode) in memory.

    ``embed_scale`` multiplies the input embeddings: random init gives tiny hidden states, and
    extraction tests want values that exercise bf16."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**{**TINY_QWEN3, **config}), dtype=dtype, attn_implementation="sdpa")
    if embed_scale is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(embed_scale)
    return model.eval()


def tiny_draft_config(**overrides: Any) -> Eagle3Config:
    """The model and export tests' draft: hidden 64, target vocab 256, draft vocab 96."""
    values: dict[str, Any] = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=256,
        draft_vocab_size=96,
        target_hidden_size=64,
        aux_layer_ids=[2, 4, 5],
        rope_theta=10000.0,
    )
    values.update(overrides)
    return Eagle3Config(**values)


def perturb_norms(draft: Eagle3Draft) -> Eagle3Draft:
    """Every norm weight (EAGLE-3.1's per-layer ``fc_norm`` included) drawn from U(0.5, 1.5), so a
    dropped, swapped or misnamed norm changes the logits."""
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return draft


def build_draft(config: Eagle3Config, seed: int = 0, *, vocab_mapping: bool = True, dtype: torch.dtype | None = None) -> Eagle3Draft:
    """A seeded random draft of ``config`` with non-unit norms and, unless ``vocab_mapping`` is
    False, a random (sorted) draft vocabulary, so that a wrong ``d2t``/``t2d`` shows."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(config)
    if dtype is not None:
        draft = draft.to(dtype)
    if vocab_mapping:
        target_ids = torch.randperm(config.vocab_size)[: config.draft_vocab_size].sort().values
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[target_ids] = True
        draft.set_vocab_mapping(target_ids - torch.arange(config.draft_vocab_size), t2d)
    return perturb_norms(draft)


def tiny_draft(seed: int = 0, **overrides: Any) -> Eagle3Draft:
    """:func:`build_draft` of :func:`tiny_draft_config` (``overrides`` go to the config)."""
    return build_draft(tiny_draft_config(**overrides), seed)
