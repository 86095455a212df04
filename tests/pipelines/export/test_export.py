"""Export: the serving layout's keys, shapes and dtypes, and the round trip to identical logits."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from pipelines.cli import main as hsstore_main
from pipelines.export.serving import ExportError, export_draft
from pipelines.models.checkpoint import DraftCheckpointError, load_draft, save_draft
from pipelines.train.candidate import attach_candidate_head
from tests.pipelines.models.helpers import random_inputs
from tests.support.models import tiny_draft

H, V, V_DRAFT, HEADS, KV_HEADS, HEAD_DIM, MLP = 64, 256, 96, 4, 2, 16, 96

# docs/design.md's table: exported name -> (shape, dtype) for the tiny draft.
EAGLE3_LAYOUT = {
    "fc.weight": ((H, 3 * H), torch.bfloat16),
    "midlayer.self_attn.q_proj.weight": ((HEADS * HEAD_DIM, 2 * H), torch.bfloat16),
    "midlayer.self_attn.k_proj.weight": ((KV_HEADS * HEAD_DIM, 2 * H), torch.bfloat16),
    "midlayer.self_attn.v_proj.weight": ((KV_HEADS * HEAD_DIM, 2 * H), torch.bfloat16),
    "midlayer.self_attn.o_proj.weight": ((H, HEADS * HEAD_DIM), torch.bfloat16),
    "midlayer.mlp.gate_proj.weight": ((MLP, H), torch.bfloat16),
    "midlayer.mlp.up_proj.weight": ((MLP, H), torch.bfloat16),
    "midlayer.mlp.down_proj.weight": ((H, MLP), torch.bfloat16),
    "midlayer.input_layernorm.weight": ((H,), torch.bfloat16),
    "midlayer.hidden_norm.weight": ((H,), torch.bfloat16),
    "midlayer.post_attention_layernorm.weight": ((H,), torch.bfloat16),
    "norm.weight": ((H,), torch.bfloat16),
    "lm_head.weight": ((V_DRAFT, H), torch.bfloat16),
    "d2t": ((V_DRAFT,), torch.int64),
    "t2d": ((V,), torch.bool),
}
RANK = 8
# eagle-harness's LlamaForCausalLMEagle4: a full vocabulary, no vocabulary maps.
EAGLE4_LAYOUT = {
    **{k: v for k, v in EAGLE3_LAYOUT.items() if k not in ("d2t", "t2d")},
    "lm_head.weight": ((V, H), torch.bfloat16),
    "efficient_lm_head.weight": ((V, RANK), torch.bfloat16),
    "efficient_lm_head_down_proj.weight": ((RANK, H), torch.bfloat16),
}


def exported_tensors(out_dir):
    with safe_open(str(out_dir / "model.safetensors"), framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118


def logits(draft, candidate=False):
    aux, ids, pos = random_inputs(draft)
    with torch.no_grad():
        hidden = draft(ids, draft.fuse_aux(aux), pos).hidden_BTD
        return draft.compute_candidate_logits(hidden) if candidate else draft.compute_logits(hidden)


def test_eagle3_layout_and_round_trip(tmp_path):
    draft = tiny_draft()
    save_draft(draft, tmp_path / "ckpt" / "draft")
    out = export_draft(tmp_path / "ckpt", "eagle3", tmp_path / "out")

    tensors = exported_tensors(out)
    assert {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()} == EAGLE3_LAYOUT
    assert torch.equal(tensors["d2t"], draft.d2t) and torch.equal(tensors["t2d"], draft.t2d)

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    ) == (H, HEADS, KV_HEADS)
    assert (config["head_dim"], config["intermediate_size"]) == (HEAD_DIM, MLP)
    assert (config["vocab_size"], config["draft_vocab_size"], config["target_hidden_size"]) == (
        V,
        V_DRAFT,
        H,
    )
    assert config["tie_word_embeddings"] is False and config["norm_before_residual"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM: hidden_states[i]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang adds 1
    assert "sliding_window" not in config and "efficient_lm_head_rank" not in config
    # transformers (what both engines parse configs with) reads it as a one-layer Llama.
    hf = AutoConfig.from_pretrained(out)
    assert (hf.model_type, hf.num_hidden_layers, hf.hidden_size, hf.vocab_size) == (
        "llama",
        1,
        H,
        V,
    )
    assert hf.draft_vocab_size == V_DRAFT

    # Exported weights omit embed_tokens: the target's are passed in, as the engines share them.
    with pytest.raises(DraftCheckpointError, match="pass embed_tokens="):
        load_draft(out)
    reloaded = load_draft(out, embed_tokens=draft.embed_tokens.weight)
    assert reloaded.config == draft.config
    assert reloaded.fc.weight.dtype == torch.bfloat16  # loaded as stored
    torch.testing.assert_close(logits(reloaded), logits(draft.to(torch.bfloat16)), rtol=0, atol=0)


def test_float32_export_gives_identical_logits(tmp_path):
    draft = tiny_draft(seed=3)
    save_draft(draft, tmp_path / "draft")
    out = export_draft(tmp_path / "draft", "eagle3", tmp_path / "out", dtype="float32")
    reloaded = load_draft(out, embed_tokens=draft.embed_tokens.weight)
    torch.testing.assert_close(logits(reloaded), logits(draft), rtol=0, atol=0)


def eagle4_draft(**overrides):
    """A full-vocabulary draft with a candidate head, as the harness serves."""
    draft = tiny_draft(draft_vocab_size=V, **overrides)
    attach_candidate_head(draft, rank=RANK, num_candidates=12)
    return draft


def test_eagle4_layout_and_round_trip(tmp_path):
    draft = eagle4_draft(sliding_window=8, fc_norm=True, norm_output=True)
    save_draft(draft, tmp_path / "ckpt" / "draft")
    out = export_draft(tmp_path / "ckpt", "eagle4", tmp_path / "out")
    tensors = exported_tensors(out)
    layout = {
        **EAGLE4_LAYOUT,
        **{f"fc_norm.{k}.weight": ((H,), torch.bfloat16) for k in range(3)},
    }
    assert {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()} == layout
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle4"]
    assert config["efficient_lm_head_config"] == {"type": "low_rank", "rank": RANK, "num_candidates": 12}
    assert config["draft_vocab_size"] == config["vocab_size"] == V
    assert config["sliding_window"] == 8 and config["layer_types"] == ["sliding_attention"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert (config["fc_norm"], config["norm_output"], config["num_aux_hidden_states"]) == (True, True, 3)
    # Only the harness's whitelist: no project metadata, no top-level ids, no old head keys.
    for key in ("hsstore_draft_config", "eagle_aux_hidden_state_layer_ids", "norm_before_residual",
                "efficient_lm_head_rank", "num_candidates", "rope_theta", "rope_scaling"):
        assert key not in config
    reloaded = load_draft(out, embed_tokens=draft.embed_tokens.weight)
    assert reloaded.config == draft.config  # window_mode context, the norms and the head included
    bf16 = draft.to(torch.bfloat16)
    torch.testing.assert_close(logits(reloaded), logits(bf16), rtol=0, atol=0)
    torch.testing.assert_close(
        logits(reloaded, candidate=True), logits(bf16, candidate=True), rtol=0, atol=0
    )
    # The same checkpoint exported as eagle3 drops the candidate head (and needs --eagle31-keys).
    e3 = export_draft(tmp_path / "ckpt", "eagle3", tmp_path / "e3", eagle31_keys=True)
    assert "efficient_lm_head.weight" not in exported_tensors(e3)


def test_eagle4_refuses_what_the_harness_would_serve_differently(tmp_path):
    save_draft(eagle4_draft(sliding_window=8, window_mode="position"), tmp_path / "position")
    with pytest.raises(ExportError, match="window_mode=position .* Retrain with draft.window_mode=context"):
        export_draft(tmp_path / "position", "eagle4", tmp_path / "out")
    reduced = tiny_draft()
    attach_candidate_head(reduced, rank=RANK, num_candidates=12)
    save_draft(reduced, tmp_path / "reduced")
    with pytest.raises(ExportError, match=r"vocabulary is reduced \(96 of 256.*draft.vocab.full=true.*--expand-vocab"):
        export_draft(tmp_path / "reduced", "eagle4", tmp_path / "out")


def test_eagle4_expand_vocab_keeps_the_drafts_logits_on_its_own_ids(tmp_path):
    draft = tiny_draft()
    attach_candidate_head(draft, rank=RANK, num_candidates=12)
    save_draft(draft, tmp_path / "reduced")
    out = export_draft(tmp_path / "reduced", "eagle4", tmp_path / "out", dtype="float32", expand_vocab=True)
    tensors = exported_tensors(out)
    assert tuple(tensors["lm_head.weight"].shape) == (V, H) and "d2t" not in tensors
    full = load_draft(out, embed_tokens=draft.embed_tokens.weight)
    assert full.config.draft_vocab_size == V
    target_ids = torch.arange(V_DRAFT) + draft.d2t
    outside = torch.ones(V, dtype=torch.bool)
    outside[target_ids] = False
    for candidate in (False, True):
        got, want = logits(full, candidate), logits(draft, candidate)
        torch.testing.assert_close(got[..., target_ids], want, rtol=0, atol=0)
        assert (got[..., outside] == 0).all()  # the rows expansion adds score 0


def test_eagle3_refuses_an_eagle31_draft_unless_asked(tmp_path):
    draft = tiny_draft(fc_norm=True, norm_output=True)
    save_draft(draft, tmp_path / "draft")
    with pytest.raises(ExportError, match="SGLang's LlamaForCausalLMEagle3 would drop both silently.*--format speculators"):
        export_draft(tmp_path / "draft", "eagle3", tmp_path / "out")
    out = export_draft(tmp_path / "draft", "eagle3", tmp_path / "out", dtype="float32", eagle31_keys=True)
    config = json.loads((out / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"]) == (True, True)
    tensors = exported_tensors(out)
    assert all(tuple(tensors[f"fc_norm.{k}.weight"].shape) == (H,) for k in range(3))
    # A third-party reader without our metadata rebuilds the EAGLE-3.1 draft from the keys.
    del config["hsstore_draft_config"]
    (out / "config.json").write_text(json.dumps(config))
    reloaded = load_draft(out, embed_tokens=draft.embed_tokens.weight)
    assert reloaded.config.fc_norm and reloaded.config.norm_output
    torch.testing.assert_close(logits(reloaded), logits(draft), rtol=0, atol=0)


def test_third_party_config_without_our_metadata_loads(tmp_path):
    draft = tiny_draft()
    save_draft(draft, tmp_path / "draft")
    out = export_draft(tmp_path / "draft", "eagle3", tmp_path / "out", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    del (
        config["hsstore_draft_config"],
        config["eagle_aux_hidden_state_layer_ids"],
    )  # SGLang-only ids left
    (out / "config.json").write_text(json.dumps(config))
    reloaded = load_draft(out, embed_tokens=draft.embed_tokens.weight)
    assert reloaded.config.aux_layer_ids == [2, 4, 5]
    torch.testing.assert_close(logits(reloaded), logits(draft), rtol=0, atol=0)


def test_export_refusals(tmp_path):
    save_draft(tiny_draft(), tmp_path / "draft")
    with pytest.raises(ExportError, match="cannot export as eagle4: it has no candidate head"):
        export_draft(tmp_path / "draft", "eagle4", tmp_path / "out")
    with pytest.raises(ExportError, match="unknown export format 'medusa'"):
        export_draft(tmp_path / "draft", "medusa", tmp_path / "out")
    save_draft(tiny_draft(aux_layer_ids=[1, 2]), tmp_path / "two_aux")
    with pytest.raises(
        ExportError, match=r"fuses exactly 3 aux layers, this draft uses 2 \(\[1, 2\]\)"
    ):
        export_draft(tmp_path / "two_aux", "eagle3", tmp_path / "out")
    export_draft(tmp_path / "draft", "eagle3", tmp_path / "out")
    with pytest.raises(ExportError, match="exists and is not empty"):
        export_draft(tmp_path / "draft", "eagle3", tmp_path / "out")
    assert export_draft(tmp_path / "draft", "eagle3", tmp_path / "out", overwrite=True).is_dir()
    assert (
        sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    )  # no staging left


def test_cli_export(tmp_path, capsys):
    save_draft(tiny_draft(), tmp_path / "ckpt" / "draft")
    code = hsstore_main(
        ["export", str(tmp_path / "ckpt"), "--format", "eagle3", "--out", str(tmp_path / "out")]
    )
    assert code == 0
    assert f"exported eagle3 draft to {tmp_path / 'out'}" in capsys.readouterr().out
    assert (tmp_path / "out" / "model.safetensors").is_file()
    code = hsstore_main(
        ["export", str(tmp_path / "missing"), "--format", "eagle3", "--out", str(tmp_path / "o2")]
    )
    assert code == 1
    assert "no draft found" in capsys.readouterr().err


def _training_run(root, draft, *, final=True):
    """A run folder laid out by the trainer's own checkpoint writer."""
    from pipelines.train.checkpoint import FINAL_NAME, save_checkpoint

    optimizer = torch.optim.SGD([p for p in draft.parameters() if p.requires_grad], lr=0.1)
    save_checkpoint(root / "checkpoints", "step_000002", draft, optimizer, {"step": 2})
    if final:
        save_checkpoint(root / "checkpoints", FINAL_NAME, draft, optimizer, {"step": 4})
    return root


def test_cli_export_accepts_the_training_run_folder(tmp_path, capsys):
    """`hsstore export runs/X --format eagle3 --out DIR`, as the README has a user type it."""
    draft = tiny_draft()
    run = _training_run(tmp_path / "runs" / "reference-eagle3", draft)
    code = hsstore_main(["export", str(run), "--format", "eagle3", "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    reloaded = load_draft(tmp_path / "out", embed_tokens=draft.embed_tokens.weight)
    assert reloaded.config == draft.config
    torch.testing.assert_close(logits(reloaded).float(), logits(draft.to(torch.bfloat16)).float())

    unfinished = _training_run(tmp_path / "runs" / "interrupted", tiny_draft(), final=False)
    code = hsstore_main(["export", str(unfinished), "--out", str(tmp_path / "o2")])
    assert code == 1
    assert "did not finish" in (err := capsys.readouterr().err) and "step_000002" in err


def test_export_is_readable_by_other_users(tmp_path):
    """A serving engine running as another user must read the export, whatever the umask."""
    save_draft(tiny_draft(), tmp_path / "ckpt" / "draft")
    previous = os.umask(0o077)
    try:
        out = export_draft(tmp_path / "ckpt", "eagle3", tmp_path / "out")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    for name in ("config.json", "model.safetensors"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o644


def test_export_can_include_embed_tokens_for_speculators(tmp_path, capsys):
    draft = tiny_draft()
    save_draft(draft, tmp_path / "ckpt" / "draft")
    code = hsstore_main(
        ["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--include-embed-tokens"]
    )
    assert code == 0, capsys.readouterr().err
    tensors = exported_tensors(tmp_path / "out")
    layout = {**EAGLE3_LAYOUT, "embed_tokens.weight": ((V, H), torch.bfloat16)}
    assert {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()} == layout
    assert torch.equal(tensors["embed_tokens.weight"], draft.embed_tokens.weight.to(torch.bfloat16))
    reloaded = load_draft(tmp_path / "out")  # no target embedding needed now
    assert torch.equal(reloaded.embed_tokens.weight, tensors["embed_tokens.weight"])
    assert "embed_tokens.weight" not in exported_tensors(export_draft(tmp_path / "ckpt", "eagle3", tmp_path / "plain"))
