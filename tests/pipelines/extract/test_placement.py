"""A target split over several devices gives the features it gives on one (placement.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from pipelines.extract.batching import Batch, collate
from pipelines.extract.capture import HiddenStateCapture
from pipelines.extract.placement import move_to, split_across_devices
from tests.support.models import tiny_qwen3


def batch_features(model: torch.nn.Module, output_device: str, topk: bool = False) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(0)
    token_ids = [rng.integers(3, 8192, n).astype(np.int32) for n in (17, 5, 30)]
    batch = Batch((0, 1, 2), 32, sum(len(t) for t in token_ids))
    input_ids, attention_mask = collate(token_ids, batch, pad_token_id=0)
    valid = torch.from_numpy(np.flatnonzero(attention_mask.reshape(-1))).to(output_device)
    with HiddenStateCapture(model, [0, 2, 4], topk_k=4 if topk else None, pass_attention_mask=False) as capture:
        # The worker moves a batch to the model's input device; so does this (a split model's
        # pre-hook would too, a plain one would not).
        input_device = next(model.parameters()).device
        return capture(torch.from_numpy(input_ids).to(input_device), torch.from_numpy(attention_mask).to(input_device), valid)


def test_move_to_reaches_nested_tensors() -> None:
    value = {"a": (torch.ones(1), [torch.zeros(2)]), "b": 3}
    moved = move_to(value, torch.device("meta"))
    assert moved["a"][0].device.type == "meta" and moved["a"][1][0].device.type == "meta" and moved["b"] == 3


def tiny_qwen3_model() -> torch.nn.Module:
    """A random 4-layer Qwen3 in memory (no files: the GPU box runs this without the repo's models)."""
    return tiny_qwen3(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=4, head_dim=16,
                      max_position_embeddings=40960, tie_word_embeddings=False, embed_scale=20.0)


def test_split_over_two_host_devices_changes_nothing() -> None:
    """The hooks and the placement rule, on the CPU (two 'devices' that are the same one)."""
    model = tiny_qwen3_model()
    whole = batch_features(model, "cpu", topk=True)
    split = copy.deepcopy(model)
    placement = split_across_devices(split, ["cpu", "cpu"])
    assert len(placement.layer_devices) == 4
    got = batch_features(split, "cpu", topk=True)
    for name, values in whole.items():
        assert torch.equal(got[name], values), name
    with pytest.raises(ValueError, match="4 decoder layers cannot be split over 5 devices"):
        split_across_devices(copy.deepcopy(model), ["cpu"] * 5)


@pytest.mark.gpu
def test_split_over_two_gpus_matches_one() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    one = tiny_qwen3_model().to("cuda:0")
    split = tiny_qwen3_model()
    placement = split_across_devices(split, ["cuda:0", "cuda:1"])
    assert placement.layer_devices == (torch.device("cuda:0"),) * 2 + (torch.device("cuda:1"),) * 2
    assert split.model.norm.weight.device == torch.device("cuda:1")
    want, got = batch_features(one, "cuda:0", topk=True), batch_features(split, "cuda:1", topk=True)
    for name, values in want.items():
        assert got[name].device == torch.device("cuda:1")
        torch.testing.assert_close(got[name].cpu(), values.cpu(), rtol=1e-5, atol=1e-5)
