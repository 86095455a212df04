"""What one training step computes, as ``nn.Module``s that ``DistributedDataParallel`` wraps.

Each objective owns the draft (its only registered submodule, so DDP sees exactly the draft's
trainable parameters and overlaps their bucketed all-reduce with the backward pass) and returns
per-depth *sums* and counts rather than a finished loss: the trainer normalises by the global
count of scored positions over all ranks, so N ranks compute the gradient of one rank that saw
all N batches (``objective_loss``).

- ``DraftObjective`` (stage 1, EAGLE-3/EAGLE-4 drafts): the TTT unroll and its soft
  cross-entropy against the target's distribution over the draft vocabulary.
- ``CandidateObjective`` (EAGLE-4 stage 2): the frozen draft's unroll without gradients, then
  the low-rank head's forward KL from the full head at every depth.

The target's lm_head (the teacher) is held as a plain attribute, not a buffer: it is frozen, the
same on every rank, and a gigabyte that DDP must neither broadcast nor bucket.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hsstore.aux_layers import AUX_HIDDEN_STATES
from pipelines.models.eagle3 import Eagle3Draft
from pipelines.models.ttt_attention import FlexTTTAttention
from pipelines.train.candidate import candidate_step_loss
from pipelines.train.compile_modes import (
    CompileMode,
    compile_whole_step,
    mark_static,
    resolve_compile_mode,
)
from pipelines.train.fp8 import convert_to_fp8
from pipelines.train.teacher import TeacherHead, teacher_rows
from pipelines.train.teacher_mode import TeacherMode
from pipelines.train.ttt import (
    doc_remaining_from_ids,
    shift_left,
    ttt_forward,
    ttt_step_masks,
    ttt_unroll,
)

AUX = AUX_HIDDEN_STATES


@dataclass
class ObjectiveOutput:
    """Per-depth sums over this rank's batch (tensors on the device, no host syncs)."""

    loss_sums: list[torch.Tensor]  # CE (stage 1) or KL (stage 2) summed over scored positions
    counts: list[torch.Tensor]  # scored positions
    correct: list[torch.Tensor]  # argmax matches (stage 1) or top-1 in the top K (stage 2)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


def compile_draft_pointwise(draft: Eagle3Draft) -> None:
    """``torch.compile`` the draft's norms and MLP in place (state-dict keys unchanged): fuses the
    float32 RMSNorm round trips and SiLU-times-up into single passes. CUDA only; attention is
    compiled separately (``pipelines.models.ttt_attention``) and the matmuls gain nothing."""
    layer = draft.midlayer
    fc_norms = list(draft.fc_norm) if draft.fc_norm is not None else []
    for module in (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, layer.mlp, draft.norm, *fc_norms):
        module.compile(dynamic=None)


class DraftObjective(nn.Module):
    """Stage 1's step: teacher rows, the TTT unroll and its per-depth loss sums.

    ``compile`` (:class:`~pipelines.train.compile_modes.CompileMode`; ``True`` = ``layers``) says
    how much of this is compiled; ``step`` and ``graph`` compile all of :meth:`forward` as one
    graph with ``compile_backend`` (tests trace with ``aot_eager``). ``fp8``: the draft's linear
    layers (not lm_head) run their matmuls in FP8 (``pipelines.train.fp8``), converted here,
    before anything is compiled. The draft must already be on its training device."""

    def __init__(
        self,
        draft: Eagle3Draft,
        teacher_mode: TeacherMode,
        teacher_head: TeacherHead | None,
        ttt_length: int,
        attention: str = "auto",
        loss_chunk: int | None = None,
        compile: CompileMode | str | bool = False,
        fp8: bool = False,
        compile_backend: str = "inductor",
    ) -> None:
        super().__init__()
        self.draft = draft
        self.teacher_mode = teacher_mode
        self.teacher_head = teacher_head
        self.ttt_length = ttt_length
        self.loss_chunk = loss_chunk
        device = draft.fc.weight.device
        self.compile_mode = mode = resolve_compile_mode(compile, device, fp8=fp8)
        if mode.whole_step and attention == "segmented":
            raise ValueError("attention: segmented reads each row's document bounds on the host, which a "
                             f"compiled step (compile: {mode}) cannot; use flex (CUDA) or eager")
        if mode.whole_step and attention == "auto":
            attention = "flex" if device.type == "cuda" else "eager"
        self.attention = attention
        if fp8:
            convert_to_fp8(draft, device)
        if mode == CompileMode.LAYERS:
            compile_draft_pointwise(draft)
        self._sums = self._per_depth_sums
        if mode.whole_step:
            if teacher_head is not None and mode == CompileMode.GRAPH:
                mark_static(teacher_head.draft_rows_VH, teacher_head.outside_rows_VH)
            self._sums = compile_whole_step(self._per_depth_sums, mode, compile_backend)

    def _per_depth_sums(
        self,
        features: Mapping[str, torch.Tensor],
        input_ids_BT: torch.Tensor,
        position_ids_BT: torch.Tensor,
        loss_mask_BT: torch.Tensor,
        doc_ids_BT: torch.Tensor,
        block_masks: list[Any] | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        mode = self.compile_mode
        with torch.no_grad():
            # Sparse scoring (not a whole-step graph): the teacher only where a prediction is
            # scored, i.e. at the positions whose next token is in the loss mask.
            needed = None if mode.whole_step else shift_left(loss_mask_BT.bool(), 1, False)
            teacher, valid = teacher_rows(
                self.teacher_mode, features, d2t=self.draft.d2t, t2d=self.draft.t2d, head=self.teacher_head,
                needed_BT=needed, input_ids_BT=input_ids_BT,
            )
        out = ttt_forward(
            self.draft, features[AUX], input_ids_BT, position_ids_BT, loss_mask_BT, teacher, valid,
            doc_ids_BT, self.ttt_length, attention=self.attention, loss_chunk=self.loss_chunk,
            # layers: the loss's chunk kernel compiled alone; whole step: traced with the rest.
            compile_loss=mode == CompileMode.LAYERS, dense=mode.whole_step, block_masks=block_masks,
        )
        return out.step_loss_sums, out.step_counts, out.step_correct

    def forward(
        self,
        features: Mapping[str, torch.Tensor],
        input_ids_BT: torch.Tensor,
        position_ids_BT: torch.Tensor,
        loss_mask_BT: torch.Tensor,
        doc_ids_BT: torch.Tensor,
    ) -> ObjectiveOutput:
        block_masks = None
        if self.compile_mode.whole_step and self.attention == "flex":
            # Built here, outside the compiled graph, whose inputs they become (FlexTTTAttention).
            config = self.draft.config
            block_masks = FlexTTTAttention(
                doc_ids_BT, position_ids_BT, config.sliding_window, self.ttt_length, compiled=False,
                window_mode=config.window_mode,
            ).all_block_masks()
        loss_sums, counts, correct = self._sums(
            features, input_ids_BT, position_ids_BT, loss_mask_BT, doc_ids_BT, block_masks
        )
        if self.compile_mode == CompileMode.GRAPH:
            # A CUDA graph's outputs are overwritten by its next replay (reading one afterwards
            # raises); the caller gets copies it may keep (21 scalars).
            loss_sums, counts, correct = ([t.clone() for t in ts] for ts in (loss_sums, counts, correct))
        return ObjectiveOutput(list(loss_sums), list(counts), list(correct))


class CandidateObjective(nn.Module):
    def __init__(self, draft: Eagle3Draft, ttt_length: int, num_candidates: int, attention: str = "auto") -> None:
        super().__init__()
        self.draft = draft
        self.ttt_length = ttt_length
        self.num_candidates = num_candidates
        self.attention = attention

    def forward(
        self,
        features: Mapping[str, torch.Tensor],
        input_ids_BT: torch.Tensor,
        position_ids_BT: torch.Tensor,
        loss_mask_BT: torch.Tensor,
        doc_ids_BT: torch.Tensor,
    ) -> ObjectiveOutput:
        with torch.no_grad():
            hidden = ttt_unroll(
                self.draft, features[AUX], input_ids_BT, position_ids_BT, doc_ids_BT, self.ttt_length,
                self.attention,
            )
        masks = ttt_step_masks(loss_mask_BT, doc_remaining_from_ids(doc_ids_BT), None, self.ttt_length)
        out = candidate_step_loss(self.draft, hidden, masks, self.num_candidates)
        return ObjectiveOutput(out.step_kl_sums, out.step_counts, out.step_hits)


def loss_denominators(
    normalization: str, global_counts: torch.Tensor, num_real_tokens: int, dist_state: Any
) -> torch.Tensor:
    """What each depth's loss sum is divided by (``TrainRecipe.loss_normalization``).

    ``scored``: the positions that depth scores over all ranks, so every step weighs the same and
    a step with few scored tokens gives each of them a large weight. ``tokens``: the step's real
    tokens over all ranks, the same for every depth, so every scored token weighs the same
    whatever else its step holds (SpecForge's mean over all ``B*T`` positions, without counting
    padding)."""
    if normalization == "scored":
        return global_counts
    if normalization != "tokens":
        raise ValueError(f"loss_normalization must be 'scored' or 'tokens', not {normalization!r}")
    from pipelines.train.distributed import all_reduce_

    # Filled on the device: torch.tensor(..., device="cuda") would wait for the stream every step.
    real = torch.full((1,), float(num_real_tokens), dtype=torch.float64, device=global_counts.device)
    return all_reduce_(real, dist_state).expand_as(global_counts)


def objective_loss(
    out: ObjectiveOutput, global_counts: torch.Tensor, decay: float, normalise_weights: bool,
    world_size: int = 1,
) -> torch.Tensor:
    """``sum_i decay**i * loss_sum_i / global_count_i`` (divided by the weights' sum when
    ``normalise_weights``: the candidate head's KL), times ``world_size`` because DDP averages
    gradients over ranks while the global counts already divide by every rank's positions."""
    weights = [decay**i for i in range(len(out.loss_sums))]
    loss = sum(
        w * s / global_counts[i].clamp(min=1).to(s.dtype)
        for i, (w, s) in enumerate(zip(weights, out.loss_sums, strict=True))
    )
    if normalise_weights:
        loss = loss / sum(weights)
    return loss * world_size  # type: ignore[return-value]
