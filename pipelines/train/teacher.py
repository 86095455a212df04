"""The teacher: the target's next-token distribution restricted to the draft vocabulary.

docs/design.md: at each position the teacher is the target's softmax restricted to the draft vocabulary
and renormalised; a position whose target argmax lies outside the draft vocabulary is invalid
(the draft could never propose that token, so training towards the renormalised rest would teach
a wrong top-1). Restricting and renormalising a softmax equals a softmax over the kept logits, so
only the draft-vocabulary logits are ever materialised; the full vocabulary is visited only to
find whether a token outside the draft vocabulary beats the best one inside, chunk by chunk.

Three store features can carry the target's distribution (``hsstore.aux_layers``):

- ``final_hidden_state`` (post-norm, [T, H]): exact logits through the target's lm_head.
- ``topk_logits`` / ``topk_ids`` ([T, k]): the softmax over the k stored logits; ids outside the
  draft vocabulary are dropped. Valid iff the top-1 stored id is in the draft vocabulary.
- ``draft_probs`` ([T, V_draft]): the target's full-vocabulary probabilities at the draft ids.
  Stored un-renormalised, the missing mass ``1 - sum`` bounds every outside token's probability,
  so the argmax is certainly inside iff ``max >= 1 - sum``; a store that renormalised them has
  no missing mass and every position counts as valid.

``teacher: tokens`` is not the target's: one-hot labels on the records' own next tokens
(:class:`TokenTeacherRows`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hsstore.aux_layers import DRAFT_PROBS, FINAL_HIDDEN_STATE, TOPK_IDS, TOPK_LOGITS
from pipelines.train.teacher_mode import TeacherMode

DEFAULT_VOCAB_CHUNK = 8192
# The teacher's draft-vocabulary logits of a whole step are computed once when they hold at most
# this many elements (2**30, 2 GB in bf16; the 8B shape's 8,192 positions x 32,000 ids are 2**28):
# every depth of the TTT unroll reads its (shifted) rows from them and the validity check maxes
# them. Recomputed per depth instead, the seven depths multiplied the same final states by the
# same head seven times, plus once more in the validity check (benchmarks/LOG.md, issue 31).
ONCE_PER_STEP_ELEMENTS = 1 << 30


@dataclass
class Teacher:
    probs_BTV: torch.Tensor  # float32 [B, T, V_draft], rows sum to 1 where valid
    valid_BT: torch.Tensor  # bool [B, T]: the target's argmax is inside the draft vocabulary


def draft_vocab_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft vocabulary (draft id i -> i + d2t[i])."""
    return torch.arange(d2t.shape[0], device=d2t.device) + d2t


def target_to_draft_ids(d2t: torch.Tensor, t2d: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Long ``[V_target]``: each target id's draft id, -1 for ids outside the draft vocabulary."""
    V_draft = d2t.shape[0]
    target_to_draft = torch.full((t2d.shape[0],), -1, dtype=torch.long, device=device)
    target_to_draft[draft_vocab_ids(d2t.to(device))] = torch.arange(V_draft, device=device)
    return target_to_draft


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
    draft_ids_BTK = target_to_draft_ids(d2t, t2d, device)[topk_ids_BTK.long()]
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
    mode: TeacherMode,
    features: Mapping[str, torch.Tensor],
    *,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    lm_head_VH: torch.Tensor | None = None,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
) -> Teacher:
    """Dispatch on the teacher mode (see ``pipelines.train.lineage_check.choose_teacher``) with
    the batch's decoded features."""
    if mode == TeacherMode.FINAL_HIDDEN:
        if lm_head_VH is None:
            raise ValueError("teacher mode 'final_hidden' needs the target's lm_head weight")
        return teacher_from_final_hidden(
            features[FINAL_HIDDEN_STATE], lm_head_VH, d2t, t2d, vocab_chunk
        )
    if mode == TeacherMode.TOPK:
        return teacher_from_topk(features[TOPK_LOGITS], features[TOPK_IDS], d2t, t2d)
    if mode == TeacherMode.DRAFT_PROBS:
        probs = features[DRAFT_PROBS]
        if probs.shape[-1] != d2t.shape[0]:
            raise ValueError(
                f"draft_probs cover {probs.shape[-1]} ids but the draft vocabulary has {d2t.shape[0]}: "
                "the store was extracted with another draft vocabulary"
            )
        return teacher_from_draft_probs(probs)
    if mode == TeacherMode.TOKENS:
        raise ValueError("teacher mode 'tokens' reads the batch's input_ids: use teacher_rows(..., input_ids_BT=)")
    raise ValueError(f"unknown teacher mode {mode!r} ({', '.join(TeacherMode)})")


# -- teachers read row by row (the training loss: pipelines.train.loss) ------------------------


class DenseTeacherRows:
    """Rows of an already dense ``[B, T, V_draft]`` distribution (tests, the evaluation proxy)."""

    def __init__(self, probs_BTV: torch.Tensor) -> None:
        self.probs_NV = probs_BTV.reshape(-1, probs_BTV.shape[-1])

    def probs(self, rows_N: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.probs_NV[rows_N].to(dtype)


class TeacherHead:
    """The target's lm_head split once per run into the draft-vocabulary rows (the teacher's
    logits) and the rows outside it (only ever maxed, to tell whether the target's argmax is a
    token the draft can propose). Building it costs one gather of the head; every step then
    reuses both halves instead of gathering a gigabyte of weights per step."""

    def __init__(
        self, lm_head_VH: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor,
        dtype: torch.dtype | None = None,
    ) -> None:
        device = lm_head_VH.device
        weight = lm_head_VH if dtype is None else lm_head_VH.to(dtype)
        self.draft_rows_VH = weight[draft_vocab_ids(d2t.to(device))].contiguous()
        outside = ~t2d.to(device)
        self.outside_rows_VH = weight[outside].contiguous() if bool(outside.any()) else None

    @torch.no_grad()
    def valid(
        self, hidden_NH: torch.Tensor, chunk_elements: int = 1 << 26, inside_logits_NV: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Bool [N]: the target's argmax over its whole vocabulary lies in the draft vocabulary
        (ties count as inside). Chunked over positions and vocabulary, no host syncs.
        ``inside_logits_NV``: the draft-vocabulary logits, when the caller has them already."""
        N = hidden_NH.shape[0]
        valid = torch.ones(N, dtype=torch.bool, device=hidden_NH.device)
        if self.outside_rows_VH is None or N == 0:
            return valid
        h = hidden_NH.to(self.draft_rows_VH.dtype)
        rows = max(1, chunk_elements // max(self.outside_rows_VH.shape[0], self.draft_rows_VH.shape[0]))
        for start in range(0, N, rows):
            h_c = h[start : start + rows]
            inside = (
                h_c @ self.draft_rows_VH.T if inside_logits_NV is None else inside_logits_NV[start : start + rows]
            )
            best_inside = inside.float().amax(-1)
            best_outside = torch.full_like(best_inside, float("-inf"))
            vocab_step = max(1, chunk_elements // h_c.shape[0])
            for v in range(0, self.outside_rows_VH.shape[0], vocab_step):
                logits = h_c @ self.outside_rows_VH[v : v + vocab_step].T
                best_outside = torch.maximum(best_outside, logits.float().amax(-1))
            valid[start : start + rows] = best_inside >= best_outside
        return valid


class FinalHiddenTeacherRows:
    """Teacher rows from the stored post-norm final state: a softmax over the draft-vocabulary
    logits. The logits of every position are computed once (one [N, H] x [H, V_draft] matmul)
    when they fit ``once_elements``; past that, per chunk of rows asked for.

    ``needed_N`` (bool [N], optional): the only positions whose teacher is ever asked for (the
    teacher at position j scores the prediction of token j + 1, so those whose next token is in
    the loss mask). The logits and the validity check are then computed at those positions only,
    and the rest count as invalid: a store whose loss mask covers a fraction f of the tokens pays
    f of the teacher's products. Its row count is read on the host (a sync), which the sparse
    scoring of ``compile: off``/``layers`` already makes per depth; a whole-step graph passes None."""

    def __init__(
        self,
        final_hidden_BTH: torch.Tensor,
        head: TeacherHead,
        once_elements: int | None = None,
        needed_N: torch.Tensor | None = None,
    ) -> None:
        self.hidden_NH = final_hidden_BTH.reshape(-1, final_hidden_BTH.shape[-1])
        self.head = head
        self._rows_M: torch.Tensor | None = None
        computed = self.hidden_NH
        if needed_N is not None:
            self._rows_M = needed_N.reshape(-1).nonzero().squeeze(1)
            computed = self.hidden_NH[self._rows_M]
        self._computed_MH = computed
        weight = head.draft_rows_VH
        self.logits_NV: torch.Tensor | None = None
        # Where each position's logits sit in logits_NV (None: row n at n); the per-call path
        # indexes the final state by position and needs no map.
        self._slot_N: torch.Tensor | None = None
        limit = ONCE_PER_STEP_ELEMENTS if once_elements is None else once_elements
        if computed.shape[0] * weight.shape[0] <= limit:
            with torch.no_grad():
                self.logits_NV = computed.to(weight.dtype) @ weight.T
            if self._rows_M is not None:
                self._slot_N = torch.zeros(self.hidden_NH.shape[0], dtype=torch.long, device=computed.device)
                self._slot_N[self._rows_M] = torch.arange(len(self._rows_M), device=computed.device)

    def valid(self) -> torch.Tensor:
        valid = self.head.valid(self._computed_MH, inside_logits_NV=self.logits_NV)
        if self._rows_M is None:
            return valid
        full = torch.zeros(self.hidden_NH.shape[0], dtype=torch.bool, device=valid.device)
        full[self._rows_M] = valid
        return full

    def logits(self, rows_N: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The teacher's logits over the draft vocabulary (the loss fuses their softmax)."""
        if self.logits_NV is not None:
            return self.logits_NV[rows_N if self._slot_N is None else self._slot_N[rows_N]].to(dtype)
        weight = self.head.draft_rows_VH
        return (self.hidden_NH[rows_N].to(weight.dtype) @ weight.T).to(dtype)

    def probs(self, rows_N: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.softmax(self.logits(rows_N, dtype), dim=-1)


class TokenTeacherRows:
    """The data's own labels (``teacher: tokens``): row j is one-hot on the record's token j + 1,
    the token the target's distribution at j would predict; built per chunk of rows, so no
    ``[positions, vocabulary]`` tensor is ever whole. Valid where that token exists in the row and
    lies in the draft vocabulary (the draft could never propose another)."""

    def __init__(self, input_ids_BT: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        target_to_draft = target_to_draft_ids(d2t, t2d, input_ids_BT.device)
        next_ids_BT = torch.roll(input_ids_BT.long(), -1, dims=1)
        known = (next_ids_BT >= 0) & (next_ids_BT < t2d.shape[0])  # an id past the vocabulary teaches nothing
        next_draft_BT = torch.where(known, target_to_draft[next_ids_BT.clamp(0, t2d.shape[0] - 1)], -1)
        next_draft_BT[:, -1] = -1  # a row's last position has no next token in the row
        self.next_draft_N = next_draft_BT.reshape(-1)
        self.valid_BT = next_draft_BT >= 0
        self.vocab_size = d2t.shape[0]

    def probs(self, rows_N: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ids = self.next_draft_N[rows_N]
        out = torch.zeros(ids.shape[0], self.vocab_size, dtype=dtype, device=ids.device)
        return out.scatter_(1, ids.clamp(min=0)[:, None], (ids >= 0).to(dtype)[:, None])


def teacher_rows(
    mode: TeacherMode,
    features: Mapping[str, torch.Tensor],
    *,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    head: TeacherHead | None = None,
    needed_BT: torch.Tensor | None = None,
    input_ids_BT: torch.Tensor | None = None,
) -> tuple[DenseTeacherRows | FinalHiddenTeacherRows | TokenTeacherRows, torch.Tensor]:
    """``(rows, valid_BT)`` for the training loss. ``final_hidden`` streams rows from the final
    state through ``head`` (at the ``needed_BT`` positions only, when given: see
    :class:`FinalHiddenTeacherRows`); the compact modes (top-k, draft probabilities) are small per
    position already and go through the dense builders above; ``tokens`` reads ``input_ids_BT``."""
    if mode == TeacherMode.TOKENS:
        if input_ids_BT is None:
            raise ValueError("teacher mode 'tokens' needs the batch's input_ids")
        tokens = TokenTeacherRows(input_ids_BT, d2t, t2d)
        return tokens, tokens.valid_BT
    if mode == TeacherMode.FINAL_HIDDEN:
        if head is None:
            raise ValueError("teacher mode 'final_hidden' needs a TeacherHead (the target's lm_head)")
        final = features[FINAL_HIDDEN_STATE]
        rows = FinalHiddenTeacherRows(final, head, needed_N=None if needed_BT is None else needed_BT.reshape(-1))
        return rows, rows.valid().reshape(final.shape[:2])
    dense = build_teacher(mode, features, d2t=d2t, t2d=t2d)
    return DenseTeacherRows(dense.probs_BTV), dense.valid_BT
