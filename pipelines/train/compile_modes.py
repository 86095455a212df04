"""How much of the training step ``torch.compile`` sees (``TrainRecipe.compile``).

An eager TTT-7 step at the Qwen3-8B shape launches ~3,000 kernels; the GPU idles ~17% of the step
in the gaps between them (benchmarks/LOG.md, "Where the step's GPU waits"). The modes, from the
fewest compiled regions to the most:

- ``off``: eager everywhere.
- ``layers``: the draft's norms and MLP (``nn.Module.compile``, state-dict keys unchanged), flex
  attention and the loss's per-chunk kernel, each compiled alone; eager code between them. The
  scored positions are gathered per depth (a host sync each, and only their logits computed).
- ``step``: the whole objective forward (the teacher's validity and rows, fc, the seven depths
  with their attention, the loss of every depth) traced as one graph, and its backward as one
  graph. Flex attention's block masks are built eagerly just before and enter the graph as
  inputs (``DraftObjective.forward``): inductor cannot lower a mask computed inside it. Positions are scored densely (``ttt_forward(..., dense=True)``): every shape is static
  and nothing waits on the host, at the price of the head's matmuls at unscored positions.
- ``graph``: ``step`` replayed as CUDA graphs (``mode="reduce-overhead"``): one launch for the
  forward and one for the backward. CUDA only, one process, no gradient accumulation: the
  graphs' outputs live in a pool the next replay overwrites, which accumulated gradients and
  DDP's buckets would read after that.

Shapes are static because the loader packs rows of exactly ``token_budget`` tokens: a compiled
step is traced once per ``[rows, token_budget]`` (again only for a short last batch).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import StrEnum
from typing import Any

import torch

logger = logging.getLogger(__name__)


class CompileMode(StrEnum):
    OFF = "off"
    LAYERS = "layers"
    STEP = "step"
    GRAPH = "graph"

    @property
    def whole_step(self) -> bool:
        """The objective forward is one compiled graph (and the loss scores densely)."""
        return self in (CompileMode.STEP, CompileMode.GRAPH)


# What ``compile: auto`` picks on CUDA. At the 8B shape, every position scored (H200, 2026-12-03,
# after the loss was traced in one chunk and the block masks stopped waiting for the GPU): graph
# 27,551-27,951 tokens/s (28,660-28,891 back to back, as the trainer runs; 29,567-29,597 and
# 31,332-31,382 since 2026-12-05, the teacher's logits computed once a step), layers 25,080; graph
# compiles in ~50-60 s, layers in ~16 s, so graph's 10% repays its compile within ~7 minutes of
# training, and it peaks at 22 GiB against layers' 26-31 (benchmarks/RESULTS.md). Where graph is
# refused (several processes, accumulation) auto picks step, the same graph without replay.
CUDA_DEFAULT = CompileMode.GRAPH
# Below this share of loss-masked tokens in the store, ``auto`` picks ``layers`` over a whole-step
# mode: ``step``/``graph`` compute the heads' logits at every position (static shapes), ``layers``
# only at scored ones. At the 8B shape layers' step is ~323 ms all scored and ~256 ms at 22% scored
# (~85 ms per unit of unscored share) while graph's stays at ~286-290 ms back to back: they cross
# near 60% (benchmarks/RESULTS.md). Chat stores whose answers are most of the tokens are above it;
# stores of short answers to long prompts (``hsstore generate`` of "continue this file": ~23%)
# are below.
GRAPH_MIN_SCORED_FRACTION = 0.6
# With ``fp8: true`` auto picks ``step`` where it would pick ``graph``: under CUDA-graph replay the
# FP8 step re-records its graphs at every step (torch 2.11: "Re-recording function=partition_0,
# reason=static input data pointer changed"; likely pytorch/pytorch#197438), 306-351 ms a step at
# the 8B shape against ``step``'s 273 ms (30,024 tokens/s, 31,704 back to back; bf16 ``step``
# 27,891 / 28,921 in the same call; H200, 2026-12-04, benchmarks/LOG.md).


def resolve_compile_mode(
    choice: str | bool,
    device: torch.device,
    world_size: int = 1,
    grad_accum_steps: int = 1,
    scored_fraction: float | None = None,
    fp8: bool = False,
) -> CompileMode:
    """The recipe's ``compile`` value as a mode: ``auto`` is :data:`CUDA_DEFAULT` on CUDA (``step``
    where that is ``graph`` and the run has several processes or accumulates gradients; ``layers``
    where the store's ``scored_fraction`` of loss-masked tokens is below
    :data:`GRAPH_MIN_SCORED_FRACTION`; ``step`` where it would be ``graph`` and ``fp8`` is on) and
    ``off`` elsewhere (the CPU CI has no compiler toolchain
    to rely on); ``on`` (and ``True``) is ``layers``, what ``on`` meant before the other modes existed."""
    if isinstance(choice, bool):
        return CompileMode.LAYERS if choice else CompileMode.OFF
    if choice == "auto":
        if device.type != "cuda":
            return CompileMode.OFF
        if CUDA_DEFAULT.whole_step and scored_fraction is not None and scored_fraction < GRAPH_MIN_SCORED_FRACTION:
            return CompileMode.LAYERS
        if CUDA_DEFAULT == CompileMode.GRAPH and (world_size > 1 or grad_accum_steps > 1 or fp8):
            return CompileMode.STEP
        return CUDA_DEFAULT
    if choice == "on":
        return CompileMode.LAYERS
    try:
        return CompileMode(choice)
    except ValueError:
        raise ValueError(f"unknown compile mode {choice!r} (auto, on, {', '.join(CompileMode)})") from None


def check_compile_mode(mode: CompileMode, device: torch.device, world_size: int, grad_accum_steps: int,
                       fp8: bool = False) -> None:
    """Refuse a ``graph`` step where CUDA graphs cannot replay it correctly (module docstring), and
    warn where replay runs but costs more than it saves (FP8: see ``auto``'s choice above)."""
    if mode != CompileMode.GRAPH:
        return
    if fp8:
        logger.warning("compile: graph with fp8: true re-records its CUDA graphs at every step (torch 2.11 on "
                       "the H200: 306-351 ms a step against 273 ms with compile: step); compile: auto picks step")
    problems = []
    if device.type != "cuda":
        problems.append(f"it needs CUDA (device is {device.type})")
    if world_size > 1:
        problems.append(f"it runs on one process only (world size {world_size})")
    if grad_accum_steps > 1:
        problems.append(f"it does not accumulate gradients (grad_accum_steps={grad_accum_steps})")
    if problems:
        raise ValueError(f"compile: graph is not possible here: {'; '.join(problems)}. Use compile: step, "
                         "the same compiled step without CUDA-graph replay")


def compile_whole_step(fn: Callable[..., Any], mode: CompileMode, backend: str = "inductor") -> Callable[..., Any]:
    """``fn`` (the objective's forward) compiled as one graph: ``fullgraph`` so that a graph break
    fails loudly instead of quietly splitting the step back into eager pieces; ``dynamic=False``
    because the packed rows' shape is fixed. ``backend``: tests trace with ``aot_eager`` (no
    compiler toolchain needed); CUDA-graph replay is inductor's, so other backends ignore it."""
    if not mode.whole_step:
        raise ValueError(f"compile mode {mode} does not compile the whole step")
    options: dict[str, Any] = {"fullgraph": True, "dynamic": False, "backend": backend}
    if mode == CompileMode.GRAPH and backend == "inductor":
        options["mode"] = "reduce-overhead"
    return torch.compile(fn, **options)


def mark_static(*tensors: torch.Tensor | None) -> None:
    """Tell CUDA-graph replay that these tensors (the frozen teacher head, which is not an
    ``nn.Module`` buffer) keep their address, so a replay reads them in place instead of
    copying a gigabyte of weights into its own buffers first."""
    for tensor in tensors:
        if tensor is not None and tensor.is_cuda:
            torch._dynamo.mark_static_address(tensor)
