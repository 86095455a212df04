"""Inputs for the model and export tests' tiny drafts (built by tests.support.models.tiny_draft)."""

from __future__ import annotations

import torch

from pipelines.models.eagle3 import Eagle3Draft


def random_inputs(draft: Eagle3Draft, batch: int = 2, length: int = 9, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    cfg = draft.config
    aux = torch.randn(batch, length, cfg.num_aux_layers, cfg.target_hidden_size, generator=gen)
    ids = torch.randint(0, cfg.vocab_size, (batch, length), generator=gen)
    pos = torch.arange(length).expand(batch, length)
    return aux, ids, pos
