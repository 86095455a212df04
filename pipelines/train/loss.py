"""Soft cross-entropy of ``lm_head(x)`` against a teacher, in chunks of scored positions.

The TTT loss at one depth is ``-sum_n sum_v teacher[n, v] * log_softmax(x_n @ W^T)[v]`` over the
scored positions n. Written plainly, autograd keeps the float32 logits and log-probabilities of
every scored position for the backward pass: at T = 8,192 positions and a 32k draft vocabulary,
2 GB per depth and ~14 GB over seven depths, plus a dozen full passes over them.

``linear_soft_cross_entropy`` instead walks the positions in chunks and, for each chunk, computes
the logits (one matmul in the compute dtype, e.g. bf16 with float32 accumulation), the float32
softmax, the loss and the loss's gradient with respect to the logits (``softmax * sum(teacher) -
teacher``), which it turns at once into the gradients of ``x`` (``[n, H]``) and of ``W``
(accumulated in float32). Only those two gradients survive the forward pass; the backward pass
scales them by the incoming gradient. The teacher's probabilities are produced chunk by chunk too
(``pipelines.train.teacher``), so no ``[positions, vocabulary]`` tensor is ever whole.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

# Elements of one [chunk, vocabulary] float32 block (2**25 = 128 MiB): a few such blocks are live.
DEFAULT_CHUNK_ELEMENTS = 1 << 25


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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss_dtype = torch.promote_types(compute_dtype, torch.float32)
        w = weight_VH.detach().to(compute_dtype)
        N = x_NH.shape[0]
        ce_sum = torch.zeros((), dtype=loss_dtype, device=x_NH.device)
        correct = torch.zeros((), dtype=torch.int64, device=x_NH.device)
        grad_x = torch.empty(x_NH.shape, dtype=compute_dtype, device=x_NH.device)
        grad_w = torch.zeros(weight_VH.shape, dtype=loss_dtype, device=x_NH.device)
        for start in range(0, N, chunk):
            x_c = x_NH[start : start + chunk].detach().to(compute_dtype)
            logits = (x_c @ w.T).to(loss_dtype)
            target = teacher.probs(teacher_rows_N[start : start + chunk], loss_dtype)
            log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
            # -sum_v t_v (l_v - log Z) = sum(t) log Z - t . l   (rows of t sum to 1 or 0)
            t_sum = target.sum(-1, keepdim=True)
            ce_sum += (t_sum * log_z).sum() - (target * logits).sum()
            correct += (logits.argmax(-1) == target.argmax(-1)).sum()
            # d CE / d logits = softmax * sum(t) - t, reusing the logits' storage.
            grad_logits = logits.sub_(log_z).exp_().mul_(t_sum).sub_(target).to(compute_dtype)
            grad_x[start : start + chunk] = grad_logits @ w
            grad_w += (grad_logits.T @ x_c).to(loss_dtype)
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
        return gx, gw, None, None, None, None


def linear_soft_cross_entropy(
    x_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    teacher: TeacherRows,
    teacher_rows_N: torch.Tensor,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ce_sum, correct)``: the summed soft cross-entropy of ``x @ weight^T`` against the teacher
    rows, and how many positions' argmax equals the teacher's (int64, no gradient).

    Differentiable in ``x`` and ``weight``; matmuls run in autocast's dtype when autocast is on
    (else ``x``'s), softmax and the sums in at least float32."""
    compute_dtype = compute_dtype_for(x_NH)
    if chunk is None:
        chunk = max(64, DEFAULT_CHUNK_ELEMENTS // max(1, weight_VH.shape[0]))
    return _LinearSoftCrossEntropy.apply(
        x_NH, weight_VH, teacher, teacher_rows_N, compute_dtype, chunk
    )
