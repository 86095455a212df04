"""The chunked linear soft cross-entropy equals the plain formula, values and gradients."""

from __future__ import annotations

import pytest
import torch

from pipelines.train.loss import linear_soft_cross_entropy
from pipelines.train.teacher import (
    DenseTeacherRows,
    FinalHiddenTeacherRows,
    TeacherHead,
    teacher_from_final_hidden,
    teacher_rows,
)
from pipelines.train.vocab import calibrate_vocab


def plain(x, w, probs_NV):
    logp = torch.log_softmax(x @ w.T, dim=-1)
    return -(probs_NV * logp).sum(), (logp.argmax(-1) == probs_NV.argmax(-1)).sum()


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
def test_values_and_gradients_equal_the_plain_formula(chunk):
    gen = torch.Generator().manual_seed(0)
    N, H, V = 50, 12, 33
    x = torch.randn(N, H, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=gen, dtype=torch.float64, requires_grad=True)
    probs = torch.softmax(2 * torch.randn(N + 5, V, generator=gen, dtype=torch.float64), -1)
    probs[3] = 0.0  # a row the teacher leaves out contributes nothing
    rows = torch.randperm(N + 5, generator=gen)[:N]
    ce, correct = linear_soft_cross_entropy(x, w, DenseTeacherRows(probs[None]), rows, chunk)
    want_ce, want_correct = plain(x, w, probs[rows])
    torch.testing.assert_close(ce, want_ce, rtol=1e-12, atol=1e-12)
    assert int(correct) == int(want_correct)
    (3.0 * ce).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (3.0 * want_ce).backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, w.grad, rtol=1e-10, atol=1e-12)


def _matmuls(graph_module: torch.fx.GraphModule) -> int:
    """Matmul calls in a dynamo graph, the autograd.Function's forward and backward bodies included."""
    import operator

    return sum(
        node.target in (torch.matmul, operator.matmul, torch.mm)
        for module in graph_module.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
    )


def test_a_traced_loss_takes_the_positions_in_one_chunk(monkeypatch):
    """Inside a compiled step the chunk loop would lower to one where-chain kernel over every
    chunk (loss.TRACED_CHUNK_ELEMENTS): traced, the loss is one chunk, and equals the chunked eager."""
    import pipelines.train.loss as loss_module

    gen = torch.Generator().manual_seed(0)
    N, H, V = 256, 12, 33
    monkeypatch.setattr(loss_module, "DEFAULT_CHUNK_ELEMENTS", 64 * V)  # eager: 4 chunks of 64
    x = torch.randn(N, H, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=gen, dtype=torch.float64, requires_grad=True)
    teacher = DenseTeacherRows(torch.softmax(torch.randn(1, N, V, generator=gen, dtype=torch.float64), -1))
    rows = torch.arange(N)

    def loss(x, w):
        return linear_soft_cross_entropy(x, w, teacher, rows, compiled=False)[0]

    graphs: list[torch.fx.GraphModule] = []

    def capture(graph_module, _inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    traced = torch.compile(loss, backend=capture, fullgraph=True)(x, w)
    # one chunk's logits, then grad_x and grad_w (4 chunks would trace 4 + 2)
    assert len(graphs) == 1 and _matmuls(graphs[0]) == 3
    traced.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    eager = loss(x, w)
    eager.backward()
    torch.testing.assert_close(traced, eager, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx, x.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, w.grad, rtol=1e-10, atol=1e-12)


def test_no_scored_positions_gives_zero_loss_and_gradients():
    x = torch.randn(0, 4, requires_grad=True)
    w = torch.randn(6, 4, requires_grad=True)
    ce, correct = linear_soft_cross_entropy(x, w, DenseTeacherRows(torch.ones(1, 2, 6) / 6), torch.zeros(0, dtype=torch.long))
    ce.backward()
    assert float(ce) == 0.0 and int(correct) == 0
    assert torch.count_nonzero(w.grad) == 0


def test_bf16_autocast_stays_close_to_float32():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 16, generator=gen, requires_grad=True)
    w = torch.randn(50, 16, generator=gen, requires_grad=True)
    probs = torch.softmax(torch.randn(1, 40, 50, generator=gen), -1)
    rows = torch.arange(40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ce, _ = linear_soft_cross_entropy(x, w, DenseTeacherRows(probs), rows, 16)
    assert ce.dtype == torch.float32
    want, _ = plain(x.double(), w.double(), probs[0].double())
    assert abs(float(ce) - float(want)) / float(want) < 2e-2


# The final-state teacher's small case: a target vocabulary of V ids, 24 of them the draft's.
V, H, B, T, V_DRAFT = 40, 8, 2, 9, 24


def _final_state_case(seed: int):
    """A target lm_head, final states [B, T, H], a calibrated draft vocabulary and its TeacherHead."""
    gen = torch.Generator().manual_seed(seed)
    lm_head = torch.randn(V, H, generator=gen)
    hidden = torch.randn(B, T, H, generator=gen)
    vocab = calibrate_vocab(torch.randint(0, 50, (V,), generator=gen), V_DRAFT)
    return lm_head, hidden, vocab, TeacherHead(lm_head, vocab.d2t, vocab.t2d)


def test_final_hidden_teacher_rows_equal_the_dense_teacher():
    lm_head, hidden, vocab, head = _final_state_case(2)
    dense = teacher_from_final_hidden(hidden, lm_head, vocab.d2t, vocab.t2d, vocab_chunk=7)
    rows, valid = teacher_rows("final_hidden", {"final_hidden_state": hidden}, d2t=vocab.d2t, t2d=vocab.t2d, head=head)
    assert isinstance(rows, FinalHiddenTeacherRows)
    assert torch.equal(valid, dense.valid_BT)
    assert 0 < int(valid.sum()) < B * T, "the case must have valid and invalid positions"
    index = torch.tensor([0, 5, 17, 3])
    torch.testing.assert_close(rows.probs(index, torch.float32), dense.probs_BTV.reshape(B * T, -1)[index])
    # Small chunks give the same validity.
    assert torch.equal(head.valid(hidden.reshape(B * T, H), chunk_elements=13), valid.reshape(-1))


def test_final_hidden_teacher_logits_are_computed_once_a_step():
    """Every depth reads its rows of one [N, V_draft] product (and the validity check maxes it):
    reading rows then multiplies nothing. Past ``once_elements`` the rows are computed per call,
    with the same values."""
    from torch.utils.flop_counter import FlopCounterMode

    _, hidden, _, head = _final_state_case(4)
    once = FinalHiddenTeacherRows(hidden, head)
    per_call = FinalHiddenTeacherRows(hidden, head, once_elements=B * T * V_DRAFT - 1)
    assert once.logits_NV is not None and per_call.logits_NV is None
    index = torch.tensor([0, 5, 17, 3, 5])
    with FlopCounterMode(display=False) as reading_once:
        depths_once = [once.logits((index + depth).clamp(max=B * T - 1), torch.float32) for depth in range(0, 7)]
        valid_once = once.valid()
    with FlopCounterMode(display=False) as reading_per_call:
        depths_per_call = [per_call.logits((index + depth).clamp(max=B * T - 1), torch.float32) for depth in range(0, 7)]
        valid_per_call = per_call.valid()
    for a, b in zip(depths_once, depths_per_call, strict=True):
        torch.testing.assert_close(a, b)
    assert torch.equal(valid_once, valid_per_call)
    # What is left once: the validity check's product over the ids outside the draft vocabulary.
    outside = 2 * B * T * H * (V - V_DRAFT)
    assert reading_once.get_total_flops() == outside
    assert reading_per_call.get_total_flops() == outside + 2 * H * V_DRAFT * (7 * len(index) + B * T)


def test_final_hidden_teacher_at_the_needed_positions_only():
    """Sparse scoring asks for the teacher where a next token is scored: the products run over
    those rows only, give the same logits and validity there, and every other position is invalid."""
    from torch.utils.flop_counter import FlopCounterMode

    _, hidden, _, head = _final_state_case(6)
    needed = torch.zeros(B * T, dtype=torch.bool)
    needed[[1, 2, 3, 10, 16]] = True
    full = FinalHiddenTeacherRows(hidden, head)
    with FlopCounterMode(display=False) as counting:
        sparse = FinalHiddenTeacherRows(hidden, head, needed_N=needed)
        valid = sparse.valid()
    assert counting.get_total_flops() == 2 * int(needed.sum()) * H * V  # draft rows once, the rest in the check
    rows = needed.nonzero().squeeze(1)
    torch.testing.assert_close(sparse.logits(rows.flip(0), torch.float32), full.logits(rows.flip(0), torch.float32))
    assert torch.equal(valid[needed], full.valid()[needed]) and not valid[~needed].any()
    # Past once_elements, rows come from the final state directly, by their global index.
    per_call = FinalHiddenTeacherRows(hidden, head, once_elements=0, needed_N=needed)
    assert per_call.logits_NV is None and torch.equal(per_call.valid(), valid)
    torch.testing.assert_close(per_call.logits(rows, torch.float32), full.logits(rows, torch.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("teacher_kind", ["final_hidden", "dense"])
def test_compiled_chunk_kernel_equals_eager_on_gpu(teacher_kind):
    gen = torch.Generator().manual_seed(3)
    N, H, V, VT = 700, 64, 500, 900
    x = torch.randn(N, H, generator=gen).cuda().requires_grad_(True)
    w = torch.randn(V, H, generator=gen).cuda().requires_grad_(True)
    rows = torch.arange(N, device="cuda")
    if teacher_kind == "final_hidden":
        lm_head = torch.randn(VT, H, generator=gen).cuda()
        counts = torch.randint(0, 50, (VT,), generator=gen)
        vocab = calibrate_vocab(counts, V)
        teacher = FinalHiddenTeacherRows(torch.randn(1, N, H, generator=gen).cuda(), TeacherHead(lm_head, vocab.d2t, vocab.t2d))
    else:
        teacher = DenseTeacherRows(torch.softmax(torch.randn(1, N, V, generator=gen), -1).cuda())
    results = []
    for compiled in (False, True):
        x.grad = w.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ce, correct = linear_soft_cross_entropy(x, w, teacher, rows, chunk=256, compiled=compiled)
        ce.backward()
        results.append((ce.detach(), int(correct), x.grad.clone(), w.grad.clone()))
    (ce0, c0, gx0, gw0), (ce1, c1, gx1, gw1) = results
    torch.testing.assert_close(ce1, ce0, rtol=1e-5, atol=1e-3)
    assert abs(c1 - c0) <= 2  # argmax ties may break differently in bf16
    torch.testing.assert_close(gx1, gx0, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gw1, gw0, rtol=2e-2, atol=2e-3)
