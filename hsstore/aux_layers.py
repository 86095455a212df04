"""The aux-layer contract: which of the target's states a store holds, under which names.

Extraction, training, evaluation and export all import this module, so the ids they accept, the
defaults they pick and the feature names they read are the same by construction (docs/design.md,
"Layer convention"):

- aux layer id ``i`` is the hidden state entering decoder layer ``i``: transformers'
  ``hidden_states[i]`` with ``output_hidden_states=True``, 0 being the embeddings. Ids run from 0 to
  ``L`` (the number of decoder layers) inclusive; ``L`` is the post-norm output of the last layer,
  which is what transformers puts at ``hidden_states[L]`` and what the lm_head multiplies;
- the default ids are vLLM's and SGLang's ``[2, L//2, L-3]``, clamped into ``[0, L]`` and
  de-duplicated for shallow models;
- the feature names below are what extraction writes and training, evaluation and inspection read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from hsstore.errors import AuxLayerError

# aux layer id i is transformers' hidden_states[i] with output_hidden_states=True (0 = embeddings).
LAYER_CONVENTION: Literal["hf_hidden_states_index"] = "hf_hidden_states_index"
# The final state is the post-norm output of the last layer: what lm_head multiplies.
FINAL_STATE_CONVENTION: Literal["post_norm"] = "post_norm"

# Feature names. Other names are allowed in a store (it is a general container); these are the ones
# the pipelines agree on.
AUX_HIDDEN_STATES = "aux_hidden_states"  # [T, num_aux_layers, H], in aux_layer_ids order
FINAL_HIDDEN_STATE = "final_hidden_state"  # [T, H], post-norm
TOPK_LOGITS = "topk_logits"  # [T, k]
TOPK_IDS = "topk_ids"  # [T, k]
DRAFT_PROBS = "draft_probs"  # [T, V_draft]

# The features that carry the target's distribution, per Lineage.target_distribution (the
# trainer's teacher modes).
TEACHER_FEATURES: dict[str, tuple[str, ...]] = {
    "final_hidden": (FINAL_HIDDEN_STATE,),
    "topk": (TOPK_LOGITS, TOPK_IDS),
    "draft_probs": (DRAFT_PROBS,),
}


def default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's default aux layers ``[2, L//2, L-3]`` (vLLM, SGLang), clamped into ``[0, L]`` and
    de-duplicated (sorted) so that shallow test models still get valid ids."""
    if num_hidden_layers < 1:
        raise AuxLayerError(f"num_hidden_layers must be >= 1, got {num_hidden_layers}")
    ids = [2, num_hidden_layers // 2, num_hidden_layers - 3]
    return sorted({min(max(i, 0), num_hidden_layers) for i in ids})


def check_aux_layer_ids(aux_layer_ids: Sequence[int], num_hidden_layers: int, *, what: str = "aux_layer_ids") -> list[int]:
    """``aux_layer_ids`` as a list if every id is in ``[0, num_hidden_layers]``; else
    :class:`AuxLayerError` naming the bad ids and the accepted range. ``what`` names the setting in
    the message (e.g. a recipe field)."""
    ids = [int(i) for i in aux_layer_ids]
    bad = [i for i in ids if not 0 <= i <= num_hidden_layers]
    if bad:
        raise AuxLayerError(
            f"{what} {bad} out of range: this model has {num_hidden_layers} decoder layers, so ids "
            f"go from 0 (embeddings) to {num_hidden_layers} (final norm output); id i is the hidden "
            f"state entering decoder layer i (got {ids})"
        )
    return ids


def select_aux_layers(captured: Sequence[int], chosen: Sequence[int] | None, *, what: str = "aux_layer_ids") -> list[int]:
    """Positions in ``captured`` (a store's ``aux_layer_ids``, the order of its aux feature's leading
    axis) of the layer ids ``chosen`` (a training recipe's subset, in its order); all of them when
    ``chosen`` is None. Raises :class:`AuxLayerError` naming the ids the store holds."""
    captured = [int(i) for i in captured]
    if chosen is None:
        return list(range(len(captured)))
    chosen = [int(i) for i in chosen]
    if not chosen:
        raise AuxLayerError(f"{what} is empty; pick some of the store's aux layers {captured}")
    if len(set(chosen)) != len(chosen):
        raise AuxLayerError(f"{what} {chosen} repeats a layer")
    missing = [i for i in chosen if i not in captured]
    if missing:
        raise AuxLayerError(
            f"{what} {missing} are not in the store: it holds aux layers {captured} "
            "(lineage aux_layer_ids); pick from those or extract with them in capture.aux_layer_ids"
        )
    return [captured.index(i) for i in chosen]


def is_final_norm_output(layer_id: int, num_hidden_layers: int) -> bool:
    """Whether aux id ``layer_id`` is the post-norm final state (id L) rather than a layer's input."""
    return layer_id == num_hidden_layers


__all__ = [
    "AUX_HIDDEN_STATES",
    "DRAFT_PROBS",
    "FINAL_HIDDEN_STATE",
    "FINAL_STATE_CONVENTION",
    "LAYER_CONVENTION",
    "TEACHER_FEATURES",
    "TOPK_IDS",
    "TOPK_LOGITS",
    "check_aux_layer_ids",
    "default_aux_layer_ids",
    "is_final_norm_output",
    "select_aux_layers",
]
