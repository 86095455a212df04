"""``--format speculators`` against speculators 0.9.0 itself: its own ``Eagle3DraftModel`` loads the
export (config, aux layer ids, embedding, EAGLE-3.1 norms) and its TTT forward gives hsstore's
logits, on a non-default aux layer set.

speculators is a peer's package, not a dependency: install it with
``pip install --no-deps speculators==0.9.0`` plus the extra ``hsstore[peers]`` (its import-time
dependencies without vLLM or a CUDA torch); these tests skip when it is not importable.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from pipelines.export.serving import ExportError, export_draft
from pipelines.models.checkpoint import load_draft, save_draft
from pipelines.models.eagle3 import Eagle3Config, Eagle3Draft
from pipelines.train.ttt import shift_left, ttt_unroll
from tests.support.models import build_draft
from tests.support.paths import REFERENCE_TARGET

AUX_IDS = [1, 4, 6]  # speculators' default for the 8-layer reference target is [2, 4, 5]
TTT_STEPS = 3


def speculators_model_class():
    pytest.importorskip(
        "speculators",
        reason="speculators 0.9.0 is not installed (pip install --no-deps speculators==0.9.0 "
        "and hsstore[peers])",
    )
    from speculators import Eagle3DraftModel

    return Eagle3DraftModel


def reference_draft(seed: int = 0, **overrides) -> Eagle3Draft:
    """A random draft shaped for the reference target (speculators checks its width against the
    verifier's), with non-unit norms so that a dropped or swapped norm shows."""
    config = Eagle3Config.from_target_config(
        AutoConfig.from_pretrained(REFERENCE_TARGET),
        aux_layer_ids=AUX_IDS,
        draft_vocab_size=2000,
        **overrides,
    )
    return build_draft(config, seed)


def speculators_logits(model, aux_BTKH, ids_BT, pos_BT, docs_BT) -> list[torch.Tensor]:
    """speculators' own TTT forward, its lm_head outputs captured per step (it returns tokens).

    Its step 0 reads ``input_ids`` as given and shifts them by one per step; ours reads token
    t+1+d at depth d, so it is handed the ids shifted by one."""
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    try:
        with torch.no_grad():
            model(
                hidden_states=aux_BTKH.flatten(-2),
                input_ids=shift_left(ids_BT, 1),
                document_ids=docs_BT,
                position_ids=pos_BT,
                ttt_steps=TTT_STEPS,
            )
    finally:
        hook.remove()
    return captured


def assert_forward_equals_speculators(draft: Eagle3Draft, model, *, top1: bool = False) -> None:
    """speculators' forward of ``model`` equals ``draft``'s TTT unroll on packed inputs, depth by
    depth, to 1e-5 in the logits (and the same argmax everywhere with ``top1``)."""
    aux, ids, pos, docs = packed_inputs(draft.config)
    theirs = speculators_logits(model, aux, ids, pos, docs)
    with torch.no_grad():
        ours = ttt_unroll(draft, aux, ids, pos, docs, ttt_length=TTT_STEPS, attention="eager")
        for depth in range(TTT_STEPS):
            logits = draft.compute_logits(ours[depth])
            diff = (logits - theirs[depth]).abs().max().item()
            assert diff <= 1e-5, f"depth {depth}: max |logit difference| {diff:.2e}"
            if top1:
                assert torch.equal(logits.argmax(-1), theirs[depth].argmax(-1))


def packed_inputs(config: Eagle3Config, doc_lengths=(70, 58), seed: int = 1):
    """One packed row of two documents (positions restart), 128 tokens: speculators' flex mask
    is built in 128-token blocks."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(doc_lengths)
    docs = torch.cat([torch.full((n,), d) for d, n in enumerate(doc_lengths)])[None]
    pos = torch.cat([torch.arange(n) for n in doc_lengths])[None]
    aux = torch.randn(1, T, 3, config.target_hidden_size, generator=gen)
    ids = torch.randint(0, config.vocab_size, (1, T), generator=gen)
    return aux, ids, pos, docs


@pytest.mark.parametrize(
    "options", [{}, {"fc_norm": True, "norm_output": True}], ids=["eagle3", "eagle3.1"]
)
def test_speculators_loads_the_export_and_its_forward_equals_ours(tmp_path: Path, options) -> None:
    model_class = speculators_model_class()
    draft = reference_draft(**options)
    save_draft(draft, tmp_path / "draft")
    out = export_draft(
        tmp_path / "draft", "speculators", tmp_path / "out", dtype="float32",
        verifier=str(REFERENCE_TARGET),
    )
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX_IDS
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(REFERENCE_TARGET.resolve())

    model = model_class.from_pretrained(str(out)).eval()
    assert model.config.eagle_aux_hidden_state_layer_ids == AUX_IDS  # not speculators' default
    assert (model.fc_norm is not None) == draft.config.fc_norm
    assert model.config.norm_output == draft.config.norm_output
    torch.testing.assert_close(model.embed_tokens.weight, draft.embed_tokens.weight, rtol=0, atol=0)
    assert torch.equal(model.d2t, draft.d2t) and torch.equal(model.t2d, draft.t2d)

    assert_forward_equals_speculators(draft, model, top1=True)

    # load_draft reads the speculators export back exactly (the evaluation harness does).
    reloaded = load_draft(out)
    assert reloaded.config == draft.config


def test_speculators_without_a_verifier_is_refused(tmp_path: Path) -> None:
    draft = reference_draft()
    save_draft(draft, tmp_path / "draft")
    with pytest.raises(ExportError, match="needs the target the draft was trained for"):
        export_draft(tmp_path / "draft", "speculators", tmp_path / "out")


def test_cli_exports_speculators_and_warns_what_eagle3_needs(tmp_path: Path, capsys, caplog) -> None:
    from pipelines.cli import main as hsstore_main

    save_draft(reference_draft(), tmp_path / "draft")
    code = hsstore_main([
        "export", str(tmp_path / "draft"), "--format", "speculators", "--verifier",
        str(REFERENCE_TARGET), "--speculative-tokens", "5", "--out", str(tmp_path / "out"),
    ])
    assert code == 0, capsys.readouterr().err
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert config["speculators_model_type"] == "eagle3"
    with caplog.at_level("WARNING"):
        code = hsstore_main(["export", str(tmp_path / "draft"), "--out", str(tmp_path / "e3")])
    assert code == 0
    assert """--algorithm-kwargs '{"eagle_aux_hidden_state_layer_ids": [1, 4, 6]}'""" in caplog.text
