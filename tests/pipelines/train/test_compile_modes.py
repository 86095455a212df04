"""The compiled training step (``compile: step`` / ``graph``) computes what the eager one does.

``step`` traces the objective's whole forward as one graph and scores every position densely;
these tests compare it with the eager objective on the CPU: the dense scoring alone (eager), the
traced graph through ``aot_eager`` (dynamo and AOTAutograd without a compiler toolchain: the
graph is the one inductor would get, and ``fullgraph`` fails on any break). The ``gpu`` test
compiles the real thing with inductor, flex attention included, and replays it as CUDA graphs.
(Inductor on the CPU also matches eager within float32 rounding, run by hand: ~9 minutes of C++
compilation on a 2-core VM, too slow for the suite; with flex attention and its masks built
outside the graph, the forward compiles and matches in ~100 s. With the masks built inside, it
failed in inductor's flex lowering, on the CPU as on the H200.)
"""

from __future__ import annotations

import pytest
import torch

from pipelines.train.compile_modes import CompileMode, check_compile_mode, resolve_compile_mode
from pipelines.train.objective import DraftObjective, objective_loss
from pipelines.train.teacher import TeacherHead
from pipelines.train.teacher_mode import TeacherMode
from pipelines.train.ttt import ttt_forward
from tests.pipelines.train.test_ttt import packed_batch, ttt_draft


def _grads(draft: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in draft.named_parameters() if p.grad is not None}


def _step(objective: DraftObjective, inputs: tuple, decay: float = 0.8) -> tuple[list[float], list[int], list[int], dict]:
    """One forward and backward: per-depth loss sums, counts, matches, and the gradients."""
    objective.draft.zero_grad(set_to_none=True)
    out = objective(*inputs)
    objective_loss(out, torch.stack(out.counts).double(), decay, False).backward()
    sums = [float(s.detach()) for s in out.loss_sums]
    return sums, [int(c) for c in out.counts], [int(c) for c in out.correct], _grads(objective.draft)


def _draft_probs_inputs(draft, doc_lengths=((9, 5), (3, 11)), seed=3):
    aux, ids, pos, loss_mask, teacher, valid, docs = packed_batch(draft, [list(r) for r in doc_lengths], seed=seed)
    features = {"aux_hidden_states": aux, "draft_probs": teacher * valid[..., None]}
    return features, ids, pos, loss_mask, docs


def _final_hidden_inputs(draft, seed=5):
    """A final-state teacher through a target lm_head whose argmax is outside the draft
    vocabulary at some positions (so the teacher's validity check matters)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = draft.config
    aux, ids, pos, loss_mask, _, _, docs = packed_batch(draft, [[8, 6], [14]], seed=seed)
    final = torch.randn(*ids.shape, cfg.target_hidden_size, generator=gen, dtype=torch.float64)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=gen, dtype=torch.float64)
    head = TeacherHead(lm_head, draft.d2t, draft.t2d)
    return head, ({"aux_hidden_states": aux, "final_hidden_state": final}, ids, pos, loss_mask, docs)


def _assert_same_step(got, want, rtol=1e-9, atol=1e-12) -> None:
    sums, counts, correct, grads = got
    want_sums, want_counts, want_correct, want_grads = want
    assert counts == want_counts and correct == want_correct
    torch.testing.assert_close(torch.tensor(sums), torch.tensor(want_sums), rtol=rtol, atol=atol)
    assert grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=rtol, atol=atol, msg=name)


# ---- dense scoring (what the compiled step computes), eager --------------------------------------


@pytest.mark.parametrize("window", [None, 4])
def test_dense_scoring_equals_gathering_the_scored_positions(window) -> None:
    draft = ttt_draft(window)
    aux, ids, pos, loss_mask, teacher, valid, docs = packed_batch(draft, [[2, 1, 7, 3], [6, 4]])
    outs = [ttt_forward(draft, aux, ids, pos, loss_mask, teacher, valid, docs, ttt_length=4, dense=dense)
            for dense in (False, True)]
    sparse, dense = outs
    assert [int(c) for c in dense.step_counts] == [int(c) for c in sparse.step_counts]
    assert sum(int(c) for c in sparse.step_counts[1:]) > 0, "the case must score deeper steps"
    assert [int(c) for c in dense.step_correct] == [int(c) for c in sparse.step_correct]
    for a, b in zip(dense.step_loss_sums, sparse.step_loss_sums, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    grads = [torch.autograd.grad(out.loss, [draft.fc.weight, draft.lm_head.weight]) for out in outs]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_dense_scoring_with_nothing_scored_is_zero_not_nan() -> None:
    draft = ttt_draft()
    aux, ids, pos, _, teacher, valid, docs = packed_batch(draft, [[9]])
    nothing = torch.zeros_like(ids, dtype=torch.bool)
    out = ttt_forward(draft, aux, ids, pos, nothing, teacher, valid, docs, ttt_length=3, dense=True)
    assert [int(c) for c in out.step_counts] == [0, 0, 0] and [int(c) for c in out.step_correct] == [0, 0, 0]
    assert out.loss.item() == 0.0
    assert not torch.autograd.grad(out.loss, draft.fc.weight)[0].any()


# ---- the whole step traced as one graph -------------------------------------------------------


def test_traced_step_equals_eager_and_serves_every_batch_of_its_shape() -> None:
    """Two batches of one row shape (other documents, masks, tokens, teacher) run one graph, and
    both equal eager: nothing of a batch's documents is baked into it."""
    torch._dynamo.reset()
    draft = ttt_draft(sliding_window=5)
    eager = DraftObjective(draft, TeacherMode.DRAFT_PROBS, None, ttt_length=3, attention="eager")
    compiled = DraftObjective(draft, TeacherMode.DRAFT_PROBS, None, ttt_length=3, compile="step",
                              compile_backend="aot_eager")
    assert compiled.attention == "eager"  # auto on the CPU: the dense-mask reference, traceable
    from torch._dynamo.utils import counters

    counters.clear()
    for lengths, seed in (([[9, 5], [3, 11]], 3), ([[4, 4, 6], [14]], 4)):
        inputs = _draft_probs_inputs(draft, lengths, seed)
        _assert_same_step(_step(compiled, inputs), _step(eager, inputs))
    assert counters["stats"]["unique_graphs"] == 1


def test_a_new_draft_of_the_same_shape_reuses_the_compiled_step() -> None:
    """Runs one after another in a process (a sequential sweep): each builds its own draft and
    objective; dynamo lifts the parameters as graph inputs, so the step is traced once, and each
    new draft still equals its eager step."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    for seed in range(3):
        draft = ttt_draft(seed=seed)
        eager = DraftObjective(draft, TeacherMode.DRAFT_PROBS, None, ttt_length=3, attention="eager")
        compiled = DraftObjective(draft, TeacherMode.DRAFT_PROBS, None, ttt_length=3, compile="step",
                                  compile_backend="aot_eager")
        inputs = _draft_probs_inputs(draft, seed=seed)
        _assert_same_step(_step(compiled, inputs), _step(eager, inputs))
    assert counters["stats"]["unique_graphs"] == 1


def test_traced_step_equals_eager_with_the_final_state_teacher() -> None:
    """The final-state teacher (its validity over the target vocabulary traced too), EAGLE-3.1's
    norms, and ``graph`` mode's copies of the outputs (CUDA-graph replay itself is CUDA's)."""
    torch._dynamo.reset()
    draft = ttt_draft(fc_norm=True, norm_output=True)
    head, inputs = _final_hidden_inputs(draft)
    eager = DraftObjective(draft, TeacherMode.FINAL_HIDDEN, head, ttt_length=4, attention="eager")
    want = _step(eager, inputs)
    assert 0 < want[1][0] < inputs[1].numel(), "some positions must be unscored (mask, validity)"
    compiled = DraftObjective(draft, TeacherMode.FINAL_HIDDEN, head, ttt_length=4, compile="graph",
                              compile_backend="aot_eager")
    _assert_same_step(_step(compiled, inputs), want)


def test_flex_attention_traces_into_the_step_with_masks_built_outside() -> None:
    """On CUDA the step traces flex attention; each depth's BlockMask is built eagerly from the
    batch's documents and enters the graph as an input (inductor cannot lower a mask computed in
    the same graph). Two batches of other documents run one graph: nothing of a batch's masks is
    baked in. Flex has no backward on the CPU, so this compares the forward."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    draft = ttt_draft(sliding_window=5).float()
    eager = DraftObjective(draft, TeacherMode.DRAFT_PROBS, None, ttt_length=3, attention="eager")
    compiled = DraftObjective(draft, TeacherMode.DRAFT_PROBS, None, ttt_length=3, attention="flex", compile="step",
                              compile_backend="aot_eager")
    for lengths, seed in (([[150, 90], [60, 180]], 3), ([[240], [20, 100, 120]], 4)):
        features, ids, pos, loss_mask, docs = _draft_probs_inputs(draft, lengths, seed)
        inputs = ({k: v.float() for k, v in features.items()}, ids, pos, loss_mask, docs)
        with torch.no_grad():
            want, got = eager(*inputs), compiled(*inputs)
        assert [int(c) for c in got.counts] == [int(c) for c in want.counts]
        torch.testing.assert_close(torch.stack(got.loss_sums), torch.stack(want.loss_sums), rtol=1e-5, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1


def test_segmented_attention_cannot_be_traced() -> None:
    with pytest.raises(ValueError, match="segmented reads each row's document bounds on the host"):
        DraftObjective(ttt_draft(), TeacherMode.DRAFT_PROBS, None, ttt_length=3, attention="segmented", compile="step")


# ---- choosing a mode ----------------------------------------------------------------------------


def test_auto_is_off_on_the_cpu_and_on_means_layers() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_compile_mode("auto", cpu) == CompileMode.OFF
    assert resolve_compile_mode("auto", cuda) == CompileMode.GRAPH
    assert resolve_compile_mode("on", cpu) == CompileMode.LAYERS
    assert resolve_compile_mode(True, cpu) == CompileMode.LAYERS
    assert resolve_compile_mode("graph", cpu) == CompileMode.GRAPH
    with pytest.raises(ValueError, match="unknown compile mode 'fast'"):
        resolve_compile_mode("fast", cpu)


def test_auto_never_picks_graph_where_graph_is_refused(monkeypatch) -> None:
    import pipelines.train.compile_modes as modes

    cuda = torch.device("cuda")
    assert modes.CUDA_DEFAULT == CompileMode.GRAPH
    assert resolve_compile_mode("auto", cuda) == CompileMode.GRAPH
    assert resolve_compile_mode("auto", cuda, world_size=2) == CompileMode.STEP
    assert resolve_compile_mode("auto", cuda, grad_accum_steps=4) == CompileMode.STEP
    assert resolve_compile_mode("auto", cuda, fp8=True) == CompileMode.STEP  # graph replay re-records the FP8 step
    assert resolve_compile_mode("graph", cuda, fp8=True) == CompileMode.GRAPH  # asked for, it is what is run
    assert resolve_compile_mode("graph", cuda, world_size=2) == CompileMode.GRAPH  # asked for: refused later
    monkeypatch.setattr(modes, "CUDA_DEFAULT", CompileMode.LAYERS)  # another default is kept as it is
    assert resolve_compile_mode("auto", cuda, world_size=2) == CompileMode.LAYERS


def test_auto_picks_layers_for_a_store_whose_loss_scores_few_tokens() -> None:
    """A whole-step mode computes the heads' logits at every position; below
    GRAPH_MIN_SCORED_FRACTION the per-position gathering of layers costs less."""
    from pipelines.train.compile_modes import GRAPH_MIN_SCORED_FRACTION

    cuda = torch.device("cuda")
    low, high = GRAPH_MIN_SCORED_FRACTION - 0.01, GRAPH_MIN_SCORED_FRACTION
    assert resolve_compile_mode("auto", cuda, scored_fraction=0.23) == CompileMode.LAYERS
    assert resolve_compile_mode("auto", cuda, scored_fraction=low) == CompileMode.LAYERS
    assert resolve_compile_mode("auto", cuda, scored_fraction=high) == CompileMode.GRAPH
    assert resolve_compile_mode("auto", cuda, world_size=2, scored_fraction=0.9) == CompileMode.STEP
    assert resolve_compile_mode("auto", cuda, world_size=2, scored_fraction=0.2) == CompileMode.LAYERS
    assert resolve_compile_mode("auto", torch.device("cpu"), scored_fraction=0.9) == CompileMode.OFF
    assert resolve_compile_mode("graph", cuda, scored_fraction=0.1) == CompileMode.GRAPH  # asked for: kept


def test_the_scored_fraction_is_read_from_a_few_shards(tmp_path) -> None:
    import hsstore
    from pipelines.train.stages import scored_token_fraction
    from tests.support.stores import write_store

    samples = write_store(str(tmp_path / "store"), num_samples=40, shard_max_tokens=120)
    store = hsstore.open_store(str(tmp_path / "store"))
    assert len(store.shards) > 8
    exact = sum(int(s["loss_mask"].sum()) for s in samples) / sum(len(s["input_ids"]) for s in samples)
    assert scored_token_fraction(store, max_shards=len(store.shards)) == pytest.approx(exact)
    estimate = scored_token_fraction(store)  # 8 of the shards
    assert 0 < estimate < 1 and abs(estimate - exact) < 0.25


def test_graph_mode_is_refused_where_replay_would_be_wrong() -> None:
    check_compile_mode(CompileMode.GRAPH, torch.device("cuda"), world_size=1, grad_accum_steps=1)
    check_compile_mode(CompileMode.STEP, torch.device("cpu"), world_size=4, grad_accum_steps=8)
    with pytest.raises(ValueError, match=r"needs CUDA \(device is cpu\).*world size 2.*grad_accum_steps=4.*compile: step"):
        check_compile_mode(CompileMode.GRAPH, torch.device("cpu"), world_size=2, grad_accum_steps=4)


def test_graph_mode_with_fp8_runs_but_says_it_re_records(caplog: pytest.LogCaptureFixture) -> None:
    cuda = torch.device("cuda")
    with caplog.at_level("WARNING", logger="pipelines.train.compile_modes"):
        check_compile_mode(CompileMode.GRAPH, cuda, world_size=1, grad_accum_steps=1)
        assert not caplog.records
        check_compile_mode(CompileMode.STEP, cuda, world_size=1, grad_accum_steps=1, fp8=True)
        assert not caplog.records
        check_compile_mode(CompileMode.GRAPH, cuda, world_size=1, grad_accum_steps=1, fp8=True)
    assert "re-records its CUDA graphs at every step" in caplog.text and "compile: auto picks step" in caplog.text


def test_traced_step_equals_eager_with_the_records_own_tokens_as_labels() -> None:
    """``teacher: tokens`` (one-hot on each next token, invalid outside the draft vocabulary and at
    a row's end) traces into the whole step and equals eager."""
    torch._dynamo.reset()
    draft = ttt_draft()
    _, (features, ids, pos, loss_mask, docs) = _final_hidden_inputs(draft, seed=6)
    inputs = ({"aux_hidden_states": features["aux_hidden_states"]}, ids, pos, loss_mask, docs)
    eager = DraftObjective(draft, TeacherMode.TOKENS, None, ttt_length=3, attention="eager")
    want = _step(eager, inputs)
    assert 0 < want[1][0] < ids.numel(), "some positions must be unscored (mask, vocabulary)"
    compiled = DraftObjective(draft, TeacherMode.TOKENS, None, ttt_length=3, compile="step",
                              compile_backend="aot_eager")
    _assert_same_step(_step(compiled, inputs), want)


# ---- the GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["step", "graph"])
def test_compiled_step_equals_eager_on_gpu(mode) -> None:
    """Flex attention, bf16 autocast and inductor's kernels; bf16 rounding differs between the
    fused and the eager kernels, so the comparison is loose but catches any wrong term."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch._dynamo.reset()
    # Flex attention's CUDA kernels need a head dimension of at least 16 (the CPU tests use 8).
    draft = ttt_draft(sliding_window=64, hidden_size=64, head_dim=16).float().cuda()
    features, ids, pos, loss_mask, docs = _draft_probs_inputs(draft, [[150, 90], [60, 180]])
    inputs = ({k: v.float().cuda() for k, v in features.items()}, ids.cuda(), pos.cuda(), loss_mask.cuda(), docs.cuda())

    def run(objective):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return _step(objective, inputs)

    want = run(DraftObjective(draft, TeacherMode.DRAFT_PROBS, None, ttt_length=3, compile="layers"))
    compiled = DraftObjective(draft, TeacherMode.DRAFT_PROBS, None, ttt_length=3, compile=mode)
    for _ in range(3):  # graph: warm-up, record, replay
        got = run(compiled)
        assert got[1] == want[1]
        torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=2e-2, atol=1e-2)
        for name, grad in want[3].items():
            cos = torch.nn.functional.cosine_similarity(got[3][name].flatten().double(), grad.flatten().double(), dim=0)
            assert cos > 0.99, name
