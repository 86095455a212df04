"""Before step 1: is this store what this training run thinks it is?

A draft trained on features from another target revision, another tokenizer or chat template, other
aux layers or another final-state convention trains fine and then accepts fewer tokens: the
failure is silent. So the trainer recomputes the target's identity from the directory it was given
(with the very functions extraction used, :mod:`pipelines.target_identity`), compares it and the
recipe's expectations with the store's lineage, and refuses the first mismatch with
:class:`LineageMismatchError` naming the field, what the store holds and what was found.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hsstore.aux_layers import (
    AUX_HIDDEN_STATES,
    FINAL_HIDDEN_STATE,
    FINAL_STATE_CONVENTION,
    LAYER_CONVENTION,
    select_aux_layers,
)
from hsstore.errors import LineageMismatchError
from hsstore.store import Store
from pipelines import target_identity as identity
from pipelines.train.teacher_mode import TeacherChoice, TeacherMode


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _mismatch(store: Store, field: str, stored: Any, found: Any, where: str, hint: str = "") -> LineageMismatchError:
    return LineageMismatchError(
        f"{store.url}: lineage field '{field}' is {_short(stored)} in the store but {_short(found)} "
        f"for {where}{'; ' + hint if hint else ''}"
    )


def choose_teacher(store: Store, requested: TeacherChoice) -> TeacherMode:
    """The teacher mode to train with: ``requested``, or with ``auto`` the best distribution of the
    target the store holds (the exact final state first, then top-k, then dense draft
    probabilities; never ``tokens``, the data's own labels, which must be asked for)."""
    present = set(store.features)
    if requested != "auto":
        mode = TeacherMode(requested)
        missing = [name for name in mode.features if name not in present]
        if missing:
            raise LineageMismatchError(
                f"{store.url}: teacher {mode.value!r} needs feature(s) {missing}; the store holds "
                f"{sorted(present)} (lineage target_distribution={store.lineage.target_distribution!r})"
            )
        return mode
    for mode in TeacherMode:  # declared in order of preference
        if mode.from_target and all(name in present for name in mode.features):
            return mode
    raise LineageMismatchError(
        f"{store.url}: holds no target distribution (final_hidden_state, topk_logits/topk_ids or "
        f"draft_probs); found {sorted(present)}. Re-extract with capture.final_hidden_state: true, or "
        "train on the records' own next tokens with teacher: tokens"
    )


def check_lineage(
    store: Store,
    target_dir: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    expect_aux_layer_ids: list[int] | None = None,
    draft_aux_layer_ids: list[int] | None = None,
    hash_weights: bool = True,
    aux_layer_ids: list[int] | None = None,
) -> dict[str, Any]:
    """Refuse (LineageMismatchError) a store that does not match the target, tokenizer and recipe.

    ``draft_aux_layer_ids`` are the aux layers of a draft being continued (``init_from`` or a
    stage-1 checkpoint): its ``fc`` was trained on exactly those layers. Returns what was checked.
    """
    target_dir = Path(target_dir)
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else target_dir
    found = _check_target(store, target_dir, hash_weights)
    _check_tokenizer(store, tokenizer_dir)
    _check_conventions(store)
    aux, chosen = _check_aux_layers(store, target_dir, expect_aux_layer_ids, draft_aux_layer_ids, aux_layer_ids)
    _check_feature_shapes(store)
    return {
        "target": str(target_dir),
        "architecture": found["architecture"],
        "config_sha256": found["config_sha256"],
        "weights_checked": hash_weights,
        "aux_layer_ids": aux,
        "train_aux_layer_ids": chosen,
        "codecs": {name: s.codec for name, s in store.features.items()},
    }


def _check_target(store: Store, target_dir: Path, hash_weights: bool) -> dict[str, Any]:
    """The target's identity (config, and the weights' hashes if ``hash_weights``) as the store
    recorded it; returns the identity recomputed from ``target_dir``."""
    where = f"the target {target_dir}"
    stored_target = store.lineage.target
    if stored_target is None:
        raise LineageMismatchError(
            f"{store.url}: lineage field 'target' is empty: the store does not say which model "
            "produced it, so it cannot be checked against the target; extract it with hsstore extract"
        )
    found = identity.target_identity(target_dir, hash_weights=hash_weights)
    for field in ("architecture", "model_type", "num_hidden_layers", "hidden_size", "vocab_size", "config_sha256"):
        stored, ours = getattr(stored_target, field), found[field]
        if field in ("architecture", "model_type") and not stored:
            continue  # not recorded
        if stored != ours:
            raise _mismatch(store, f"target.{field}", stored, ours, where, "the store was extracted from another model")
    if hash_weights and stored_target.weights_sha256 != found["weight_files"]:
        names = sorted(set(stored_target.weights_sha256) | set(found["weight_files"]))
        differing = [n for n in names if stored_target.weights_sha256.get(n) != found["weight_files"].get(n)]
        raise _mismatch(
            store,
            f"target.weights_sha256[{differing[0]}]",
            stored_target.weights_sha256.get(differing[0]),
            found["weight_files"].get(differing[0]),
            where,
            "the target's weights differ from the ones the store was extracted with",
        )
    return found


def _check_tokenizer(store: Store, tokenizer_dir: Path) -> None:
    """The tokenizer (when the store recorded it) and the chat template the samples were built with."""
    lineage = store.lineage
    if lineage.tokenizer_sha256 is not None:
        ours_tok = identity.tokenizer_sha256(tokenizer_dir)
        if lineage.tokenizer_sha256 != ours_tok:
            raise _mismatch(store, "tokenizer_sha256", lineage.tokenizer_sha256, ours_tok, f"the tokenizer in {tokenizer_dir}")
    ours_template = identity.chat_template_sha256(identity.read_chat_template(tokenizer_dir))
    if lineage.chat_template_sha256 != ours_template:
        raise _mismatch(
            store, "chat_template_sha256", lineage.chat_template_sha256, ours_template,
            f"the chat template in {tokenizer_dir}", "loss masks and prompts were built with another template",
        )


def _check_conventions(store: Store) -> None:
    """Which layer an aux id names, and which final state is stored: this trainer's conventions."""
    lineage = store.lineage
    if lineage.layer_convention != LAYER_CONVENTION:
        raise _mismatch(store, "layer_convention", lineage.layer_convention, LAYER_CONVENTION, "this trainer")
    if lineage.final_state_convention != FINAL_STATE_CONVENTION:
        raise _mismatch(
            store, "final_state_convention", lineage.final_state_convention, FINAL_STATE_CONVENTION, "this trainer"
        )


def _check_aux_layers(
    store: Store,
    target_dir: Path,
    expect_aux_layer_ids: list[int] | None,
    draft_aux_layer_ids: list[int] | None,
    aux_layer_ids: list[int] | None,
) -> tuple[list[int], list[int]]:
    """``(captured, chosen)``: the store's aux layers (valid, as the recipe expects) and the subset
    this run trains on (the same a continued draft's fc was trained on)."""
    aux = list(store.lineage.aux_layer_ids)
    if not aux:
        raise LineageMismatchError(f"{store.url}: lineage field 'aux_layer_ids' is empty; a draft needs aux states")
    assert store.lineage.target is not None  # _check_target ran first
    num_layers = store.lineage.target.num_hidden_layers
    if any(not 0 <= i <= num_layers for i in aux):
        raise _mismatch(store, "aux_layer_ids", aux, f"ids within [0, {num_layers}]", f"the target {target_dir}")
    if expect_aux_layer_ids is not None and aux != list(expect_aux_layer_ids):
        raise _mismatch(store, "aux_layer_ids", aux, list(expect_aux_layer_ids), "the recipe (expect_aux_layer_ids)")
    # The layers this run trains on: the recipe's aux_layer_ids, a subset of the captured ones.
    chosen = [aux[i] for i in select_aux_layers(aux, aux_layer_ids, what="the recipe's aux_layer_ids")]
    if draft_aux_layer_ids is not None and chosen != list(draft_aux_layer_ids):
        raise _mismatch(
            store, "aux_layer_ids", chosen, list(draft_aux_layer_ids), "the draft being continued",
            "its fc was trained on other layers",
        )
    return aux, chosen


def _check_feature_shapes(store: Store) -> None:
    """The aux and final states have the shapes the lineage's layers and hidden size imply."""
    assert store.lineage.target is not None  # _check_target ran first
    hidden_size = store.lineage.target.hidden_size
    features = store.features
    spec = features.get(AUX_HIDDEN_STATES)
    expected_shape = (len(store.lineage.aux_layer_ids), hidden_size)
    if spec is None or tuple(spec.shape) != expected_shape:
        raise _mismatch(
            store, f"features.{AUX_HIDDEN_STATES}.shape", None if spec is None else tuple(spec.shape),
            expected_shape, "the lineage's aux_layer_ids and hidden size",
        )
    final = features.get(FINAL_HIDDEN_STATE)
    if final is not None and tuple(final.shape) != (hidden_size,):
        raise _mismatch(
            store, f"features.{FINAL_HIDDEN_STATE}.shape", tuple(final.shape), (hidden_size,),
            "the target's hidden size",
        )
