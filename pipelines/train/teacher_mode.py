"""Which stored target distribution a draft learns from: the one spelling of the teacher modes.

A store carries the target's next-token distribution in one of three forms
(``Lineage.target_distribution``; the features each needs are :data:`hsstore.aux_layers.TEACHER_FEATURES`).
The trainer, the lineage check and the evaluation proxy name them through :class:`TeacherMode`;
recipes spell them as the enum's values (``teacher: topk``). Imports no torch.
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

    @property
    def features(self) -> tuple[str, ...]:
        """The store features that carry this distribution."""
        return TEACHER_FEATURES[self.value]


# What a recipe may ask for: one mode, or the best the store holds.
TeacherChoice = TeacherMode | Literal["auto"]

__all__ = ["TeacherChoice", "TeacherMode"]
