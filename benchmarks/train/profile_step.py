"""Time and profile the draft training step alone (no store, no loader) at a target's shape.

Synthetic inputs on the device: packed rows of documents of 1,024-2,048 tokens, random aux and
final states, a random target lm_head (the teacher), the project's draft of the target's shape.
One step = teacher rows + the TTT unroll and loss (``pipelines.train.objective``) + backward +
clipping + AdamW: what ``hsstore train`` runs per step after the batch is on the device.

    python -m benchmarks.bench_train profile --shape qwen3-8b --tokens 8192 --variants flex+layers flex+graph flex+graph+fp8
    python -m benchmarks.bench_train profile --shape qwen3-8b --profile $OUT/trace   # torch.profiler table

Prints one line per variant (tokens/s, step ms, peak GiB, model TFLOP/s and MFU against the
measured bf16 matmul rate) and, with ``--profile``, the top CUDA kernels of the first variant and
where its GPU idles: the union of kernel intervals against the span of 3 profiled steps, the idle
time by gap size, the host calls that wait on the GPU, and the longest gaps with their neighbours
(a step whose idle is spread over thousands of ~20 us gaps is launch-bound; a few long gaps after
``cudaStreamSynchronize`` are syncs).
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import write_results
from pipelines.models.eagle3 import Eagle3Config, Eagle3Draft
from pipelines.train import fp8 as fp8_module
from pipelines.train import objective as objective_module
from pipelines.train import teacher as teacher_module
from pipelines.train.compile_modes import CompileMode, resolve_compile_mode
from pipelines.train.objective import DraftObjective
from pipelines.train.teacher import ONCE_PER_STEP_ELEMENTS, TeacherHead

SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     intermediate_size=12288, vocab_size=151936, target_hidden_size=4096, rope_theta=1e6),
    "reference": dict(hidden_size=384, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                      intermediate_size=1024, vocab_size=8192, target_hidden_size=384, rope_theta=1e6),
}


def step_flops_per_token(cfg: Eagle3Config, ttt_length: int, scored_fraction: float = 1.0) -> float:
    """Matmul FLOPs per token of one training step (forward + backward = 3x forward), attention
    scores excluded (documents of 1-2k tokens make them a few percent)."""
    H, hd = cfg.hidden_size, cfg.head_dim
    qkv = 2 * H * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
    o = cfg.num_attention_heads * hd * H
    mlp = 3 * H * cfg.intermediate_size
    head = H * cfg.draft_vocab_size * scored_fraction
    per_depth = 2 * (qkv + o + mlp + head) * 3
    fc = 2 * cfg.num_aux_layers * cfg.target_hidden_size * H * 3
    teacher = 2 * H * cfg.vocab_size  # once a step: the draft rows (every depth's logits) and the rest (validity)
    return per_depth * ttt_length + fc + teacher


def synthetic_batch(B: int, T: int, cfg: Eagle3Config, device: torch.device, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    doc_ids = torch.zeros(B, T, dtype=torch.long)
    pos = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        start, doc = 0, 0
        while start < T:
            length = min(int(torch.randint(1024, 2049, (1,), generator=gen)), T - start)
            doc_ids[b, start : start + length] = doc
            pos[b, start : start + length] = torch.arange(length)
            start, doc = start + length, doc + 1
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (B, T), generator=gen).to(device),
        "position_ids": pos.to(device),
        "doc_ids": doc_ids.to(device),
        "loss_mask": torch.ones(B, T, dtype=torch.bool, device=device),
        "aux": (torch.randn(B, T, cfg.num_aux_layers, cfg.target_hidden_size, generator=gen) * 0.5)
        .to(device, torch.bfloat16),
        "final": torch.randn(B, T, cfg.target_hidden_size, generator=gen).to(device, torch.bfloat16),
    }


def measure_matmul_tflops(device: torch.device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * 8192**3 * 10 / (time.perf_counter() - t0) / 1e12


_TEACHER_ROWS = objective_module.teacher_rows


def teacher_as_before_12_05(before: bool) -> None:
    """In this process, the final-state teacher as the trainer computed it before 2026-12-05
    (``before``) or as it does now: then, its draft-vocabulary logits were multiplied again at
    every depth (``ONCE_PER_STEP_ELEMENTS = 0``) and the validity check ran over every position,
    scored or not (the objective's ``needed_BT`` dropped); the A/B baseline of ``+perdepth``."""
    teacher_module.ONCE_PER_STEP_ELEMENTS = 0 if before else ONCE_PER_STEP_ELEMENTS

    def every_position(*args: Any, needed_BT: Any = None, **kwargs: Any) -> Any:
        return _TEACHER_ROWS(*args, **kwargs)

    objective_module.teacher_rows = every_position if before else _TEACHER_ROWS


@dataclass(frozen=True)
class StepVariant:
    """One way to run the step: ``ATTENTION[+MODE][+fp8]`` on the command line, e.g. ``flex+graph+fp8``.
    MODE is a :class:`~pipelines.train.compile_modes.CompileMode` (``compile`` = ``layers``, the
    spelling before the modes); none = ``off``."""

    attention: str
    compile: CompileMode = CompileMode.OFF
    fp8: bool = False
    # Which FP8 products accumulate fast (``pipelines.train.fp8.FAST_ACCUM``): ``fp8`` alone is the
    # default (forward), ``fp8:none`` and ``fp8:all`` the two A/B ends.
    fp8_fast_accum: str = "forward"
    # Which linears go to FP8: ``fp8`` the default set (fc and the MLP), ``fp8all`` attention's too.
    fp8_all_linears: bool = False
    # ``+perdepth``: the teacher as before 2026-12-05 (:func:`teacher_as_before_12_05`): the A/B's baseline.
    teacher_per_depth: bool = False

    @classmethod
    def parse(cls, text: str) -> StepVariant:
        attention, *flags = text.split("+")
        mode, fp8, fast_accum, all_linears, per_depth = CompileMode.OFF, False, "forward", False, False
        for flag in flags:
            if flag == "perdepth":
                per_depth = True
            elif flag.startswith("fp8"):
                name, _, accum = flag.partition(":")
                if name not in ("fp8", "fp8all"):
                    raise ValueError(f"{text}: {name!r} is not fp8 or fp8all")
                fp8, fast_accum, all_linears = True, accum or "forward", name == "fp8all"
                if fast_accum not in FP8_FAST_ACCUM_CHOICES:
                    raise ValueError(f"{text}: fp8 accumulation {fast_accum!r} is not one of {sorted(FP8_FAST_ACCUM_CHOICES)}")
            else:  # "compile" is how variants were spelt before the modes: layers
                mode = resolve_compile_mode("layers" if flag == "compile" else flag, torch.device("cuda"))
        return cls(attention, mode, fp8, fast_accum, all_linears, per_depth)

    def __str__(self) -> str:
        name = "fp8all" if self.fp8_all_linears else "fp8"
        fp8 = [name + ("" if self.fp8_fast_accum == "forward" else f":{self.fp8_fast_accum}")] if self.fp8 else []
        return "+".join([self.attention, str(self.compile)] + fp8 + (["perdepth"] if self.teacher_per_depth else []))

    def fast_accum_table(self) -> dict[str, bool]:
        return FP8_FAST_ACCUM_CHOICES[self.fp8_fast_accum]


FP8_FAST_ACCUM_CHOICES = {
    "forward": {"forward": True, "grad_input": False, "grad_weight": False},
    "none": {"forward": False, "grad_input": False, "grad_weight": False},
    "all": {"forward": True, "grad_input": True, "grad_weight": True},
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(args: argparse.Namespace, variant: StepVariant, device: torch.device, peak_tflops: float | None,
                profile_dir: Path | None) -> dict[str, Any]:
    """Time ``args.steps`` steps after ``args.warmup`` (the first of which compiles) on ``device``;
    ``peak_tflops`` (the measured bf16 matmul rate, CUDA) turns model FLOP/s into an MFU."""
    torch._dynamo.reset()  # each variant compiles afresh (and never hits the recompile limit)
    from torch._dynamo.utils import counters

    counters.clear()
    cfg = Eagle3Config(**SHAPES[args.shape], draft_vocab_size=args.draft_vocab, aux_layer_ids=[2, 18, 33])
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg).to(device)
    lm_head = torch.randn(cfg.vocab_size, cfg.target_hidden_size, device=device) * 0.02
    # Real targets put their argmax inside a calibrated draft vocabulary at ~90%+ of positions; a
    # random head would at ~V_draft/V of them and make the lm_head look cheap. Larger draft rows
    # make nearly every position scored, as in the plain-torch yardstick.
    lm_head[: cfg.draft_vocab_size] *= 3.0
    cuda = device.type == "cuda"
    lm_head = lm_head.to(torch.bfloat16 if cuda else torch.float32)
    head = TeacherHead(lm_head, draft.d2t, draft.t2d)
    fp8_module.FAST_ACCUM.update(variant.fast_accum_table())
    fp8_module.FP8_LINEARS = fp8_module.ALL_LINEARS if variant.fp8_all_linears else fp8_module.MLP_LINEARS
    teacher_as_before_12_05(variant.teacher_per_depth)
    objective = DraftObjective(draft, "final_hidden", head, ttt_length=args.ttt_length, attention=variant.attention,
                               compile=variant.compile, fp8=variant.fp8)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=cuda)
    batch = synthetic_batch(args.rows, args.tokens, cfg, device)
    features = {"aux_hidden_states": batch["aux"], "final_hidden_state": batch["final"]}
    if not cuda:
        features = {k: v.float() for k, v in features.items()}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        """One training step; its loss and per-depth scored counts, left on the device."""
        with autocast:
            out = objective(features, batch["input_ids"], batch["position_ids"], batch["loss_mask"], batch["doc_ids"])
        loss = sum(0.8**i * s / c.clamp(min=1) for i, (s, c) in enumerate(zip(out.loss_sums, out.counts, strict=True)))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach(), torch.stack(out.counts)

    losses, warmup_s = [], []
    for _ in range(args.warmup):
        t0 = time.perf_counter()
        losses.append(float(step()[0]))
        warmup_s.append(time.perf_counter() - t0)
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss, scored = step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))  # after the clock: the step is timed without this sync
    # From the last timed step (one batch throughout): another forward, without gradients, would
    # make a compiled step trace and compile again.
    scored_fraction = float(scored.double().mean()) / (args.rows * args.tokens)
    step_s = sorted(times)[len(times) // 2]
    # The same number of steps back to back, one sync at the end, as the trainer runs (it waits
    # for the GPU at log steps only): the host prepares a step while the GPU runs the one before,
    # unless something in the step waits for the GPU.
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss, _ = step()
    _sync(device)
    back_to_back_s = (time.perf_counter() - t0) / args.steps
    losses.append(float(loss))
    tokens = args.rows * args.tokens
    flops = step_flops_per_token(cfg, args.ttt_length, scored_fraction) * tokens
    result = {
        "variant": str(variant), "attention": variant.attention, "compile": str(variant.compile), "fp8": variant.fp8,
        "fp8_fast_accum": dict(fp8_module.FAST_ACCUM) if variant.fp8 else None,
        "fp8_linears": list(fp8_module.FP8_LINEARS) if variant.fp8 else None,
        "tokens_per_step": tokens, "step_ms_median": round(1000 * step_s, 1), "tokens_per_s": round(tokens / step_s),
        "back_to_back_step_ms": round(1000 * back_to_back_s, 1),
        "back_to_back_tokens_per_s": round(tokens / back_to_back_s),
        # The first warm-up step traces and compiles (graph: the next ones record the CUDA graphs).
        "compile_s": round(warmup_s[0], 1) if warmup_s else None,
        "model_tflops": round(flops / step_s / 1e12, 1),
        "scored_fraction": round(scored_fraction, 3),
        # The same batch every step from the same initial draft: the variants' losses should agree.
        "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
    }
    if variant.compile != CompileMode.OFF:
        # Whether the step stayed whole: graphs traced, breaks, and CUDA graphs inductor declined
        # (their reasons go to the log with TORCH_LOGS=perf_hints, which step-modes sets).
        from torch._dynamo.utils import counters

        result["dynamo"] = {"unique_graphs": counters["stats"]["unique_graphs"],
                            "graph_breaks": sum(counters["graph_break"].values()),
                            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}
    if peak_tflops:
        result["mfu_vs_measured_matmul"] = round(flops / step_s / 1e12 / peak_tflops, 3)
    if cuda:
        result["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
    if profile_dir is not None:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize(device)
        profile_dir.mkdir(parents=True, exist_ok=True)
        file_name = str(variant).replace("+", "-")  # the device tool returns no file with '+' in its name
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=80, max_name_column_width=90)
        (profile_dir / f"profile-{file_name}.txt").write_text(table)
        print(table[:6000])
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize(device)
        trace = profile_dir / f"trace-{file_name}.json"
        prof.export_chrome_trace(str(trace))
        result["gpu_idle"] = gpu_idle(json.loads(trace.read_text())["traceEvents"], steps=3)
        trace.unlink()  # hundreds of MB; the summary is what is kept
        print(json.dumps(result["gpu_idle"], indent=1))
    return result


def gpu_idle(events: list[dict[str, Any]], steps: int, top: int = 12) -> dict[str, Any]:
    """Where the GPU waits, from a chrome trace of ``steps`` steps: busy = the union of kernel,
    memcpy and memset intervals; every gap between them is idle, binned by length."""
    work = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                  key=lambda e: e["ts"])
    gaps: list[tuple[float, str, str]] = []
    busy, reach, last = 0.0, work[0]["ts"], work[0]
    for e in work:
        end = e["ts"] + e["dur"]
        if e["ts"] > reach:
            gaps.append((e["ts"] - reach, last["name"][:70], e["name"][:70]))
        if end > reach:
            busy += end - max(e["ts"], reach)
            reach, last = end, e
    span = reach - work[0]["ts"]
    bins = {"<10us": 0.0, "10-100us": 0.0, "0.1-1ms": 0.0, ">=1ms": 0.0}
    for length, _, _ in gaps:
        bins["<10us" if length < 10 else "10-100us" if length < 100 else "0.1-1ms" if length < 1000 else ">=1ms"] += length
    waits = [e["name"] for e in events if e.get("cat") == "cuda_runtime"
             and e["name"] in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")]
    return {
        "steps": steps, "span_ms_per_step": round(span / 1e3 / steps, 1), "busy_ms_per_step": round(busy / 1e3 / steps, 1),
        "idle_fraction": round(1 - busy / span, 3), "kernels_per_step": len(work) // steps,
        "gaps_per_step": len(gaps) // steps, "idle_ms_per_step_by_gap": {k: round(v / 1e3 / steps, 1) for k, v in bins.items()},
        "host_syncs_per_step": len(waits) / steps,
        "longest_gaps": [{"ms": round(g / 1e3, 3), "after": a, "before": b} for g, a, b in sorted(gaps, reverse=True)[:top]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per packed row")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--variants", nargs="+", default=["flex+layers"],
                        help="ATTENTION[+MODE][+fp8]: attention flex or eager; MODE off, layers (or compile: the "
                             "norms, MLP, flex and the loss kernel), step or graph (pipelines.train.compile_modes)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", default=None, help="write torch.profiler tables here")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    peak = measure_matmul_tflops(device)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                               "bf16_matmul_tflops_measured": round(peak, 1), "args": vars(args), "variants": []}
    for i, variant in enumerate(args.variants):
        profile_dir = Path(args.profile) if args.profile and i == 0 else None
        try:
            row = run_variant(args, StepVariant.parse(variant), device, peak, profile_dir)
        except torch.OutOfMemoryError:
            row = {"variant": variant, "error": "OOM"}
            torch.cuda.empty_cache()
        torch.cuda.empty_cache()
        results["variants"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        write_results(args.out, results)
    return 0

