"""EAGLE-3 training-time test (TTT): unroll the draft on its own outputs and score every depth.

Alignment (docs/draft-model.md): at position t the draft gets the target's fused aux state of
position t and the embedding of token t+1, and predicts token t+2. Depth i (TTT step i) at
position t feeds back the draft's own depth-(i-1) output at t, embeds token t+1+i, uses RoPE
position ``position_ids[t] + i`` and predicts token t+2+i, whose teacher is the target's
distribution at position t+1+i.

Attention at depth i, query at t: the depth-0 keys of positions s <= t of the same document (as in
decoding, where the context's keys come from target features), plus the keys that position t
itself produced at depths 1..i (the draft's own drafted chain). With a sliding window W, a key at
RoPE position p is visible iff ``position_ids[t] + i - p < W``, matching how vLLM windows the
draft's KV cache by sequence position. The depth-0 part is a [T, T] mask; the own-key part is a
diagonal, scored as dot products (``Eagle3Draft.forward(..., diagonal_kv=...)``) rather than as
T x iT masked blocks, which would cost (i+1) times the memory and FLOPs of the depth-0 scores.

Masks and packing: position (t, i) is scored iff token t+2+i lies in t's document
(``doc_remaining[t] >= 2 + i``), token t+2+i is in the loss mask, and the teacher at t+1+i is
valid (its target argmax is in the draft vocabulary). ``loss_mask[j]`` is the extraction's
per-token mask (1 = token j is an assistant token to learn), so "predicting token j counts iff
loss_mask[j]".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipelines.models.eagle3 import Eagle3Draft
from pipelines.models.ttt_attention import make_ttt_attention
from pipelines.train.loss import TeacherRows, linear_soft_cross_entropy
from pipelines.train.teacher import DenseTeacherRows

DEFAULT_TTT_LENGTH = 7
DEFAULT_DECAY = 0.8


@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar: sum_i decay**i * step_losses[i]
    step_losses: list[torch.Tensor]  # scalar per depth: masked mean CE against the teacher
    step_accuracies: list[torch.Tensor]  # scalar per depth: argmax(draft) == argmax(teacher)
    step_counts: list[torch.Tensor]  # int64 scalar per depth: positions scored
    step_loss_sums: list[torch.Tensor]  # un-normalised CE sums (for exact DDP averaging)
    step_correct: list[torch.Tensor]  # int64 number of argmax matches per depth
    hidden_per_step: list[torch.Tensor]  # [B, T, H] draft output at each depth
    step_masks: list[torch.Tensor]  # [B, T] bool: positions scored at each depth


def doc_remaining_from_ids(doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """Tokens left after t in t's document ([B, T] int64; 0 at a document's last token).

    Documents are contiguous runs of equal ids (padding may form its own run)."""
    B, T = doc_ids_BT.shape
    idx = torch.arange(T, device=doc_ids_BT.device).expand(B, T)
    is_last = torch.ones_like(doc_ids_BT, dtype=torch.bool)
    is_last[:, :-1] = doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1]
    end = torch.where(is_last, idx, torch.full_like(idx, T))
    # end[t] = first document end at or after t: a reversed running minimum.
    end = end.flip(-1).cummin(-1).values.flip(-1)
    return end - idx


def shift_left(x_BT: torch.Tensor, k: int, fill: int | bool | float = 0) -> torch.Tensor:
    """x[:, t + k] at t, ``fill`` past the end."""
    if k == 0:
        return x_BT
    pad = torch.full_like(x_BT[:, :k], fill)
    return torch.cat([x_BT[:, k:], pad], dim=1)


def ttt_unroll(
    draft: Eagle3Draft,
    aux_BTKH: torch.Tensor,
    input_ids_BT: torch.Tensor,
    position_ids_BT: torch.Tensor,
    doc_ids_BT: torch.Tensor | None = None,
    ttt_length: int = DEFAULT_TTT_LENGTH,
    attention: str = "auto",
    block_masks: list[Any] | None = None,
) -> list[torch.Tensor]:
    """Run the draft for ``ttt_length`` depths; returns the hidden output of each depth.

    ``attention``: ``auto`` (fused flex attention on CUDA, per-document attention elsewhere),
    ``flex``, ``segmented`` or ``eager`` (``pipelines.models.ttt_attention``; all give the same
    result); ``block_masks``: flex's masks built outside a compiled step (``FlexTTTAttention``).
    Positions whose shifted inputs fall outside their document compute garbage that no scored
    position can see (causality and the document mask guarantee it); the step masks drop them.
    """
    window = draft.config.sliding_window
    if window is not None and window < ttt_length:
        raise ValueError(
            f"sliding_window={window} is shorter than ttt_length={ttt_length}: depth i could not "
            "see its own earlier drafted keys"
        )
    if doc_ids_BT is None:
        doc_ids_BT = torch.zeros_like(input_ids_BT)
    ttt = make_ttt_attention(
        attention, doc_ids_BT, position_ids_BT, window, ttt_length, draft.config.window_mode, block_masks
    )
    hidden = draft.fuse_aux(aux_BTKH)
    hidden_per_step = []
    for depth in range(ttt_length):
        out = draft(
            shift_left(input_ids_BT, 1 + depth),
            hidden,
            position_ids_BT + depth,
            ttt=ttt,
            depth=depth,
        )
        hidden = out.hidden_BTD
        hidden_per_step.append(hidden)
    return hidden_per_step


def ttt_step_masks(
    loss_mask_BT: torch.Tensor,
    doc_remaining_BT: torch.Tensor,
    teacher_valid_BT: torch.Tensor | None,
    ttt_length: int,
) -> list[torch.Tensor]:
    """[B, T] bool per depth: the positions whose depth-i prediction is scored."""
    masks = []
    for depth in range(ttt_length):
        mask = (doc_remaining_BT >= 2 + depth) & shift_left(loss_mask_BT.bool(), 2 + depth, False)
        if teacher_valid_BT is not None:
            mask = mask & shift_left(teacher_valid_BT.bool(), 1 + depth, False)
        masks.append(mask)
    return masks


def ttt_forward(
    draft: Eagle3Draft,
    aux_BTKH: torch.Tensor,
    input_ids_BT: torch.Tensor,
    position_ids_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    teacher: torch.Tensor | TeacherRows,
    teacher_valid_BT: torch.Tensor | None = None,
    doc_ids_BT: torch.Tensor | None = None,
    ttt_length: int = DEFAULT_TTT_LENGTH,
    decay: float = DEFAULT_DECAY,
    attention: str = "auto",
    loss_chunk: int | None = None,
    compile_loss: bool | None = None,
    dense: bool = False,
    block_masks: list[Any] | None = None,
) -> TTTOutput:
    """The EAGLE-3 TTT loss: ``sum_i decay**i * CE_i`` with CE_i the masked mean cross-entropy
    of the depth-i draft logits against the teacher (see the module docstring for alignment).

    ``teacher`` is the target's distribution over the draft vocabulary at each position: a dense
    ``[B, T, V_draft]`` tensor or rows produced on demand (``pipelines.train.teacher``);
    ``doc_ids_BT`` marks packed documents (None: one per row). Logits are computed only at scored
    positions, in chunks, and never kept (``pipelines.train.loss``).

    ``dense``: compute the logits at every position and let the step mask zero the unscored ones,
    instead of gathering the scored positions first. Same losses and gradients; every shape is
    then static and no depth waits on the host for its count of scored positions (what a
    compiled or graph-captured step needs), at the price of the head's matmuls at unscored
    positions.
    """
    if doc_ids_BT is None:
        doc_ids_BT = torch.zeros_like(input_ids_BT)
    if isinstance(teacher, torch.Tensor):
        teacher = DenseTeacherRows(teacher)
    hidden_per_step = ttt_unroll(
        draft, aux_BTKH, input_ids_BT, position_ids_BT, doc_ids_BT, ttt_length, attention, block_masks
    )
    masks = ttt_step_masks(
        loss_mask_BT, doc_remaining_from_ids(doc_ids_BT), teacher_valid_BT, ttt_length
    )
    # The loss is computed in at least float32 whatever the compute dtype (bf16 logits lose CE precision).
    loss_dtype = torch.promote_types(hidden_per_step[0].dtype, torch.float32)
    total = hidden_per_step[0].new_zeros((), dtype=loss_dtype)
    out = TTTOutput(total, [], [], [], [], [], hidden_per_step, masks)
    num_positions = input_ids_BT.numel()
    for depth, (hidden, mask) in enumerate(zip(hidden_per_step, masks, strict=True)):
        # Position t is scored against the teacher at t + 1 + depth (same row: the step mask is
        # False wherever t + 1 + depth would leave the row or the document).
        if dense:
            keep = mask.flatten()
            positions = torch.arange(num_positions, device=keep.device)
            # Past the last position the index is clamped: those positions are never kept.
            teacher_at = (positions + 1 + depth).clamp(max=num_positions - 1)
            ce_sum, correct = linear_soft_cross_entropy(
                draft.head_input(hidden.flatten(0, 1)), draft.lm_head.weight, teacher, teacher_at,
                loss_chunk, compile_loss, keep,
            )
            count = keep.sum()
        else:
            rows = mask.flatten().nonzero().squeeze(1)
            normed = draft.head_input(hidden.flatten(0, 1)[rows])
            ce_sum, correct = linear_soft_cross_entropy(
                normed, draft.lm_head.weight, teacher, rows + 1 + depth, loss_chunk, compile_loss
            )
            count = rows.new_tensor(rows.shape[0])
        step_loss = ce_sum / count.clamp(min=1)
        total = total + decay**depth * step_loss
        out.step_loss_sums.append(ce_sum)
        out.step_losses.append(step_loss)
        out.step_counts.append(count)
        out.step_correct.append(correct)
        out.step_accuracies.append(correct.float() / count.clamp(min=1))
    out.loss = total
    return out
