"""``--format eagle4`` against eagle-harness 0.1.3 (EAGLE-4's serving plugin).

Its engine-free config validator (``eagle_harness.models.eagle4_config``) runs on the export when
the harness is importable (``pip install --no-deps`` of its wheel needs no engine; it is
source-available, so it is a peer to test against, not a dependency). The key-by-key check of the
weights against the parameters its SGLang loader builds (read from its source: names under
``model.`` except the heads, ``midlayer.`` loaded as ``layers.0.``, a KeyError on any tensor
without a parameter, the embedding optional) runs always.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from pipelines.export.serving import export_draft
from pipelines.models.checkpoint import save_draft
from pipelines.train.candidate import attach_candidate_head
from tests.pipelines.export.test_export import exported_tensors
from tests.pipelines.models.helpers import random_inputs
from tests.support.models import tiny_draft

V, H, RANK, WINDOW = 256, 64, 8, 16
TOP_LEVEL = ("lm_head.", "efficient_lm_head.", "efficient_lm_head_down_proj.")


def harness_export(tmp_path: Path, **overrides) -> tuple[torch.nn.Module, Path]:
    draft = tiny_draft(draft_vocab_size=V, sliding_window=WINDOW, fc_norm=True, norm_output=True, **overrides)
    attach_candidate_head(draft, rank=RANK, num_candidates=32)
    save_draft(draft, tmp_path / "draft")
    return draft, export_draft(tmp_path / "draft", "eagle4", tmp_path / "out", dtype="float32")


def harness_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """The parameters (name -> shape) the harness's one-layer dense draft has for ``config``,
    q/k/v and gate/up unfused (its loader fuses them from these checkpoint names)."""
    h, h_t, v = config["hidden_size"], config["target_hidden_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    inter, rank = config["intermediate_size"], config["efficient_lm_head_config"]["rank"]
    layer = "model.layers.0."
    params = {
        "model.fc.weight": (h, 3 * h_t),
        f"{layer}self_attn.q_proj.weight": (q, 2 * h),
        f"{layer}self_attn.k_proj.weight": (kv, 2 * h),
        f"{layer}self_attn.v_proj.weight": (kv, 2 * h),
        f"{layer}self_attn.o_proj.weight": (h, q),
        f"{layer}mlp.gate_proj.weight": (inter, h),
        f"{layer}mlp.up_proj.weight": (inter, h),
        f"{layer}mlp.down_proj.weight": (h, inter),
        f"{layer}input_layernorm.weight": (h,),
        f"{layer}hidden_norm.weight": (h,),
        f"{layer}post_attention_layernorm.weight": (h,),
        "model.norm.weight": (h,),
        "lm_head.weight": (v, h),
        "efficient_lm_head.weight": (v, rank),
        "efficient_lm_head_down_proj.weight": (rank, h),
    }
    if config.get("fc_norm"):
        params.update({f"model.fc_norm.{k}.weight": (h_t,) for k in range(3)})
    return params


def loader_name(name: str) -> str:
    """A checkpoint tensor's parameter name as the harness's SGLang loader maps it."""
    name = name.removeprefix("model.")
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer.") :]
    return name if name.startswith(TOP_LEVEL) else "model." + name


def test_every_tensor_has_a_harness_parameter_and_every_parameter_a_tensor(tmp_path: Path) -> None:
    _, out = harness_export(tmp_path)
    config = json.loads((out / "config.json").read_text())
    expected = harness_parameters(config)
    got = {loader_name(k): tuple(t.shape) for k, t in exported_tensors(out).items()}
    assert not set(got) - set(expected), "the loader raises KeyError on these"
    assert not set(expected) - set(got), "the loader reports these missing"
    assert got == expected


def test_the_harness_validator_accepts_the_export(tmp_path: Path) -> None:
    eagle4_config = pytest.importorskip(
        "eagle_harness.models.eagle4_config",
        reason="eagle-harness 0.1.3 is not installed (pip install --no-deps its wheel)",
    )
    draft, out = harness_export(tmp_path)
    config = AutoConfig.from_pretrained(out)
    eagle4_config.validate_eagle4_draft_config(config)
    eagle4_config.check_ported(config)  # dense one-layer draft, full vocab, candidate head
    assert eagle4_config.resolve_draft_sliding_window(config) == WINDOW
    # The validator is not vacuous: the old layout's keys are refused.
    config.hsstore_draft_config = draft.config.model_dump(mode="json")
    with pytest.raises(ValueError, match="hsstore_draft_config"):
        eagle4_config.validate_eagle4_draft_config(config)


def test_the_harness_low_rank_scores_equal_our_candidate_logits(tmp_path: Path) -> None:
    low_rank_head = pytest.importorskip(
        "eagle_harness.models.low_rank_head",
        reason="eagle-harness 0.1.3 is not installed (pip install --no-deps its wheel)",
    )
    draft, out = harness_export(tmp_path)
    tensors = exported_tensors(out)
    aux, ids, pos = random_inputs(draft)
    with torch.no_grad():
        hidden = draft(ids, draft.fuse_aux(aux), pos).hidden_BTD.flatten(0, 1)
        ours = draft.compute_candidate_logits(hidden)
        # The harness scores the normed output its model returns (with norm_output, the fed-back h).
        theirs = low_rank_head.low_rank_scores(
            draft.head_input(hidden),
            tensors["efficient_lm_head_down_proj.weight"],
            tensors["efficient_lm_head.weight"],
            V,
        )
    torch.testing.assert_close(theirs, ours, rtol=0, atol=0)
