"""The draft module: config derivation, RoPE against transformers, KV cache and tree masks."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pipelines.models.eagle3 import Eagle3Config, Eagle3Draft, rope_inv_freq
from tests.pipelines.models.helpers import random_inputs
from tests.support.models import tiny_draft, tiny_draft_config
from tests.support.paths import REFERENCE_TARGET


def test_config_from_the_reference_target():
    hf_config = AutoConfig.from_pretrained(REFERENCE_TARGET)
    config = Eagle3Config.from_target_config(hf_config, draft_vocab_size=2048)
    raw = json.loads((REFERENCE_TARGET / "config.json").read_text())
    assert config.hidden_size == config.target_hidden_size == raw["hidden_size"]
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (6, 2, 64)
    assert config.intermediate_size == raw["intermediate_size"]
    assert config.rope_theta == raw["rope_theta"] and config.rope_scaling is None
    assert config.vocab_size == 8192 and config.draft_vocab_size == 2048
    # vLLM's and SGLang's default [2, L//2, L-3] for the 8-layer target.
    assert config.aux_layer_ids == [2, 4, 5]
    assert config.target_architecture == "Qwen3ForCausalLM"
    # A plain dict works too, and overrides reach any field.
    assert Eagle3Config.from_target_config(raw, sliding_window=16).sliding_window == 16


def test_config_refuses_inconsistent_shapes():
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads"):
        tiny_draft_config(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="draft_vocab_size=300 exceeds the target vocab_size=256"):
        tiny_draft_config(draft_vocab_size=300)
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        tiny_draft_config(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        tiny_draft_config(num_layers=2)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    ],
)
def test_rope_frequencies_match_transformers(rope_scaling):
    hf = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        rope_theta=500000.0,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,  # transformers edits it
        max_position_embeddings=8192,
    )
    config = Eagle3Config.from_target_config(hf, draft_vocab_size=100)
    assert config.rope_scaling == rope_scaling
    expected = LlamaRotaryEmbedding(hf).inv_freq
    torch.testing.assert_close(rope_inv_freq(config).float(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_kv_cache_continues_a_full_forward(sliding_window):
    draft = tiny_draft(sliding_window=sliding_window)
    aux, ids, pos = random_inputs(draft, length=9)
    hidden = draft.fuse_aux(aux)
    full = draft(ids, hidden, pos).hidden_BTD
    cache = None
    pieces = []
    for start, stop in ((0, 4), (4, 5), (5, 9)):
        out = draft(
            ids[:, start:stop],
            hidden[:, start:stop],
            pos[:, start:stop],
            past_key_values=cache,
            use_cache=True,
        )
        cache = out.past_key_values
        pieces.append(out.hidden_BTD)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-6)
    k, v = cache
    assert k.shape == v.shape == (2, draft.config.num_key_value_heads, 9, draft.config.head_dim)
    assert draft(ids, hidden, pos).past_key_values is None


def test_window_changes_the_output_only_beyond_the_window():
    full = tiny_draft()
    windowed = tiny_draft(sliding_window=3)
    aux, ids, pos = random_inputs(full, length=8)
    a = full(ids, full.fuse_aux(aux), pos).hidden_BTD
    b = windowed(ids, windowed.fuse_aux(aux), pos).hidden_BTD
    torch.testing.assert_close(a[:, :3], b[:, :3])
    assert not torch.allclose(a[:, 3:], b[:, 3:])


def test_tree_mask_equals_each_branch_run_as_a_chain():
    """A two-branch tree after a 4-token prefix: each node must equal its branch as a chain."""
    draft = tiny_draft()
    aux, ids, pos = random_inputs(draft, batch=1, length=4)
    hidden = draft.fuse_aux(aux)
    prefix = draft(ids, hidden, pos, use_cache=True)
    # Tree nodes: 0 and 1 are siblings at depth 1; 2 is the child of 0 at depth 2.
    node_ids = torch.tensor([[11, 22, 33]])
    node_hidden = torch.randn(1, 3, draft.config.hidden_size)
    node_pos = torch.tensor([[4, 4, 5]])
    mask = torch.ones(1, 3, 4 + 3, dtype=torch.bool)
    mask[0, :, 4:] = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)
    tree = draft(
        node_ids, node_hidden, node_pos, attention_mask=mask, past_key_values=prefix.past_key_values
    )
    for branch in ([0, 2], [1]):
        chain = draft(
            node_ids[:, branch],
            node_hidden[:, branch],
            node_pos[:, branch],
            past_key_values=prefix.past_key_values,
        )
        torch.testing.assert_close(
            tree.hidden_BTD[:, branch], chain.hidden_BTD, rtol=1e-5, atol=1e-6
        )
    with pytest.raises(ValueError, match=r"attention_mask must be bool \[B=1, Q=3, S_past\+Q=7\]"):
        draft(
            node_ids,
            node_hidden,
            node_pos,
            attention_mask=mask[:, :, :6],
            past_key_values=prefix.past_key_values,
        )


def test_logits_vocab_mapping_and_frozen_embeddings():
    draft = tiny_draft()
    cfg = draft.config
    aux, ids, pos = random_inputs(draft)
    logits = draft.compute_logits(draft(ids, draft.fuse_aux(aux), pos).hidden_BTD)
    assert logits.shape == (2, 9, cfg.draft_vocab_size)
    target_ids = draft.draft_to_target(torch.arange(cfg.draft_vocab_size))
    assert torch.equal(target_ids, draft.t2d.nonzero().flatten())
    assert draft.d2t.dtype == torch.int64 and draft.t2d.dtype == torch.bool
    assert not draft.embed_tokens.weight.requires_grad
    # Parameter names are the serving layout's.
    names = {name for name, _ in draft.named_parameters()}
    assert {
        "fc.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.hidden_norm.weight",
        "lm_head.weight",
    } <= names
    assert draft.midlayer.self_attn.q_proj.weight.shape == (
        cfg.num_attention_heads * cfg.head_dim,
        2 * cfg.hidden_size,
    )
    with pytest.raises(ValueError, match="no candidate head"):
        draft.compute_candidate_logits(torch.zeros(1, cfg.hidden_size))


def test_bf16_draft_runs_and_keeps_integer_buffers():
    draft = tiny_draft().to(torch.bfloat16)
    aux, ids, pos = random_inputs(draft)
    out = draft(ids, draft.fuse_aux(aux), pos)
    assert out.hidden_BTD.dtype == torch.bfloat16
    assert draft.d2t.dtype == torch.int64 and draft.t2d.dtype == torch.bool
    assert isinstance(draft, Eagle3Draft)
