"""save_draft / load_draft / init_from_pretrained."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipelines.models.checkpoint import (
    DraftCheckpointError,
    init_from_pretrained,
    load_draft,
    save_draft,
)
from pipelines.models.eagle3 import Eagle3Draft
from tests.pipelines.models.helpers import random_inputs
from tests.support.models import tiny_draft, tiny_draft_config


def logits_of(draft: Eagle3Draft) -> torch.Tensor:
    aux, ids, pos = random_inputs(draft)
    with torch.no_grad():
        return draft.compute_logits(draft(ids, draft.fuse_aux(aux), pos).hidden_BTD)


def test_save_then_load_reproduces_the_draft(tmp_path):
    draft = tiny_draft(sliding_window=8)
    save_draft(draft, tmp_path / "ckpt" / "draft")
    assert (
        json.loads((tmp_path / "ckpt" / "draft" / "config.json").read_text())["sliding_window"] == 8
    )
    for path in (tmp_path / "ckpt", tmp_path / "ckpt" / "draft"):  # CHECKPOINT or CHECKPOINT/draft
        loaded = load_draft(path)
        assert loaded.config == draft.config
        torch.testing.assert_close(logits_of(loaded), logits_of(draft), rtol=0, atol=0)
        assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)
    bf16 = load_draft(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert bf16.fc.weight.dtype == torch.bfloat16 and bf16.d2t.dtype == torch.int64


def test_load_refuses_a_directory_without_a_draft(tmp_path):
    with pytest.raises(DraftCheckpointError, match="no draft found"):
        load_draft(tmp_path)


def test_load_names_a_wrong_shape(tmp_path):
    save_draft(tiny_draft(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 32
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        DraftCheckpointError,
        match=r"tensor midlayer.mlp.down_proj.weight has shape \(64, 96\), the draft expects \(64, 32\); midlayer.mlp.gate_proj.weight",
    ):
        load_draft(tmp_path)


def test_init_from_copies_weights_and_vocab_but_keeps_embeddings(tmp_path):
    pretrained = tiny_draft(seed=1)
    save_draft(pretrained, tmp_path / "pre")
    draft = tiny_draft(seed=2)
    embed_before = draft.embed_tokens.weight.clone()
    loaded = init_from_pretrained(draft, tmp_path / "pre")
    assert "fc.weight" in loaded and "embed_tokens.weight" not in loaded
    assert torch.equal(draft.embed_tokens.weight, embed_before)
    assert torch.equal(draft.lm_head.weight, pretrained.lm_head.weight)
    assert torch.equal(draft.d2t, pretrained.d2t) and torch.equal(draft.t2d, pretrained.t2d)


def test_init_from_accepts_prefixed_names_and_rebuilds_t2d(tmp_path):
    """Third-party EAGLE-3 checkpoints: ``model.``/``layers.0.`` names, no t2d, no embeddings."""
    pretrained = tiny_draft(seed=1)
    tensors = {}
    for name, tensor in pretrained.state_dict().items():
        if name in ("t2d", "embed_tokens.weight"):
            continue
        tensors["model." + name.replace("midlayer.", "layers.0.")] = tensor
    save_file(tensors, str(tmp_path / "third_party.safetensors"))
    draft = tiny_draft(seed=2)
    init_from_pretrained(draft, tmp_path / "third_party.safetensors")
    assert torch.equal(
        draft.midlayer.self_attn.k_proj.weight, pretrained.midlayer.self_attn.k_proj.weight
    )
    assert torch.equal(draft.t2d, pretrained.t2d)


def test_init_from_is_strict_about_shapes_and_names(tmp_path):
    save_draft(tiny_draft(aux_layer_ids=[1, 2]), tmp_path / "two_aux")
    with pytest.raises(
        DraftCheckpointError,
        match=r"tensor fc.weight has shape \(64, 128\), the draft expects \(64, 192\)",
    ):
        init_from_pretrained(tiny_draft(), tmp_path / "two_aux")
    save_draft(tiny_draft(), tmp_path / "extra")
    tensors = load_file(str(tmp_path / "extra" / "model.safetensors"))
    tensors["midlayer.self_attn.q_norm.weight"] = torch.ones(16)
    del tensors["norm.weight"]
    save_file(tensors, str(tmp_path / "extra" / "model.safetensors"))
    with pytest.raises(
        DraftCheckpointError, match=r"unexpected tensors \['midlayer.self_attn.q_norm.weight'\]"
    ):
        init_from_pretrained(tiny_draft(), tmp_path / "extra")
    with pytest.raises(DraftCheckpointError, match="does not exist"):
        init_from_pretrained(tiny_draft(), tmp_path / "nowhere")


def test_config_carries_candidate_fields(tmp_path):
    draft = Eagle3Draft(tiny_draft_config(candidate_rank=8, num_candidates=16))
    save_draft(draft, tmp_path)
    loaded = load_draft(tmp_path)
    assert loaded.candidate_head is not None
    assert torch.equal(loaded.candidate_head.up_proj.weight, draft.candidate_head.up_proj.weight)


def test_a_windowed_config_saved_before_window_mode_keeps_its_trained_window(tmp_path):
    """Drafts saved before window_mode existed were trained with the window measured from the
    drafted position; they load as window_mode=position, new ones keep what they say."""
    save_draft(tiny_draft(sliding_window=8), tmp_path / "old")
    raw = json.loads((tmp_path / "old" / "config.json").read_text())
    assert raw.pop("window_mode") == "context"
    (tmp_path / "old" / "config.json").write_text(json.dumps(raw))
    assert load_draft(tmp_path / "old").config.window_mode == "position"
    save_draft(tiny_draft(sliding_window=8, window_mode="context"), tmp_path / "new")
    assert load_draft(tmp_path / "new").config.window_mode == "context"


def test_an_eagle31_draft_round_trips(tmp_path):
    draft = tiny_draft(fc_norm=True, norm_output=True)
    with torch.no_grad():
        for norm in draft.fc_norm:
            norm.weight.uniform_(0.5, 1.5)
    save_draft(draft, tmp_path / "draft")
    reloaded = load_draft(tmp_path / "draft")
    assert reloaded.config == draft.config
    torch.testing.assert_close(logits_of(reloaded), logits_of(draft), rtol=0, atol=0)
    # fc_norm changes the logits (the per-layer norms are applied); norm_output leaves one step's
    # logits alone (the norm is applied once either way) and changes the fed-back hidden.
    without_fc_norm = Eagle3Draft(draft.config.model_copy(update={"fc_norm": False}))
    without_fc_norm.load_state_dict(draft.state_dict(), strict=False)
    assert not torch.allclose(logits_of(without_fc_norm), logits_of(draft))
    without_norm_output = Eagle3Draft(draft.config.model_copy(update={"norm_output": False}))
    without_norm_output.load_state_dict(draft.state_dict())
    torch.testing.assert_close(logits_of(without_norm_output), logits_of(draft))
    aux, ids, pos = random_inputs(draft)
    with torch.no_grad():
        hidden = draft(ids, draft.fuse_aux(aux), pos).hidden_BTD
        pre_norm = without_norm_output(ids, draft.fuse_aux(aux), pos).hidden_BTD
    torch.testing.assert_close(hidden, draft.norm(pre_norm))
