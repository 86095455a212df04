"""The teacher distribution from each target-distribution feature, against the definition:
the full softmax, restricted to the draft vocabulary, renormalised; valid iff the argmax is inside."""

from __future__ import annotations

import pytest
import torch

from pipelines.train.teacher import (
    build_teacher,
    teacher_from_draft_probs,
    teacher_from_final_hidden,
    teacher_from_topk,
    teacher_rows,
)
from pipelines.train.teacher_mode import TeacherMode
from pipelines.train.vocab import DraftVocab

V, H, V_DRAFT = 50, 16, 20


@pytest.fixture()
def setup():
    gen = torch.Generator().manual_seed(0)
    lm_head = torch.randn(V, H, generator=gen, dtype=torch.float64)
    hidden = torch.randn(3, 7, H, generator=gen, dtype=torch.float64)
    vocab = DraftVocab.from_target_ids(torch.randperm(V, generator=gen)[:V_DRAFT].tolist(), V)
    # Force a few positions to have their argmax inside the draft vocabulary.
    inside = vocab.target_ids[0]
    hidden[0, :3] = 5 * lm_head[inside] / lm_head[inside].norm()
    return lm_head, hidden, vocab


def definition(full_logits, vocab):
    probs = torch.softmax(full_logits, -1)[..., vocab.target_ids]
    valid = vocab.t2d[full_logits.argmax(-1)]
    return probs / probs.sum(-1, keepdim=True), valid


def test_final_hidden_matches_the_definition_with_chunked_argmax(setup):
    lm_head, hidden, vocab = setup
    teacher = teacher_from_final_hidden(hidden, lm_head, vocab.d2t, vocab.t2d, vocab_chunk=7)
    probs, valid = definition(hidden @ lm_head.T, vocab)
    torch.testing.assert_close(teacher.probs_BTV.double(), probs, rtol=1e-6, atol=1e-7)
    assert torch.equal(teacher.valid_BT, valid)
    assert valid.any() and not valid.all(), "the case must have both valid and invalid positions"


def test_final_hidden_full_vocabulary_is_all_valid(setup):
    lm_head, hidden, _ = setup
    full = DraftVocab.full(V)
    teacher = teacher_from_final_hidden(hidden, lm_head, full.d2t, full.t2d)
    torch.testing.assert_close(
        teacher.probs_BTV.double(), torch.softmax(hidden @ lm_head.T, -1), rtol=1e-6, atol=1e-7
    )
    assert teacher.valid_BT.all()


def test_topk_matches_the_definition_on_the_kept_logits(setup):
    lm_head, hidden, vocab = setup
    logits = hidden @ lm_head.T
    k = 8
    top = logits.topk(k, dim=-1)
    order = torch.randperm(k)  # the teacher must not assume sorted top-k
    teacher = teacher_from_topk(
        top.values[..., order].float(), top.indices[..., order].int(), vocab.d2t, vocab.t2d
    )
    truncated = torch.full_like(logits, float("-inf")).scatter(-1, top.indices, top.values)
    probs, valid = definition(truncated, vocab)
    assert torch.equal(teacher.valid_BT, valid)
    torch.testing.assert_close(
        teacher.probs_BTV[valid].double(), probs[valid], rtol=1e-5, atol=1e-6
    )
    assert (teacher.probs_BTV[~valid] == 0).all()


def test_draft_probs_unrenormalised_and_renormalised(setup):
    lm_head, hidden, vocab = setup
    logits = hidden @ lm_head.T
    probs, valid = definition(logits, vocab)
    restricted = torch.softmax(logits, -1)[..., vocab.target_ids]
    teacher = teacher_from_draft_probs(restricted)
    torch.testing.assert_close(teacher.probs_BTV.double(), probs, rtol=1e-6, atol=1e-7)
    # Sound: a position marked valid certainly has its argmax inside the draft vocabulary.
    assert not (teacher.valid_BT & ~valid).any()
    assert teacher.valid_BT[:, :3].any()
    assert teacher_from_draft_probs(probs).valid_BT.all()


def test_build_teacher_dispatch_and_errors(setup):
    lm_head, hidden, vocab = setup
    teacher = build_teacher(
        TeacherMode.FINAL_HIDDEN,
        {"final_hidden_state": hidden},
        d2t=vocab.d2t,
        t2d=vocab.t2d,
        lm_head_VH=lm_head,
    )
    assert teacher.probs_BTV.shape == (3, 7, V_DRAFT)
    with pytest.raises(ValueError, match="needs the target's lm_head weight"):
        build_teacher(TeacherMode.FINAL_HIDDEN, {"final_hidden_state": hidden}, d2t=vocab.d2t, t2d=vocab.t2d)
    with pytest.raises(ValueError, match="draft_probs cover 5 ids but the draft vocabulary has 20"):
        build_teacher(
            TeacherMode.DRAFT_PROBS, {"draft_probs": torch.rand(1, 2, 5)}, d2t=vocab.d2t, t2d=vocab.t2d
        )
    with pytest.raises(ValueError, match="unknown teacher mode 'logits' \\(final_hidden, topk, draft_probs, tokens\\)"):
        build_teacher("logits", {}, d2t=vocab.d2t, t2d=vocab.t2d)  # type: ignore[arg-type]


def test_tokens_teacher_is_one_hot_on_the_next_token_inside_the_draft_vocabulary(setup):
    """``teacher: tokens``: row j is one-hot on token j + 1; a row's last position and a next token
    outside the draft vocabulary are invalid. On a target's greedy answer the labels are the final
    state teacher's argmax wherever that teacher is valid: the data's labels then equal the target's."""
    lm_head, hidden, vocab = setup
    greedy_BT = (hidden @ lm_head.T).argmax(-1)  # token j is the target's argmax at j
    input_ids = torch.cat([torch.zeros(3, 1, dtype=torch.long), greedy_BT[:, :-1]], dim=1)
    rows, valid = teacher_rows(TeacherMode.TOKENS, {}, d2t=vocab.d2t, t2d=vocab.t2d, input_ids_BT=input_ids)
    inside = vocab.t2d[input_ids]
    assert torch.equal(valid[:, :-1], inside[:, 1:]) and not valid[:, -1].any()
    assert valid.any() and not valid.all()
    probs = rows.probs(torch.arange(3 * 7), torch.float32).reshape(3, 7, V_DRAFT)
    assert torch.equal(probs.sum(-1), valid.float())
    draft_ids = vocab.target_ids[probs.argmax(-1)]
    assert torch.equal(draft_ids[valid], input_ids.roll(-1, dims=1)[valid])
    exact = teacher_from_final_hidden(hidden, lm_head, vocab.d2t, vocab.t2d)
    both = valid & exact.valid_BT
    assert both.any()
    assert torch.equal(probs.argmax(-1)[both], exact.probs_BTV.argmax(-1)[both])
    with pytest.raises(ValueError, match="needs the batch's input_ids"):
        teacher_rows(TeacherMode.TOKENS, {}, d2t=vocab.d2t, t2d=vocab.t2d)
    # An id past the target's vocabulary (a mismatched tokenizer) is never a label.
    beyond = input_ids.clone()
    beyond[0, 1] = V
    _, valid_beyond = teacher_rows(TeacherMode.TOKENS, {}, d2t=vocab.d2t, t2d=vocab.t2d, input_ids_BT=beyond)
    assert not valid_beyond[0, 0] and torch.equal(valid_beyond[1:], valid[1:])
