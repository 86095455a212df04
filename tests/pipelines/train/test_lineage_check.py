"""The trainer refuses a store whose lineage does not match the target or the recipe."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import hsstore
from hsstore.errors import LineageMismatchError
from pipelines.train.lineage_check import check_lineage, choose_teacher
from pipelines.train.teacher_mode import TeacherMode
from tests.support.models import tiny_qwen3
from tests.support.paths import REFERENCE_TARGET
from tests.support.stores import reference_lineage


def write_store(url: Path, lineage: hsstore.Lineage, num_aux: int = 3, hidden: int = 384) -> hsstore.Store:
    """A two-sample store with random features of the right shapes and the given lineage."""
    specs = [
        hsstore.FeatureSpec(name="aux_hidden_states", shape=(num_aux, hidden)),
        hsstore.FeatureSpec(name="final_hidden_state", shape=(hidden,)),
    ]
    rng = np.random.default_rng(0)
    with hsstore.StoreWriter(str(url), specs, lineage) as writer:
        for i in range(2):
            writer.add_sample(
                sample_id=f"s{i}", source_id=f"r{i}", input_ids=np.arange(8), loss_mask=np.ones(8),
                features={
                    "aux_hidden_states": rng.standard_normal((8, num_aux, hidden)).astype(np.float32),
                    "final_hidden_state": rng.standard_normal((8, hidden)).astype(np.float32),
                },
            )
    return hsstore.open_store(str(url))


@pytest.fixture(scope="module")
def good_lineage() -> hsstore.Lineage:
    return reference_lineage(REFERENCE_TARGET, [2, 4, 5], 256)


def linked_copy(tmp_path: Path) -> Path:
    """The reference target with its files symlinked (cheap), so one file can be replaced."""
    target = tmp_path / "target"
    target.mkdir(parents=True)
    for item in REFERENCE_TARGET.iterdir():
        os.symlink(item, target / item.name)
    return target


def test_matching_store_passes(tmp_path: Path, good_lineage: hsstore.Lineage) -> None:
    store = write_store(tmp_path / "store", good_lineage)
    checked = check_lineage(store, REFERENCE_TARGET, expect_aux_layer_ids=[2, 4, 5], draft_aux_layer_ids=[2, 4, 5])
    assert checked["aux_layer_ids"] == [2, 4, 5] and checked["weights_checked"]
    assert choose_teacher(store, "auto") is TeacherMode.FINAL_HIDDEN
    assert choose_teacher(store, TeacherMode.FINAL_HIDDEN) is TeacherMode.FINAL_HIDDEN
    with pytest.raises(LineageMismatchError, match=r"teacher 'topk' needs feature\(s\) \['topk_logits', 'topk_ids'\]"):
        choose_teacher(store, TeacherMode.TOPK)
    # The data's own labels need no stored feature; `auto` never falls back to them.
    assert choose_teacher(store, "tokens") is TeacherMode.TOKENS


def test_other_aux_layers_are_refused(tmp_path: Path, good_lineage: hsstore.Lineage) -> None:
    other = good_lineage.model_copy(update={"aux_layer_ids": [1, 3, 6]})
    store = write_store(tmp_path / "store", other)
    with pytest.raises(
        LineageMismatchError,
        match=r"lineage field 'aux_layer_ids' is \[1, 3, 6\] in the store but \[2, 4, 5\] for the recipe",
    ):
        check_lineage(store, REFERENCE_TARGET, expect_aux_layer_ids=[2, 4, 5])
    with pytest.raises(LineageMismatchError, match=r"\[2, 4, 5\] for the draft being continued"):
        check_lineage(store, REFERENCE_TARGET, draft_aux_layer_ids=[2, 4, 5])
    # Features whose shape disagrees with the lineage's layer count are refused too.
    two_layers = write_store(tmp_path / "store2", good_lineage, num_aux=2)
    with pytest.raises(LineageMismatchError, match=r"'features.aux_hidden_states.shape' is \(2, 384\)"):
        check_lineage(two_layers, REFERENCE_TARGET)


def test_another_target_is_refused(tmp_path: Path, good_lineage: hsstore.Lineage) -> None:
    import json

    other_dir = tmp_path / "other-target"
    tiny_qwen3(vocab_size=8192, num_attention_heads=2, num_key_value_heads=1, head_dim=16).save_pretrained(other_dir)
    store = write_store(tmp_path / "store", good_lineage)
    with pytest.raises(
        LineageMismatchError, match=r"'target.num_hidden_layers' is 8 in the store but 2 .*extracted from another model"
    ):
        check_lineage(store, other_dir)
    # Same shapes, another config (here rope_theta): the config hash tells.
    reconfigured = linked_copy(tmp_path / "reconfigured")
    raw = json.loads((REFERENCE_TARGET / "config.json").read_text())
    raw["rope_theta"] = raw["rope_parameters"]["rope_theta"] = 1e6
    (reconfigured / "config.json").unlink()
    (reconfigured / "config.json").write_text(json.dumps(raw))
    with pytest.raises(LineageMismatchError, match=r"'target.config_sha256' is '68aecb"):
        check_lineage(store, reconfigured)
    # Same config, other weights: only the weight hashes tell.
    retrained = linked_copy(tmp_path)
    shard = "model-00002-of-00003.safetensors"
    (retrained / shard).unlink()
    data = bytearray((REFERENCE_TARGET / shard).read_bytes())
    data[-1] ^= 0xFF
    (retrained / shard).write_bytes(bytes(data))
    with pytest.raises(LineageMismatchError, match=rf"'target.weights_sha256\[{shard}\]'.*weights differ"):
        check_lineage(store, retrained)
    check_lineage(store, retrained, hash_weights=False)  # an explicit opt-out skips that check only


def test_another_template_is_refused(tmp_path: Path, good_lineage: hsstore.Lineage) -> None:
    target = linked_copy(tmp_path)
    template = (REFERENCE_TARGET / "chat_template.jinja").read_text()
    (target / "chat_template.jinja").unlink()
    (target / "chat_template.jinja").write_text(template.replace("<|im_start|>", "<|im_begin|>", 1))
    store = write_store(tmp_path / "store", good_lineage)
    with pytest.raises(LineageMismatchError, match=r"'chat_template_sha256' .* for the chat template in .*another template"):
        check_lineage(store, target)


def test_store_without_target_identity_is_refused(tmp_path: Path, good_lineage: hsstore.Lineage) -> None:
    store = write_store(tmp_path / "store", good_lineage.model_copy(update={"target": None}))
    with pytest.raises(LineageMismatchError, match=r"lineage field 'target' is empty"):
        check_lineage(store, REFERENCE_TARGET)


def test_trainer_refuses_before_step_one(tmp_path: Path, good_lineage: hsstore.Lineage) -> None:
    from pipelines.train import TrainRecipe, run_training

    other = good_lineage.model_copy(update={"aux_layer_ids": [1, 3, 6]})
    write_store(tmp_path / "store", other)
    recipe = TrainRecipe(
        store=str(tmp_path / "store"), target=str(REFERENCE_TARGET), output_dir=str(tmp_path / "out"),
        expect_aux_layer_ids=[2, 4, 5], device="cpu",
    )
    with pytest.raises(LineageMismatchError, match="aux_layer_ids"):
        run_training(recipe)
    assert not (tmp_path / "out" / "checkpoints").exists()
