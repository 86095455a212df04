"""The decode loop's preallocated KV cache: the same tokens as transformers' DynamicCache, written
in place, rows dropped by compaction kept in order."""

from __future__ import annotations

import pytest
import torch

from pipelines.generate import engine
from pipelines.generate.engine import BatchGenerator, SamplingParams
from pipelines.generate.kv_cache import PreallocatedLayer, preallocated_cache
from pipelines.generate.prompts import Request
from tests.support.models import tiny_qwen3


def _requests(count: int, seed: int = 0) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(count):
        length = int(torch.randint(3, 12, (1,), generator=gen))
        ids = tuple(torch.randint(1, 60, (length,), generator=gen).tolist())
        requests.append(Request(ids, max_new_tokens=[3, 9, 16, 5, 12, 16][i % 6], seed=i))
    return requests


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20)])
def test_the_preallocated_cache_decodes_what_the_dynamic_cache_decodes(monkeypatch, params) -> None:
    """Six rows of other prompt lengths and limits: rows finish at different steps, so the batch
    is compacted (``batch_select_indices``) twice on the way; greedy and sampled."""
    model = tiny_qwen3(max_position_embeddings=128, num_hidden_layers=3)
    generator = BatchGenerator(model, None, stop_token_ids=[63], pad_token_id=0, params=params,
                               max_batch_size=8, token_budget=10_000)
    requests = _requests(6)
    selected = []
    original = PreallocatedLayer.batch_select_indices

    def counting(self, indices):
        selected.append(len(indices))
        return original(self, indices)

    monkeypatch.setattr(PreallocatedLayer, "batch_select_indices", counting)
    monkeypatch.setattr(engine, "KV_CACHE", "preallocated")
    got = generator.generate_ids(requests)
    assert selected, "the batch was never compacted: the test would not cover it"

    monkeypatch.setattr(engine, "KV_CACHE", "dynamic")
    count = len(selected)
    want = generator.generate_ids(requests)
    assert len(selected) == count, "the dynamic path used the preallocated cache"
    assert got == want


def test_the_loop_preallocates_by_default() -> None:
    config = tiny_qwen3(max_position_embeddings=128, num_hidden_layers=2).config
    assert engine.KV_CACHE == "preallocated"
    assert all(isinstance(layer, PreallocatedLayer) for layer in engine.new_cache(config, 20).layers)


def test_each_step_writes_into_the_same_buffer() -> None:
    model = tiny_qwen3(max_position_embeddings=128, num_hidden_layers=2)
    cache = preallocated_cache(model.config, capacity=20)
    assert all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
    keys = [torch.randn(2, 2, 5, 8), *[torch.randn(2, 2, 1, 8) for _ in range(4)]]
    addresses = set()
    held = []  # the views keep their buffer alive: a freed buffer's address can be handed out again
    for k in keys:
        out_k, out_v = cache.layers[0].update(k, -k)
        addresses.add(out_k.data_ptr())
        held.append(out_k)
    assert len(addresses) == 1  # one buffer, views of its filled prefix
    torch.testing.assert_close(cache.layers[0].keys, torch.cat(keys, dim=-2))
    torch.testing.assert_close(cache.layers[0].values, -torch.cat(keys, dim=-2))
    assert cache.get_seq_length(0) == 9
    # Compaction keeps the chosen rows and the buffer's room; the next step writes after them.
    cache.layers[0].batch_select_indices(torch.tensor([1]))
    new = torch.randn(1, 2, 1, 8)
    out_k, _ = cache.layers[0].update(new, -new)
    torch.testing.assert_close(out_k, torch.cat([torch.cat(keys, dim=-2)[1:], new], dim=-2))
    # Past the capacity, or after something replaced its tensors, the layer copies into new buffers.
    cache.layers[0].keys = cache.layers[0].keys.clone()
    cache.layers[0].values = cache.layers[0].values.clone()
    long = torch.randn(1, 2, 15, 8)
    out_k, _ = cache.layers[0].update(long, -long)
    assert out_k.shape[-2] == 25 and out_k.data_ptr() not in addresses
    torch.testing.assert_close(out_k[..., -15:, :], long)
