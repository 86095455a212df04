"""The trainer's view of the target (embed, final norm, lm_head) equals the full transformers model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipelines.train.target_heads import TargetWeightsError, load_target_heads
from tests.support.models import tiny_qwen3
from tests.support.paths import REFERENCE_TARGET


@pytest.fixture(scope="module")
def reference_model():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(REFERENCE_TARGET, dtype=torch.float32)
    return model.eval()


def test_reference_heads_match_full_model(reference_model) -> None:
    heads = load_target_heads(REFERENCE_TARGET, dtype=torch.float32)
    assert not heads.tied
    assert heads.tensor_names == {
        "embed_tokens": "model.embed_tokens.weight",
        "norm": "model.norm.weight",
        "lm_head": "lm_head.weight",
    }
    torch.testing.assert_close(heads.embed_tokens_VH, reference_model.model.embed_tokens.weight, rtol=0, atol=0)
    torch.testing.assert_close(heads.lm_head_VH, reference_model.lm_head.weight, rtol=0, atol=0)
    torch.testing.assert_close(
        heads.norm_weight_H.float(), reference_model.model.norm.weight, rtol=0, atol=0
    )

    captured: dict[str, torch.Tensor] = {}
    hook = reference_model.model.norm.register_forward_hook(
        lambda _m, inputs, output: captured.update(pre=inputs[0], post=output)
    )
    input_ids = torch.randint(0, heads.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = reference_model(input_ids=input_ids)
    hook.remove()
    # Logits rebuilt from the post-norm final state equal the model's own logits.
    torch.testing.assert_close(heads.logits(captured["post"]), out.logits, rtol=1e-4, atol=1e-4)
    # The final norm (for stores that captured the pre-norm state) equals the model's norm.
    torch.testing.assert_close(heads.apply_norm(captured["pre"]), captured["post"], rtol=1e-5, atol=1e-5)


def test_stack_shard_is_never_read(tmp_path: Path) -> None:
    """Shard 2 of the reference target holds only decoder layers: deleting it must not matter."""
    target = tmp_path / "target"
    shutil.copytree(REFERENCE_TARGET, target)
    weight_map = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    stack_only = {file for file in weight_map.values()} - {
        weight_map["lm_head.weight"],
        weight_map["model.embed_tokens.weight"],
        weight_map["model.norm.weight"],
    }
    assert stack_only, "the reference target should have a shard holding only decoder layers"
    for file in stack_only:
        (target / file).unlink()
    heads = load_target_heads(target)
    assert heads.vocab_size == 8192 and heads.hidden_size == 384
    assert heads.embed_tokens_VH.dtype == torch.bfloat16


def test_tied_single_file_target(tmp_path: Path) -> None:
    model = tiny_qwen3(vocab_size=96, tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "tied")
    assert (tmp_path / "tied" / "model.safetensors").exists()
    heads = load_target_heads(tmp_path / "tied")
    assert heads.tied
    assert heads.lm_head_VH.data_ptr() == heads.embed_tokens_VH.data_ptr()
    torch.testing.assert_close(heads.lm_head_VH, model.lm_head.weight, rtol=0, atol=0)
    input_ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        out = model(input_ids=input_ids, output_hidden_states=True)
        post = model.model(input_ids=input_ids).last_hidden_state
    torch.testing.assert_close(heads.logits(post), out.logits, rtol=1e-5, atol=1e-5)


def test_missing_weights_are_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 8}))
    with pytest.raises(TargetWeightsError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        load_target_heads(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_target_heads(tmp_path / "absent")
