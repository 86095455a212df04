"""Feature specs' old import path, kept for code written against it: everything here is
:mod:`hsstore.format.features`."""

from hsstore.format.features import (
    AUX_HIDDEN_STATES,
    DEFAULT_CHUNK_BYTES,
    DRAFT_PROBS,
    FINAL_HIDDEN_STATE,
    MAX_DEFAULT_CHUNK_TOKENS,
    TOPK_IDS,
    TOPK_LOGITS,
    FeatureSpec,
    default_chunk_tokens,
)
from hsstore.format.layout import SCALE_SUFFIX, TABLE_FEATURES

__all__ = [
    "AUX_HIDDEN_STATES",
    "DEFAULT_CHUNK_BYTES",
    "DRAFT_PROBS",
    "FINAL_HIDDEN_STATE",
    "MAX_DEFAULT_CHUNK_TOKENS",
    "SCALE_SUFFIX",
    "TABLE_FEATURES",
    "TOPK_IDS",
    "TOPK_LOGITS",
    "FeatureSpec",
    "default_chunk_tokens",
]
