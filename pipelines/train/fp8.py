"""FP8 matmuls for the draft's linear layers while training (``TrainRecipe.fp8``).

The draft's large GEMMs (``fc`` and the MLP's ``gate/up/down_proj`` by default; attention's
``q/k/v/o_proj`` too with :data:`ALL_LINEARS`) run through
``torch._scaled_mm`` with per-tensor dynamic scales (torchao's "tensorwise" recipe, without its
dependency): each operand is scaled so that its absolute maximum lands on the format's largest
finite value, cast, multiplied (float32 accumulation, or Hopper's faster reduced-precision one where
:data:`FAST_ACCUM` says) and rescaled on the way out.

- forward: activations and weights in e4m3 (3 mantissa bits: precision where values are bounded);
- backward: the incoming gradient in e5m2 (2 mantissa bits, 5 exponent bits: gradients span a
  wider range), multiplied with the saved e4m3 operands (``_scaled_mm`` takes e5m2 x e4m3, not
  e5m2 x e5m2);
- the lm_head (the loss's own chunked matmuls, ``pipelines.train.loss``), the norms, RoPE,
  attention and the optimizer's float32 master weights stay as they were.

The saved activation is the e4m3 copy (half the bytes of bf16). The weights are re-quantized at
every call (seven depths a step): a cache would have to know when the optimizer changed them,
and a compiled step fuses the casts into the kernels around them.

``_scaled_mm`` wants the second operand column-major and, on CUDA, both inner dimensions
multiples of 16 (``convert_to_fp8`` checks the weights; a token count that is not is zero-padded
in the backward's weight-gradient product, where it is the inner dimension). GPUs before compute
capability 8.9 (Ada, Hopper) have no FP8 matmul: :class:`Fp8UnsupportedError` says so up front.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hsstore.errors import HsstoreError

FORWARD_FORMAT = torch.float8_e4m3fn
GRADIENT_FORMAT = torch.float8_e5m2
# An all-zero tensor would get an infinite scale; torchao clamps its amax the same way.
_AMAX_FLOOR = 1e-12
_ALIGN = 16

# Which of the three products let Hopper's FP8 tensor cores keep their partial sums in the
# reduced-precision accumulator (``_scaled_mm(use_fast_accum=True)``) instead of promoting them to
# float32 every few steps of K, which costs matmul throughput (2-4% on the bare products at the 8B
# shape on the H200, within noise in the compiled layers). The forward's products sum over the
# hidden size with bounded e4m3 operands; the two gradient products sum e5m2 gradients (and, for the
# weight gradient, over every token of the step), where the lost bits matter more. torchao's
# tensorwise recipe makes the same split. The A/B and its held-out accuracy: benchmarks/LOG.md.
FAST_ACCUM = {"forward": True, "grad_input": False, "grad_weight": False}

# The draft's linear layers FP8 can convert (state-dict names; lm_head is not among them), and the
# ones it does by default: where it measured faster. On the H200 at the 8B shape (8,192 tokens,
# benchmarks/investigations/profile_fp8_linear.py, compiled, forward + backward) FP8 took 0.62-0.68x
# bf16's time for fc and the MLP's [4096 x 12288] products, but 0.87-1.26x for q/o_proj and
# 2.7-3.3x for k/v_proj ([4096 -> 1024]): for a small output the amax and cast passes over the
# [8192 x 4096] input cost more than the product saves.
ATTENTION_LINEARS = (
    "midlayer.self_attn.q_proj",
    "midlayer.self_attn.k_proj",
    "midlayer.self_attn.v_proj",
    "midlayer.self_attn.o_proj",
)
MLP_LINEARS = ("fc", "midlayer.mlp.gate_proj", "midlayer.mlp.up_proj", "midlayer.mlp.down_proj")
ALL_LINEARS = MLP_LINEARS[:1] + ATTENTION_LINEARS + MLP_LINEARS[1:]
FP8_LINEARS = MLP_LINEARS


class Fp8UnsupportedError(HsstoreError, RuntimeError):
    """This device (or this torch build) cannot run FP8 matmuls."""


def quantize(t: torch.Tensor, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t_fp8, inverse_scale)`` with ``t ~= t_fp8.float() * inverse_scale``: one float32 scale
    for the whole tensor, chosen from its absolute maximum (computed now: dynamic scaling)."""
    fmax = torch.finfo(fmt).max
    amax = t.detach().abs().amax().float().clamp(min=_AMAX_FLOOR)
    scale = fmax / amax
    # Elementwise results keep their input's strides; _scaled_mm wants its first operand row-major.
    t_fp8 = (t.detach().float() * scale).clamp(-fmax, fmax).to(fmt).contiguous()
    return t_fp8, scale.reciprocal()


def scaled_mm(a8: torch.Tensor, b8: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype,
              fast_accum: bool = False) -> torch.Tensor:
    """``(a8 * scale_a) @ (b8 * scale_b)`` with float32 accumulation. On CUDA ``torch._scaled_mm``;
    elsewhere the same products by an exact upcast (every FP8 value is a float32) and a float32
    matmul: the CPU's ``_scaled_mm`` is an emulation that took ~0.9 s for a 256 x 384 x 384 product
    on the 2-core VM, minutes for the CPU smoke of a tiny draft. ``fast_accum`` (CUDA only): see
    :data:`FAST_ACCUM`."""
    if a8.device.type == "cuda":
        return torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum)
    # copy=True: a float32 out_dtype would otherwise return the product itself, and torch 2.11's
    # AOTAutograd traced an autograd.Function whose output aliases its own intermediate to zero
    # gradients (compile: step on the CPU; the loss's sums had the same trap, pipelines.train.loss).
    return ((a8.float() @ b8.float()) * (scale_a * scale_b)).to(out_dtype, copy=True)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major, as ``_scaled_mm``'s second operand must be."""
    return t.t().contiguous().t()


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -t.shape[0] % multiple
    return F.pad(t, (0, 0, 0, extra)) if extra else t


class _Fp8Matmul(torch.autograd.Function):
    """``x @ w.T`` with both operands in e4m3, and its gradients with the gradient in e5m2."""

    @staticmethod
    def forward(ctx: Any, x_MK: torch.Tensor, w_NK: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        x8, x_inv = quantize(x_MK, FORWARD_FORMAT)
        w8, w_inv = quantize(w_NK, FORWARD_FORMAT)
        # w8 is [N, K] row-major, so its transpose is the column-major [K, N] operand wanted.
        out = scaled_mm(x8, w8.t(), x_inv, w_inv, out_dtype, FAST_ACCUM["forward"])
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.dtypes = (x_MK.dtype, w_NK.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad_MN: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g8, g_inv = quantize(grad_MN, GRADIENT_FORMAT)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # [M, N] @ [N, K]
            grad_x = scaled_mm(g8, _column_major(w8), g_inv, w_inv, x_dtype, FAST_ACCUM["grad_input"])
        if ctx.needs_input_grad[1]:  # [N, M] @ [M, K]: the token count M is the inner dimension here
            g8_NM = _pad_rows(g8, _ALIGN).t().contiguous()
            x8_MK = _column_major(_pad_rows(x8, _ALIGN))
            # float32 out: the master weights' dtype (AdamW's), summing over every token.
            grad_w = scaled_mm(g8_NM, x8_MK, g_inv, x_inv, torch.float32, FAST_ACCUM["grad_weight"]).to(w_dtype)
        return grad_x, grad_w, None


def fp8_linear(x: torch.Tensor, weight_NK: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) through FP8; ``x`` is ``[..., K]``. The result has
    autocast's dtype where autocast is on (bf16 in training on CUDA), else ``x``'s."""
    device_type = x.device.type
    out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    # Autocast must not touch the FP8 operands: the quantization picks every dtype itself.
    with torch.autocast(device_type, enabled=False):
        out = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight_NK, out_dtype)
    return out.reshape(*x.shape[:-1], weight_NK.shape[0])


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` without bias whose matmul runs in FP8; the parameter (float32 master
    weights, name ``weight``) is the original layer's, so state dicts and optimizers see no change."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Float8Linear:
        if linear.bias is not None:
            raise ValueError("Float8Linear has no bias (the draft's linear layers have none)")
        layer = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        layer.weight = linear.weight
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight)


def check_fp8_support(device: torch.device) -> None:
    """Raise :class:`Fp8UnsupportedError` unless a small FP8 matmul (forward formats and the
    backward's e5m2 x e4m3) runs on ``device``."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise Fp8UnsupportedError(
                f"fp8: true needs a GPU with FP8 matmuls (compute capability 8.9+: Ada, Hopper or later); "
                f"{torch.cuda.get_device_name(device)} is {major}.{minor}. Set fp8: false"
            )
    a = torch.ones(_ALIGN, _ALIGN, device=device)
    one = torch.ones((), device=device)
    try:
        for fmt in (FORWARD_FORMAT, GRADIENT_FORMAT):
            torch._scaled_mm(a.to(fmt), a.to(FORWARD_FORMAT).t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as err:
        raise Fp8UnsupportedError(
            f"fp8: true needs torch._scaled_mm on {device.type}, which this torch {torch.__version__} "
            f"does not run there ({str(err).splitlines()[0]}). Set fp8: false"
        ) from err


def convert_to_fp8(draft: nn.Module, device: torch.device, linears: tuple[str, ...] | None = None) -> list[str]:
    """Swap the draft's ``linears`` (default :data:`FP8_LINEARS`, read at call time) for
    :class:`Float8Linear` in place (same parameters, same state-dict keys); returns the names
    converted. Checks the device and, on CUDA, that every weight's dimensions are multiples of 16."""
    check_fp8_support(device)
    converted = []
    for name in FP8_LINEARS if linears is None else linears:
        parent_name, _, child = name.rpartition(".")
        parent = draft.get_submodule(parent_name) if parent_name else draft
        layer = getattr(parent, child)
        if isinstance(layer, Float8Linear):
            continue
        if device.type == "cuda" and (layer.in_features % _ALIGN or layer.out_features % _ALIGN):
            raise Fp8UnsupportedError(
                f"fp8: {name} is [{layer.out_features}, {layer.in_features}]; FP8 matmuls on CUDA need "
                f"both dimensions multiples of {_ALIGN}. Set fp8: false for this draft shape"
            )
        setattr(parent, child, Float8Linear.from_linear(layer))
        converted.append(name)
    return converted
