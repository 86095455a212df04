"""EAGLE-4 stage 2: a rank-r candidate head distilled from the frozen draft's full lm_head.

The server computes ``up(down(norm(h)))`` (two thin matrices, r*(H + V_draft) MACs instead of
H*V_draft), takes its top K candidates and rescores only those with the full head. So what matters
is candidate recall@K: how often the full head's top-1 is among the low-rank head's top K.

Following NeMo's recipe (docs/design.md), the factors start from the truncated SVD of the draft's
lm_head (the best rank-r approximation in Frobenius norm, so recall is already high at step 0)
and are fitted by forward KL(full || low-rank) at every TTT depth, weighted ``decay**i`` and
normalised by the weights' sum, so the loss scale does not depend on the unroll length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipelines.models.eagle3 import CandidateHead, Eagle3Draft

DEFAULT_DECAY = 0.8


def svd_factors(lm_head_VH: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(up [V, r], down [r, H])`` with ``up @ down`` the best rank-r approximation of the head.

    The singular values are split evenly (sqrt on each side) so both factors have similar scale,
    which keeps their AdamW updates balanced."""
    V, H = lm_head_VH.shape
    if not 0 < rank <= min(V, H):
        raise ValueError(f"candidate rank {rank} must be in [1, min(V_draft={V}, H={H})]")
    U, S, Vh = torch.linalg.svd(lm_head_VH.detach().float(), full_matrices=False)
    root = S[:rank].sqrt()
    return U[:, :rank] * root, root[:, None] * Vh[:rank]


def attach_candidate_head(draft: Eagle3Draft, rank: int, num_candidates: int) -> CandidateHead:
    """Give ``draft`` a candidate head initialised from the SVD of its lm_head, record rank and K
    in its config (so save/export carry them), and freeze everything else."""
    if num_candidates > draft.config.draft_vocab_size:
        raise ValueError(
            f"num_candidates={num_candidates} exceeds draft_vocab_size={draft.config.draft_vocab_size}"
        )
    up, down = svd_factors(draft.lm_head.weight, rank)
    head = CandidateHead(draft.config.hidden_size, draft.config.draft_vocab_size, rank)
    with torch.no_grad():
        head.up_proj.weight.copy_(up)
        head.down_proj.weight.copy_(down)
    head = head.to(device=draft.lm_head.weight.device, dtype=draft.lm_head.weight.dtype)
    draft.config = draft.config.model_copy(
        update={"candidate_rank": rank, "num_candidates": num_candidates}
    )
    draft.candidate_head = head
    for param in draft.parameters():
        param.requires_grad_(False)
    for param in head.parameters():
        param.requires_grad_(True)
    return head


@dataclass
class CandidateOutput:
    loss: torch.Tensor  # scalar: sum_i w_i * KL_i / sum_i w_i, w_i = decay**i
    step_kls: list[torch.Tensor]  # masked mean KL(full || low-rank) per depth
    step_recalls: list[torch.Tensor]  # recall@K per depth
    step_counts: list[torch.Tensor]  # positions scored per depth
    step_kl_sums: list[torch.Tensor]  # un-normalised KL sums (for exact DDP averaging)
    step_hits: list[torch.Tensor]  # full top-1 found in the low-rank top K, per depth


def candidate_step_loss(
    draft: Eagle3Draft,
    hidden_per_step: list[torch.Tensor],
    step_masks: list[torch.Tensor],
    num_candidates: int | None = None,
    decay: float = DEFAULT_DECAY,
) -> CandidateOutput:
    """KL loss and recall@K of ``draft.candidate_head`` against ``draft.lm_head``.

    ``hidden_per_step`` and ``step_masks`` come from the frozen draft's TTT unroll
    (``pipelines.train.ttt.ttt_forward`` / ``ttt_unroll`` + ``ttt_step_masks``, run under
    ``torch.no_grad()``). Only the candidate head receives gradients.
    """
    head = draft.candidate_head
    if head is None:
        raise ValueError("the draft has no candidate head: call attach_candidate_head first")
    k = num_candidates or draft.config.num_candidates
    if k is None:
        raise ValueError("num_candidates is not given and not in the draft's config")
    weights = [decay**i for i in range(len(hidden_per_step))]
    total = None
    out = CandidateOutput(torch.zeros(()), [], [], [], [], [])
    for weight, hidden, mask in zip(weights, hidden_per_step, step_masks, strict=True):
        with torch.no_grad():
            normed = draft.head_input(hidden[mask].detach())
            full_logp = F.log_softmax(draft.lm_head(normed).float(), dim=-1)
        cand_logits = head(normed).float()
        kl_sum = (full_logp.exp() * (full_logp - F.log_softmax(cand_logits, dim=-1))).sum()
        count = mask.sum()
        with torch.no_grad():
            top_k = cand_logits.topk(min(k, cand_logits.shape[-1]), dim=-1).indices
            hits = (top_k == full_logp.argmax(-1, keepdim=True)).any(-1).sum()
        step_kl = kl_sum / count.clamp(min=1)
        total = weight * step_kl if total is None else total + weight * step_kl
        out.step_kls.append(step_kl)
        out.step_kl_sums.append(kl_sum)
        out.step_counts.append(count)
        out.step_hits.append(hits)
        out.step_recalls.append(hits.float() / count.clamp(min=1))
    assert total is not None, "hidden_per_step is empty"
    out.loss = total / sum(weights)
    return out
