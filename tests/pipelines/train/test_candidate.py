"""EAGLE-4 stage 2: SVD initialisation, the depth-weighted KL, recall@K, and that training helps."""

from __future__ import annotations

import pytest
import torch

from pipelines.train.candidate import attach_candidate_head, candidate_step_loss, svd_factors
from pipelines.train.ttt import doc_remaining_from_ids, ttt_step_masks, ttt_unroll
from tests.pipelines.models.helpers import random_inputs
from tests.support.models import tiny_draft


def unrolled(draft, length=24, ttt_length=3):
    aux, ids, pos = random_inputs(draft, batch=2, length=length)
    docs = torch.zeros_like(ids)
    with torch.no_grad():
        hidden = ttt_unroll(draft, aux, ids, pos, docs, ttt_length)
    masks = ttt_step_masks(
        torch.ones_like(ids, dtype=torch.bool), doc_remaining_from_ids(docs), None, ttt_length
    )
    return hidden, masks


def test_svd_factors_are_the_best_low_rank_approximation():
    weight = torch.randn(40, 12)
    up, down = svd_factors(weight, 12)
    torch.testing.assert_close(up @ down, weight, rtol=1e-4, atol=1e-5)
    up, down = svd_factors(weight, 3)
    assert up.shape == (40, 3) and down.shape == (3, 12)
    singular = torch.linalg.svdvals(weight)
    # Eckart-Young: the residual's Frobenius norm is the norm of the dropped singular values.
    torch.testing.assert_close(
        torch.linalg.norm(weight - up @ down), singular[3:].norm(), rtol=1e-4, atol=1e-5
    )
    with pytest.raises(
        ValueError, match=r"candidate rank 13 must be in \[1, min\(V_draft=40, H=12\)\]"
    ):
        svd_factors(weight, 13)


def test_attach_freezes_the_draft_and_full_rank_is_exact():
    draft = tiny_draft()
    head = attach_candidate_head(draft, rank=draft.config.hidden_size, num_candidates=1)
    assert draft.config.candidate_rank == 64 and draft.config.num_candidates == 1
    trainable = {name for name, p in draft.named_parameters() if p.requires_grad}
    assert trainable == {"candidate_head.down_proj.weight", "candidate_head.up_proj.weight"}
    assert head.up_proj.weight.shape == (draft.config.draft_vocab_size, 64)
    hidden, masks = unrolled(draft)
    out = candidate_step_loss(draft, hidden, masks)
    assert all(r.item() == 1.0 for r in out.step_recalls)
    assert out.loss.item() < 1e-6
    assert [int(c) for c in out.step_counts] == [44, 42, 40]  # 2 rows x (24 - 2 - depth)


def test_loss_is_the_normalised_depth_weighted_kl_and_recall_counts_hits():
    draft = tiny_draft()
    attach_candidate_head(draft, rank=2, num_candidates=5)
    hidden, masks = unrolled(draft)
    out = candidate_step_loss(draft, hidden, masks, decay=0.5)
    weights = [1.0, 0.5, 0.25]
    expected = sum(w * kl for w, kl in zip(weights, out.step_kls, strict=True)) / sum(weights)
    torch.testing.assert_close(out.loss, expected)
    # Brute force for depth 1: KL(full || low) per position and whether the full top-1 is in the top 5.
    with torch.no_grad():
        normed = draft.norm(hidden[1][masks[1]])
        full = torch.log_softmax(draft.lm_head(normed), -1)
        low = torch.log_softmax(draft.candidate_head(normed), -1)
        kls = [(full[n].exp() * (full[n] - low[n])).sum() for n in range(full.shape[0])]
        hits = [
            int(full[n].argmax()) in low[n].topk(5).indices.tolist() for n in range(full.shape[0])
        ]
    torch.testing.assert_close(out.step_kls[1], torch.stack(kls).mean())
    assert out.step_hits[1].item() == sum(hits)
    assert 0 < out.step_recalls[1].item() < 1


def test_training_the_factors_lowers_kl_and_raises_recall():
    draft = tiny_draft()
    with (
        torch.no_grad()
    ):  # a peaked full head, as a trained draft has (a random one is near-uniform)
        draft.lm_head.weight.mul_(20)
    head = attach_candidate_head(draft, rank=4, num_candidates=4)
    # Randomise the start so the test measures learning, not the SVD initialisation.
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(std=0.05)
    hidden, masks = unrolled(draft)
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-2)
    first = candidate_step_loss(draft, hidden, masks)
    for _ in range(40):
        optimizer.zero_grad()
        candidate_step_loss(draft, hidden, masks).loss.backward()
        optimizer.step()
    last = candidate_step_loss(draft, hidden, masks)
    assert last.loss.item() < 0.5 * first.loss.item()
    assert all(r.item() < 0.1 for r in first.step_recalls)
    assert all(r.item() > 0.9 for r in last.step_recalls)
    assert draft.lm_head.weight.grad is None  # the draft stays frozen


def test_errors_without_a_head_or_a_candidate_count():
    draft = tiny_draft()
    hidden, masks = unrolled(draft)
    with pytest.raises(ValueError, match="call attach_candidate_head first"):
        candidate_step_loss(draft, hidden, masks)
    with pytest.raises(ValueError, match="num_candidates=500 exceeds draft_vocab_size=96"):
        attach_candidate_head(draft, rank=4, num_candidates=500)
