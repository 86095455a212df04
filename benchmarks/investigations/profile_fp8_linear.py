"""Where an FP8 draft linear layer's time goes, against bf16, at the training step's shapes (issue 31).

For each of the draft's linear layers at the Qwen3-8B shape (``fc``, ``q/k/v/o_proj``,
``gate/up/down_proj``; ``--tokens`` rows, 8,192 by default), one forward + backward as the trainer
runs it (float32 master weights, bf16 autocast), timed with CUDA events, median of ``--iters``:

- ``bf16``: ``F.linear`` under autocast (the bf16 step's layer);
- ``fp8:<accum>``: :func:`pipelines.train.fp8.fp8_linear` eager, and compiled (``torch.compile`` of
  the layer's forward, the backward through AOTAutograd as in ``compile: layers``), for each
  fast-accumulation choice (``forward``, the default; ``none``; ``all``);
- the bare products alone: bf16 ``mm`` and ``_scaled_mm`` e4m3 x e4m3 with and without fast
  accumulation, at the forward's ``[M, K] x [K, N]``: the ceiling the casts and scales sit on.

    python -m benchmarks.investigations.profile_fp8_linear --out $OUT/fp8-linear.json

CUDA only (FP8 matmuls need compute capability 8.9+).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.train.profile_step import FP8_FAST_ACCUM_CHOICES as ACCUM
from pipelines.train import fp8 as fp8_module

# name: (in_features K, out_features N) at the Qwen3-8B shape (hidden 4,096, 32/8 heads of 128,
# MLP 12,288, three aux layers into fc).
SHAPES = {
    "fc": (3 * 4096, 4096),
    "q_proj": (4096, 4096),
    "k_proj": (4096, 1024),
    "v_proj": (4096, 1024),
    "o_proj": (4096, 4096),
    "gate_proj": (4096, 12288),
    "up_proj": (4096, 12288),
    "down_proj": (12288, 4096),
}


def time_ms(fn: Callable[[], Any], iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def layer_step(linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, w: torch.Tensor,
               grad: torch.Tensor) -> Callable[[], None]:
    """One forward + backward of ``linear(x, w)`` under bf16 autocast, gradients to ``x`` and ``w``."""

    def run() -> None:
        x.grad = w.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = linear(x, w)
        y.backward(grad)

    return run


def measure_shape(name: str, K: int, N: int, M: int, iters: int) -> dict[str, Any]:
    device = torch.device("cuda")
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device=device) * K**-0.5).requires_grad_()
    grad = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    row: dict[str, Any] = {"layer": name, "M": M, "K": K, "N": N, "gflop_fwd_bwd": round(6 * M * K * N / 1e9, 1)}
    row["bf16_ms"] = time_ms(layer_step(F.linear, x, w, grad), iters)
    compiled_fp8 = torch.compile(fp8_module.fp8_linear, dynamic=False)
    for accum, table in ACCUM.items():
        fp8_module.FAST_ACCUM.update(table)
        row[f"fp8_eager_{accum}_ms"] = time_ms(layer_step(fp8_module.fp8_linear, x, w, grad), iters)
        torch._dynamo.reset()  # FAST_ACCUM is read at trace time
        row[f"fp8_compiled_{accum}_ms"] = time_ms(layer_step(compiled_fp8, x, w, grad), iters)
    fp8_module.FAST_ACCUM.update(ACCUM["forward"])
    # The bare forward products: what the casts and scales around them sit on.
    a16, b16 = x.detach(), w.detach().to(torch.bfloat16).t()
    row["bare_bf16_mm_fwd_ms"] = time_ms(lambda: a16 @ b16, iters)
    a8 = a16.to(torch.float8_e4m3fn)
    b8 = w.detach().to(torch.float8_e4m3fn)  # [N, K] row-major: its .t() is the column-major operand
    one = torch.ones((), device=device)
    for fast in (False, True):
        row[f"bare_fp8_mm_fwd_fast{int(fast)}_ms"] = time_ms(
            lambda fast=fast: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                               use_fast_accum=fast), iters)
    for key in [k for k in row if k.endswith("_ms")]:
        row[key] = round(row[key], 3)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--layers", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("CUDA only: FP8 matmuls need a GPU of compute capability 8.9+")
    rows = [measure_shape(name, *SHAPES[name], args.tokens, args.iters) for name in args.layers]
    for row in rows:
        print(json.dumps(row))
    totals = {key: round(sum(row[key] for row in rows), 2) for key in rows[0] if key.endswith("_ms")}
    # Per TTT step: fc once, the midlayer's seven linears at each of the seven depths.
    per_step = {key: round(sum(row[key] * (1 if row["layer"] == "fc" else 7) for row in rows), 1) for key in totals}
    result = {"rows": rows, "sum_over_layers_ms": totals, "per_ttt7_step_ms": per_step,
              "torch": torch.__version__, "device": torch.cuda.get_device_name()}
    print(json.dumps({"per_ttt7_step_ms": per_step}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
