"""Which distribution a draft learns from: the one spelling of the teacher modes.

A store carries the target's next-token distribution in one of three forms
(``Lineage.target_distribution``; the features each needs are :data:`hsstore.aux_layers.TEACHER_FEATURES`).
The trainer, the lineage check and the evaluation proxy name them through :class:`TeacherMode`;
recipes spell them as the enum's values (``teacher: topk``). A fourth mode, ``tokens``, reads no
distribution at all: the label is the record's own next token (EAGLE-1's and Medusa-1's labels),
for a store of aux states only and for measuring what the target's distribution adds
(docs/training.md). ``auto`` never picks it. Imports no torch.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from hsstore.aux_layers import TEACHER_FEATURES


class TeacherMode(StrEnum):
    """A teacher mode; a ``str`` (``TeacherMode.TOPK == "topk"``), so it serialises as its value.

    Declared in the order ``teacher: auto`` prefers them: the exact final state first, then the
    top-k logits, then dense draft-vocabulary probabilities."""

    FINAL_HIDDEN = "final_hidden"  # final_hidden_state [T, H] through the target's lm_head: exact
    TOPK = "topk"  # topk_logits / topk_ids [T, k]: the softmax over the k stored logits
    DRAFT_PROBS = "draft_probs"  # draft_probs [T, V_draft]: target probabilities at the draft ids
    TOKENS = "tokens"  # no feature: one-hot on the record's next token (the data, not the target)

    @property
    def features(self) -> tuple[str, ...]:
        """The store features that carry this distribution (none for ``tokens``)."""
        return TEACHER_FEATURES.get(self.value, ())

    @property
    def from_target(self) -> bool:
        """Whether the labels are the target's distribution (every mode but ``tokens``)."""
        return self.value in TEACHER_FEATURES


# What a recipe may ask for: one mode, or the best the store holds.
TeacherChoice = TeacherMode | Literal["auto"]

__all__ = ["TeacherChoice", "TeacherMode"]
