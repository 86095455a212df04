"""One aux-layer contract (hsstore.aux_layers) for extraction, evaluation and the defaults: the ids
one accepts the other accepts, and both mean the same hidden state by them."""

from __future__ import annotations

import pytest
import torch

from hsstore import AuxLayerError
from hsstore.aux_layers import check_aux_layer_ids, default_aux_layer_ids
from pipelines.evaluate.target import TargetModel, TargetModelError
from pipelines.extract.capture import HiddenStateCapture
from tests.support.models import tiny_qwen3


def three_layer_qwen3(num_layers: int = 3) -> torch.nn.Module:
    return tiny_qwen3(num_hidden_layers=num_layers)


def test_defaults_are_clamped_and_deduplicated_in_one_place() -> None:
    assert default_aux_layer_ids(32) == [2, 16, 29]
    assert default_aux_layer_ids(8) == [2, 4, 5]
    assert default_aux_layer_ids(4) == [1, 2]
    assert default_aux_layer_ids(1) == [0, 1]
    with pytest.raises(AuxLayerError, match="num_hidden_layers must be >= 1"):
        default_aux_layer_ids(0)


def test_accepted_range_is_zero_to_num_layers() -> None:
    assert check_aux_layer_ids([0, 3, 8], 8) == [0, 3, 8]
    with pytest.raises(AuxLayerError, match=r"aux_layer_ids \[9\] out of range: this model has 8 decoder layers"):
        check_aux_layer_ids([2, 9], 8)
    with pytest.raises(AuxLayerError, match=r"\[-1\] out of range"):
        check_aux_layer_ids([-1], 8)


def test_extraction_and_evaluation_accept_and_mean_the_same_ids() -> None:
    """A store extracted with id L (the final norm's output) can be evaluated, and the states
    evaluation reads for every id equal what extraction stored."""
    model = three_layer_qwen3()
    num_layers = model.config.num_hidden_layers
    ids = [0, 1, num_layers]
    tokens = torch.tensor([[5, 9, 3, 17, 2, 40]])
    with HiddenStateCapture(model, ids, final_hidden_state=False) as capture:
        stored = capture(tokens, torch.ones_like(tokens))["aux_hidden_states"]  # [T, K, H]
    target = TargetModel(model, ids)
    evaluated = target.forward(tokens[0]).aux_QKH
    torch.testing.assert_close(evaluated, stored, rtol=1e-5, atol=1e-5)
    for bad in ([num_layers + 1], [-1]):
        with pytest.raises(ValueError, match="out of range"):
            HiddenStateCapture(model, bad)
        with pytest.raises(TargetModelError, match="out of range"):
            TargetModel(model, bad)
