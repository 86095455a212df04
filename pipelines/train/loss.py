"""Soft cross-entropy of ``lm_head(x)`` against a teacher, in chunks of scored positions.

The TTT loss at one depth is ``-sum_n sum_v teacher[n, v] * log_softmax(x_n @ W^T)[v]`` over the
scored positions n. Written plainly, autograd keeps the float32 logits and log-probabilities of
every scored position for the backward pass: at T = 8,192 positions and a 32k draft vocabulary,
2 GB per depth and ~14 GB over seven depths, plus a dozen full passes over them.

``linear_soft_cross_entropy`` instead walks the positions in chunks and, for each chunk, computes
the logits (one matmul in the compute dtype, e.g. bf16 with float32 accumulation), the float32
softmax, the loss and the loss's gradient with respect to the logits (``softmax * sum(teacher) -
teacher``, stored in the compute dtype), then turns those into the gradients of ``x`` (``[N, H]``)
and of ``W`` with one matmul each. Only those two gradients survive the forward pass; the backward
pass scales them by the incoming gradient. The teacher's probabilities are produced chunk by chunk too
(``pipelines.train.teacher``), so no ``[positions, vocabulary]`` tensor is ever whole.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import torch

# Elements of one [chunk, vocabulary] float32 block (2**25 = 128 MiB): a few such blocks are live.
DEFAULT_CHUNK_ELEMENTS = 1 << 25
# Traced into a larger compiled graph (compile: step / graph), the positions go in one chunk up to
# this many elements (2**28: the 8B shape's 8,192 x 32,000 at one depth). Inductor lowers the
# chunks' writes into slices of ``grad_logits`` as one kernel that evaluates every chunk's
# branch at every element (a where-chain, seen in its output code: benchmarks/LOG.md), so chunking
# inside a graph multiplies the softmax pass's work by the number of chunks; in one chunk
# inductor fuses the row-wise passes over [N, V] itself, without float32 copies of the whole.
TRACED_CHUNK_ELEMENTS = 1 << 28


class TeacherRows(Protocol):
    """The teacher's distribution over the draft vocabulary, row by row (no gradient)."""

    def probs(self, rows_N: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[N, V_draft]`` probabilities of the flattened ``[B * T]`` positions ``rows_N``."""
        ...


def compute_dtype_for(x: torch.Tensor) -> torch.dtype:
    """The matmul dtype autocast would pick for ``x`` here (its own dtype outside autocast)."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def _soft_ce_from_probs(
    logits: torch.Tensor, target: torch.Tensor, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk: ``(ce_sum, correct, d ce / d logits)``; ``target`` holds probabilities whose
    rows sum to 1 (or 0 for a row the teacher leaves out). ``keep`` (bool ``[N]``): only these
    rows count; the others add nothing to the loss, its gradient or ``correct`` (the dense
    scoring of ``ttt_forward(..., dense=True)``, where every position is a row)."""
    loss_dtype = torch.promote_types(logits.dtype, torch.float32)
    logits32, target = logits.to(loss_dtype), target.to(loss_dtype)
    if keep is not None:
        target = target * keep[:, None].to(loss_dtype)
    log_z = torch.logsumexp(logits32, dim=-1, keepdim=True)
    # -sum_v t_v (l_v - log Z) = sum(t) log Z - t . l
    t_sum = target.sum(-1, keepdim=True)
    ce_sum = (t_sum * log_z).sum() - (target * logits32).sum()
    matches = logits32.argmax(-1) == target.argmax(-1)
    correct = (matches if keep is None else matches & keep).sum()
    grad = (torch.exp(logits32 - log_z) * t_sum - target).to(logits.dtype)
    return ce_sum, correct, grad


def _soft_ce_from_logits(
    logits: torch.Tensor, teacher_logits: torch.Tensor, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk against a teacher given as logits (its softmax is the distribution)."""
    loss_dtype = torch.promote_types(logits.dtype, torch.float32)
    return _soft_ce_from_probs(logits, torch.softmax(teacher_logits.to(loss_dtype), dim=-1), keep)


_FUSED: dict[str, Any] = {}


def _chunk_kernel(teacher_gives_logits: bool, device: torch.device, compiled: bool | None) -> Any:
    """The per-chunk function, ``torch.compile``d on CUDA: inductor fuses the dozen passes over
    each ``[chunk, V]`` block (casts, logsumexp, the teacher's softmax, the dot product, both
    argmaxes, the gradient) into a few row-wise kernels. Eager elsewhere (the CPU CI has no
    compiler toolchain to rely on) or when ``HSSTORE_COMPILE=0``; ``compiled`` forces either."""
    fn = _soft_ce_from_logits if teacher_gives_logits else _soft_ce_from_probs
    if compiled is None:
        compiled = device.type == "cuda" and os.environ.get("HSSTORE_COMPILE", "1") != "0"
    if not compiled:
        return fn
    key = fn.__name__
    if key not in _FUSED:
        _FUSED[key] = torch.compile(fn, dynamic=None)
    return _FUSED[key]


class _LinearSoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x_NH: torch.Tensor,
        weight_VH: torch.Tensor,
        teacher: TeacherRows,
        teacher_rows_N: torch.Tensor,
        compute_dtype: torch.dtype,
        chunk: int,
        compiled: bool | None,
        keep_N: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss_dtype = torch.promote_types(compute_dtype, torch.float32)
        w = weight_VH.detach().to(compute_dtype)
        x = x_NH.detach().to(compute_dtype)
        N, V = x.shape[0], w.shape[0]
        teacher_logits = getattr(teacher, "logits", None)
        kernel = _chunk_kernel(teacher_logits is not None, x.device, compiled)
        ce_sum = torch.zeros((), dtype=loss_dtype, device=x.device)
        correct = torch.zeros((), dtype=torch.int64, device=x.device)
        grad_logits = torch.empty((N, V), dtype=compute_dtype, device=x.device)
        for start in range(0, N, chunk):
            rows = teacher_rows_N[start : start + chunk]
            keep = None if keep_N is None else keep_N[start : start + chunk]
            logits = x[start : start + chunk] @ w.T
            if teacher_logits is not None:
                chunk_out = kernel(logits, teacher_logits(rows, compute_dtype), keep)
            else:
                chunk_out = kernel(logits, teacher.probs(rows, loss_dtype), keep)
            # Out of place: with ``+=`` into the zeros above, torch 2.11's AOTAutograd traced this
            # Function's backward to all-zero gradients (compile: step/graph learnt nothing on
            # the H200; tests/pipelines/train/test_compile_modes.py fails that way on 2.11).
            ce_sum = ce_sum + chunk_out[0]
            correct = correct + chunk_out[1]
            grad_logits[start : start + chunk] = chunk_out[2]
        # One matmul each over every scored position (bf16 in, float32 accumulation, like the
        # autocast matmul they replace); the [N, V] gradient lives only until here.
        grad_x = grad_logits @ w
        grad_w = grad_logits.T @ x
        ctx.save_for_backward(grad_x, grad_w)
        ctx.dtypes = (x_NH.dtype, weight_VH.dtype)
        ctx.mark_non_differentiable(correct)
        return ce_sum, correct

    @staticmethod
    def backward(ctx: Any, grad_ce: torch.Tensor, _grad_correct: Any) -> tuple[Any, ...]:
        grad_x, grad_w = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        gx = (grad_x * grad_ce.to(grad_x.dtype)).to(x_dtype) if ctx.needs_input_grad[0] else None
        gw = (grad_w * grad_ce.to(grad_w.dtype)).to(w_dtype) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None, None, None, None, None


def linear_soft_cross_entropy(
    x_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    teacher: TeacherRows,
    teacher_rows_N: torch.Tensor,
    chunk: int | None = None,
    compiled: bool | None = None,
    keep_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ce_sum, correct)``: the summed soft cross-entropy of ``x @ weight^T`` against the teacher
    rows, and how many positions' argmax equals the teacher's (int64, no gradient).

    Differentiable in ``x`` and ``weight``; matmuls run in autocast's dtype when autocast is on
    (else ``x``'s), softmax and the sums in at least float32. ``compiled``: fuse each chunk's
    elementwise work with ``torch.compile`` (None: on CUDA unless ``HSSTORE_COMPILE=0``).
    ``keep_N`` (bool ``[N]``): score only these rows (None: all); the others cost their matmuls
    but add nothing, which keeps every shape static when ``x`` holds every position."""
    compute_dtype = compute_dtype_for(x_NH)
    if chunk is None:
        elements = TRACED_CHUNK_ELEMENTS if torch.compiler.is_compiling() else DEFAULT_CHUNK_ELEMENTS
        chunk = max(64, elements // max(1, weight_VH.shape[0]))
    return _LinearSoftCrossEntropy.apply(
        x_NH, weight_VH, teacher, teacher_rows_N, compute_dtype, chunk, compiled, keep_N
    )
