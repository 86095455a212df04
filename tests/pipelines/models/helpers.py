"""Tiny drafts shared by the model and export tests (hidden 64, target vocab 256)."""

from __future__ import annotations

import torch

from pipelines.models.eagle3 import Eagle3Config, Eagle3Draft


def tiny_config(**overrides) -> Eagle3Config:
    values = dict(
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


def tiny_draft(seed: int = 0, **overrides) -> Eagle3Draft:
    """A random draft with a non-trivial vocabulary mapping and non-unit norm weights."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(tiny_config(**overrides))
    cfg = draft.config
    target_ids = torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    draft.set_vocab_mapping(target_ids - torch.arange(cfg.draft_vocab_size), t2d)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return draft


def random_inputs(draft: Eagle3Draft, batch: int = 2, length: int = 9, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    cfg = draft.config
    aux = torch.randn(batch, length, cfg.num_aux_layers, cfg.target_hidden_size, generator=gen)
    ids = torch.randint(0, cfg.vocab_size, (batch, length), generator=gen)
    pos = torch.arange(length).expand(batch, length)
    return aux, ids, pos
