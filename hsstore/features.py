"""Feature specs' old import path, kept for code written against it: everything here is
:mod:`hsstore.format.features` (specs) or :mod:`hsstore.aux_layers` (the pipelines' feature names)."""

from hsstore.aux_layers import (
    AUX_HIDDEN_STATES,
    DRAFT_PROBS,
    FINAL_HIDDEN_STATE,
    TOPK_IDS,
    TOPK_LOGITS,
)
from hsstore.format.features import (
    DEFAULT_CHUNK_BYTES,
    MAX_DEFAULT_CHUNK_TOKENS,
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
