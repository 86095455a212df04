"""The offline proxy on a real (small) store extracted from the reference target."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hsstore.errors import LineageMismatchError
from pipelines.evaluate.proxy import offline_proxy
from pipelines.evaluate.recipe import DecodeSetting, ProxyConfig
from pipelines.evaluate.target import TargetModel
from pipelines.train.teacher_mode import TeacherMode
from tests.pipelines.evaluate.helpers import random_draft


@pytest.mark.slow
def test_proxy_scores_every_depth_of_the_stored_samples(
    reference_store: str, reference_target: Path, reference_sdpa: TargetModel
) -> None:
    draft = random_draft(reference_sdpa, seed=6)
    settings = [
        DecodeSetting(num_draft_tokens=3),
        DecodeSetting(draft_top_k=2, draft_depth=2, total_draft_tokens=3),
    ]
    config = ProxyConfig(store=reference_store, max_samples=3, ttt_length=3)
    proxy = offline_proxy(draft, config, str(reference_target), settings, torch.device("cpu"))
    assert proxy["num_samples"] == 3 and proxy["teacher"] is TeacherMode.FINAL_HIDDEN
    assert len(proxy["accuracy_per_depth"]) == 3
    assert all(n > 0 for n in proxy["scored_per_depth"])
    # Depth i scores one position fewer per sample than depth i-1 (its target lies further ahead).
    assert proxy["scored_per_depth"][0] > proxy["scored_per_depth"][2]
    assert all(0.0 <= a <= 1.0 for a in proxy["accuracy_per_depth"])
    assert set(proxy["predicted_acceptance_length"]) == {"chain-3-greedy"}
    # A draft reading other layers cannot be scored on this store.
    other = random_draft(reference_sdpa, seed=6, aux_layer_ids=[1, 4, 5])
    with pytest.raises(
        LineageMismatchError, match=r"aux_layer_ids \[2, 4, 5\] differ from the draft's \[1, 4, 5\]"
    ):
        offline_proxy(other, config, str(reference_target), settings, torch.device("cpu"))
