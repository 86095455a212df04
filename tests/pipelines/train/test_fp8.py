"""FP8 draft training (``fp8: true``): ``torch._scaled_mm`` against a float emulation of the same
quantization (scale by the tensor's amax, cast to float8 and back, multiply in float64), the
layer swap, and a training step that stays close to the float32 one. torch's CPU build runs
``_scaled_mm`` (checked by the first tests); the ``gpu`` test runs the real kernels on CUDA."""

from __future__ import annotations

import pytest
import torch

import pipelines.train.fp8 as fp8
from pipelines.train.fp8 import (
    ALL_LINEARS,
    ATTENTION_LINEARS,
    FP8_LINEARS,
    MLP_LINEARS,
    Float8Linear,
    Fp8UnsupportedError,
    convert_to_fp8,
    fp8_linear,
    quantize,
)
from pipelines.train.objective import DraftObjective, objective_loss
from pipelines.train.teacher_mode import TeacherMode
from tests.pipelines.train.test_ttt import packed_batch, ttt_draft
from tests.support.models import build_draft, tiny_draft_config

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def emulate(t: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """What the FP8 copy of ``t`` stands for, in float64: scaled so that its amax is the format's
    largest value, rounded to the format, scaled back."""
    scale = torch.finfo(fmt).max / t.detach().abs().max().double()
    return (t.detach().double() * scale).to(fmt).double() / scale


def emulated_linear(x: torch.Tensor, w: torch.Tensor, grad_out: torch.Tensor):
    """Forward and both gradients as ``_Fp8Matmul`` defines them: e4m3 operands forward, the
    gradient in e5m2 against the same e4m3 operands backward."""
    xq, wq, gq = emulate(x, E4M3), emulate(w, E4M3), emulate(grad_out, E5M2)
    return xq @ wq.T, gq @ wq, gq.T @ xq


def _inputs(M: int, K: int = 48, N: int = 32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen, requires_grad=True)
    w = (0.05 * torch.randn(N, K, generator=gen)).requires_grad_()
    return x, w, torch.randn(M, N, generator=gen)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


@pytest.mark.parametrize("tokens", [64, 37])  # 37: the weight gradient's inner dimension is padded to 16
def test_fp8_linear_equals_the_float_emulation(tokens) -> None:
    x, w, grad_out = _inputs(tokens)
    y = fp8_linear(x, w)
    y.backward(grad_out)
    want_y, want_gx, want_gw = emulated_linear(x, w, grad_out)
    # Same quantized operands; only float32 accumulation (and a float32 scale) separate them.
    torch.testing.assert_close(y.double(), want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), want_gx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), want_gw, rtol=1e-5, atol=1e-5)
    assert y.dtype == x.dtype and x.grad.dtype == x.dtype and w.grad.dtype == w.dtype


def test_a_transposed_gradient_is_quantized_row_major() -> None:
    """``y.T`` upstream hands the backward a column-major gradient; _scaled_mm takes row-major."""
    x, w, grad_out = _inputs(32)
    fp8_linear(x, w).T.backward(grad_out.T.contiguous())
    want_y, want_gx, want_gw = emulated_linear(x, w, grad_out)
    torch.testing.assert_close(x.grad.double(), want_gx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), want_gw, rtol=1e-5, atol=1e-5)


def test_fp8_linear_is_close_to_the_exact_product() -> None:
    """The scaling is right, not only self-consistent: e4m3 keeps ~2^-4 relative precision per
    element, e5m2 ~2^-3, and a sum of many products averages their rounding."""
    x, w, grad_out = _inputs(128, K=256, N=64)
    y = fp8_linear(x, w)
    y.backward(grad_out)
    assert _rel(y, x @ w.T) < 0.05
    assert _rel(x.grad, grad_out @ w) < 0.1
    assert _rel(w.grad, grad_out.T @ x) < 0.1


def test_quantize_uses_the_whole_range_and_survives_zeros() -> None:
    t = torch.tensor([[-3.0, 0.5], [1.0, 0.0]])
    t8, inverse = quantize(t, E4M3)
    assert t8.dtype == E4M3 and float(t8.float().abs().max()) == torch.finfo(E4M3).max
    torch.testing.assert_close(t8.float() * inverse, t, rtol=0.07, atol=0)
    zeros8, inverse = quantize(torch.zeros(4, 4), E5M2)
    assert torch.isfinite(inverse) and not zeros8.float().any()


def test_autocast_gives_its_dtype_and_leaves_the_fp8_operands_alone() -> None:
    x, w, _ = _inputs(32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear(x, w)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), emulated_linear(x, w, torch.zeros(32, 32))[0], rtol=1e-2, atol=1e-2)


def test_convert_swaps_the_draft_layers_but_not_lm_head_and_keeps_the_parameters() -> None:
    draft = build_draft(tiny_draft_config())
    keys = list(draft.state_dict())
    params = dict(draft.named_parameters())
    assert convert_to_fp8(draft, torch.device("cpu")) == list(FP8_LINEARS)
    for name in FP8_LINEARS:
        assert type(draft.get_submodule(name)) is Float8Linear
    assert type(draft.lm_head) is torch.nn.Linear
    assert list(draft.state_dict()) == keys  # checkpoints and export see the same draft
    assert all(p is params[n] for n, p in draft.named_parameters())  # the optimizer's, unchanged
    assert convert_to_fp8(draft, torch.device("cpu")) == []  # converting twice changes nothing


def test_the_default_converts_the_large_products_and_all_linears_is_a_choice() -> None:
    """By default fc and the MLP go to FP8 (where it measured faster); attention's projections stay
    bf16 unless :data:`ALL_LINEARS` is asked for."""
    assert set(FP8_LINEARS) == set(MLP_LINEARS) and not set(FP8_LINEARS) & set(ATTENTION_LINEARS)
    draft = build_draft(tiny_draft_config())
    convert_to_fp8(draft, torch.device("cpu"))
    for name in ATTENTION_LINEARS:
        assert type(draft.get_submodule(name)) is torch.nn.Linear
    draft = build_draft(tiny_draft_config())
    assert convert_to_fp8(draft, torch.device("cpu"), ALL_LINEARS) == list(ALL_LINEARS)
    for name in ALL_LINEARS:
        assert type(draft.get_submodule(name)) is Float8Linear


def test_unsupported_devices_are_refused_with_the_reason(monkeypatch) -> None:
    def no_fp8(*args, **kwargs):
        raise RuntimeError("_scaled_mm is not implemented for this backend\nmore detail")

    monkeypatch.setattr(torch, "_scaled_mm", no_fp8)
    with pytest.raises(Fp8UnsupportedError, match=r"needs torch._scaled_mm on cpu.*not implemented for this backend\)\. Set fp8: false"):
        convert_to_fp8(build_draft(tiny_draft_config()), torch.device("cpu"))
    monkeypatch.undo()
    monkeypatch.setattr(fp8, "check_fp8_support", lambda device: None)  # as if a GPU with FP8 were here
    with pytest.raises(Fp8UnsupportedError, match=r"fp8: fc is \[64, 72\].*multiples of 16"):
        convert_to_fp8(build_draft(tiny_draft_config(target_hidden_size=24)), torch.device("cuda"))


def _objective_step(draft, fp8_on: bool, inputs, compile="off"):
    objective = DraftObjective(draft, TeacherMode.DRAFT_PROBS, None, ttt_length=3, attention="eager", fp8=fp8_on,
                               compile=compile, compile_backend="aot_eager")
    draft.zero_grad(set_to_none=True)
    out = objective(*inputs)
    loss = objective_loss(out, torch.stack(out.counts).double(), 0.8, False)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}


def test_fp8_training_step_is_close_to_float32_and_traces_as_one_graph() -> None:
    torch._dynamo.reset()
    inputs_for = {}
    losses, grads = {}, {}
    for name, fp8_on, compile in (("fp32", False, "off"), ("fp8", True, "off"), ("fp8-step", True, "step")):
        draft = ttt_draft(seed=1).float()
        if not inputs_for:
            aux, ids, pos, loss_mask, teacher, valid, docs = packed_batch(draft, [[9, 5], [3, 11]], seed=3)
            inputs_for["x"] = ({"aux_hidden_states": aux.float(), "draft_probs": (teacher * valid[..., None]).float()},
                               ids, pos, loss_mask, docs)
        losses[name], grads[name] = _objective_step(draft, fp8_on, inputs_for["x"], compile)
    assert abs(losses["fp8"] - losses["fp32"]) / losses["fp32"] < 0.02
    for name, grad in grads["fp32"].items():
        cos = torch.nn.functional.cosine_similarity(grads["fp8"][name].flatten(), grad.flatten(), dim=0)
        assert cos > 0.98, name
    # The traced step runs the same FP8 ops: equal to eager FP8 up to float32 reassociation.
    assert losses["fp8-step"] == pytest.approx(losses["fp8"], rel=1e-5)
    for name, grad in grads["fp8"].items():
        torch.testing.assert_close(grads["fp8-step"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.gpu
def test_fp8_on_gpu_equals_the_emulation_and_trains_like_bf16() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        pytest.skip("no FP8 matmuls before compute capability 8.9")
    x, w, grad_out = _inputs(1000, K=512, N=256)
    x = x.detach().cuda().bfloat16().requires_grad_()
    w = w.detach().cuda().requires_grad_()
    grad_out = grad_out.cuda().bfloat16()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = fp8_linear(x, w)
    y.backward(grad_out)
    want_y, want_gx, want_gw = emulated_linear(x, w, grad_out)
    # bf16 outputs: one bf16 rounding on top of the emulation's float64.
    assert _rel(y, want_y) < 1e-2 and _rel(x.grad, want_gx) < 1e-2 and _rel(w.grad, want_gw) < 1e-2
