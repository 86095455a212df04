"""The teacher: the target's next-token distribution restricted to the draft vocabulary.

DESIGN.md: at each position the teacher is the target's softmax restricted to the draft vocabulary
and renormalised; a position whose target argmax lies outside the draft vocabulary is invalid
(the draft could never propose that token, so training towards the renormalised rest would teach
a wrong top-1). Restricting and renormalising a softmax equals a softmax over the kept logits, so
only the draft-vocabulary logits are ever materialised; the full vocabulary is visited only to
find whether a token outside the draft vocabulary beats the best one inside, chunk by chunk.

Three store features can carry the target's distribution (``hsstore.features``):

- ``final_hidden_state`` (post-norm, [T, H]): exact logits through the target's lm_head.
- ``topk_logits`` / ``topk_ids`` ([T, k]): the softmax over the k stored logits; ids outside the
  draft vocabulary are dropped. Valid iff the top-1 stored id is in the draft vocabulary.
- ``draft_probs`` ([T, V_draft]): the target's full-vocabulary probabilities at the draft ids.
  Stored un-renormalised, the missing mass ``1 - sum`` bounds every outside token's probability,
  so the argmax is certainly inside iff ``max >= 1 - sum``; a store that renormalised them has
  no missing mass and every position counts as valid.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

FINAL_HIDDEN = "final_hidden"
TOPK = "topk"
DRAFT_PROBS = "draft_probs"
DEFAULT_VOCAB_CHUNK = 8192


@dataclass
class Teacher:
    probs_BTV: torch.Tensor  # float32 [B, T, V_draft], rows sum to 1 where valid
    valid_BT: torch.Tensor  # bool [B, T]: the target's argmax is inside the draft vocabulary


def draft_vocab_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft vocabulary (draft id i -> i + d2t[i])."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t


def teacher_from_final_hidden(
    final_hidden_BTH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
) -> Teacher:
    """Teacher from the post-norm final state and the target's lm_head ``[V_target, H]``.

    Logits are computed in the final state's dtype (as the target does) and softmaxed in float32.
    Peak extra memory is one ``[B*T, vocab_chunk]`` block, so 150k vocabularies fit."""
    B, T, H = final_hidden_BTH.shape
    hidden_NH = final_hidden_BTH.reshape(B * T, H)
    weight = lm_head_VH.to(device=hidden_NH.device, dtype=hidden_NH.dtype)
    ids = draft_vocab_ids(d2t.to(hidden_NH.device))
    draft_logits_NV = (hidden_NH @ weight[ids].T).float()
    probs = torch.softmax(draft_logits_NV, dim=-1)
    if ids.shape[0] == weight.shape[0]:
        valid = torch.ones(B * T, dtype=torch.bool, device=hidden_NH.device)
    else:
        # Best logit among target ids outside the draft vocabulary, one vocab chunk at a time.
        outside = ~t2d.to(hidden_NH.device)
        best_outside = torch.full((B * T,), float("-inf"), device=hidden_NH.device)
        for start in range(0, weight.shape[0], vocab_chunk):
            chunk_outside = outside[start : start + vocab_chunk]
            if not bool(chunk_outside.any()):
                continue
            logits = (hidden_NH @ weight[start : start + vocab_chunk][chunk_outside].T).float()
            best_outside = torch.maximum(best_outside, logits.max(dim=-1).values)
        # Ties go to the draft vocabulary (its token is then an argmax too).
        valid = draft_logits_NV.max(dim=-1).values >= best_outside
    return Teacher(probs.reshape(B, T, -1), valid.reshape(B, T))


def teacher_from_topk(
    topk_logits_BTK: torch.Tensor,
    topk_ids_BTK: torch.Tensor,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
) -> Teacher:
    """Teacher from the k stored logits and their target ids (any order)."""
    device = topk_logits_BTK.device
    V_draft = d2t.shape[0]
    target_to_draft = torch.full((t2d.shape[0],), -1, dtype=torch.long, device=device)
    target_to_draft[draft_vocab_ids(d2t.to(device))] = torch.arange(V_draft, device=device)
    draft_ids_BTK = target_to_draft[topk_ids_BTK.long()]
    inside = draft_ids_BTK >= 0
    logits = topk_logits_BTK.float().masked_fill(~inside, float("-inf"))
    top1 = topk_logits_BTK.float().argmax(dim=-1, keepdim=True)
    valid = inside.gather(-1, top1).squeeze(-1)
    # A valid row has at least its top-1 inside, so its softmax is finite; others are zeroed.
    probs_BTK = torch.softmax(logits.masked_fill(~valid[..., None], 0.0), dim=-1)
    probs_BTK = probs_BTK.masked_fill(~inside | ~valid[..., None], 0.0)
    probs = torch.zeros(*topk_ids_BTK.shape[:2], V_draft, device=device)
    probs.scatter_add_(-1, draft_ids_BTK.clamp(min=0), probs_BTK)
    return Teacher(probs, valid)


def teacher_from_draft_probs(draft_probs_BTV: torch.Tensor) -> Teacher:
    """Teacher from dense probabilities over the draft vocabulary (renormalised here)."""
    probs = draft_probs_BTV.float()
    total = probs.sum(dim=-1, keepdim=True)
    valid = (probs.max(dim=-1).values >= 1.0 - total.squeeze(-1)) & (total.squeeze(-1) > 0)
    return Teacher(probs / total.clamp(min=torch.finfo(torch.float32).tiny), valid)


def build_teacher(
    mode: str,
    features: Mapping[str, torch.Tensor],
    *,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    lm_head_VH: torch.Tensor | None = None,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
) -> Teacher:
    """Dispatch on the teacher mode (``final_hidden``, ``topk``, ``draft_probs``; see
    ``pipelines.train.lineage_check.choose_teacher``) with the batch's decoded features."""
    if mode == FINAL_HIDDEN:
        if lm_head_VH is None:
            raise ValueError("teacher mode 'final_hidden' needs the target's lm_head weight")
        return teacher_from_final_hidden(
            features["final_hidden_state"], lm_head_VH, d2t, t2d, vocab_chunk
        )
    if mode == TOPK:
        return teacher_from_topk(features["topk_logits"], features["topk_ids"], d2t, t2d)
    if mode == DRAFT_PROBS:
        probs = features["draft_probs"]
        if probs.shape[-1] != d2t.shape[0]:
            raise ValueError(
                f"draft_probs cover {probs.shape[-1]} ids but the draft vocabulary has {d2t.shape[0]}: "
                "the store was extracted with another draft vocabulary"
            )
        return teacher_from_draft_probs(probs)
    raise ValueError(f"unknown teacher mode {mode!r} (final_hidden, topk, draft_probs)")
