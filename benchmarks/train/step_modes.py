"""The training step's compile modes and FP8 side by side, and FP8's held-out accuracy (issue 31).

One GPU call (one H200, about 7 minutes; each part bounded on its own):

    python -m benchmarks.bench_train step-modes --part throughput --out $OUT/gpu-limit-h200.json
    python -m benchmarks.bench_train step-modes --part quality --out $OUT/gpu-limit-h200.json
    python -m benchmarks.bench_train step-modes --quick --out /tmp/step-modes.json     # CPU smoke

**throughput**: the ``profile`` mode's synthetic step (:mod:`benchmarks.train.profile_step`) at the
Qwen3-8B shape with random weights: rows of 8,192 tokens of 1-2k-token documents, a 32,000-id draft
vocabulary, TTT 7, 99.6% of positions scored; teacher + unroll + loss + backward + clipping +
fused AdamW. The variants (``ATTENTION+MODE[+fp8]``, :class:`~benchmarks.train.profile_step.StepVariant`)
run one after another in the order given: by default ``flex+layers`` (today's CUDA default),
``flex+graph``, ``flex+graph+fp8``, ``flex+step``, ``flex+layers+fp8``. Each is the median of
``--steps`` steps after ``--warmup``, the first of which compiles (``compile_s``), measured in a
child process of its own (stopped after ``--variant-budget-s``; a variant that breaks does not
break the next). A variant with less than ~45 s left before ``--deadline-s`` is skipped and says
so; the results file is rewritten after every variant, so a call cut short keeps what it measured.

**quality**: the reference target's store (``draft_train.jsonl``, or the repository's bundled
slice of it where that is absent, as on the GPU box; extracted here in bf16) and a held-out store
from the records after those; the same recipe (seed, samples and their order) trained
``--quality-steps`` steps with ``fp8: false`` and ``fp8: true`` (the compile mode is the recipe
default for both); then each final draft's per-depth accuracy on the held-out store, in float32
(a draft trained in FP8 is served in bf16: its weights are what is compared).

Results go to the ``train`` section of ``--out``, merged (the file's other sections, such as
``extract``, are kept): ``all_scored_bf16_tokens_per_s`` and ``all_scored_fp8_tokens_per_s`` (the
fastest bf16 and FP8 variants), ``fp8_speedup``, ``fp8_heldout_acc_rel_delta`` (the held-out
accuracy averaged over depths, FP8 against bf16, relative), and every variant's row.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import run_python_module, update_section, write_results
from benchmarks.train.profile_step import StepVariant, measure_matmul_tflops, run_variant

SECTION = "train"
GPU_VARIANTS = ["flex+layers", "flex+graph", "flex+graph+fp8", "flex+step", "flex+layers+fp8"]
# The CPU smoke: flex has no backward on the CPU, and compiling there takes minutes.
QUICK_VARIANTS = ["eager+off", "eager+off+fp8"]
# Less time than this left before the deadline: the variant is not started (it could not compile).
MIN_VARIANT_S = 45.0


# -- throughput -----------------------------------------------------------------------------------


def summarize(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The section's headline keys from the variants measured so far."""
    measured = [row for row in rows.values() if "tokens_per_s" in row]
    summary: dict[str, Any] = {"step_variants": rows}
    best = {}
    for fp8 in (False, True):
        candidates = [row for row in measured if row["fp8"] == fp8]
        if candidates:
            best[fp8] = max(candidates, key=lambda row: row["tokens_per_s"])
    if False in best:
        summary["all_scored_bf16_tokens_per_s"] = best[False]["tokens_per_s"]
        summary["all_scored_bf16_variant"] = best[False]["variant"]
        # Steps back to back, as the trainer runs them (profile_step.run_variant); None in rows
        # measured before it was timed.
        summary["all_scored_bf16_back_to_back_tokens_per_s"] = best[False].get("back_to_back_tokens_per_s")
    if True in best:
        summary["all_scored_fp8_tokens_per_s"] = best[True]["tokens_per_s"]
        summary["all_scored_fp8_variant"] = best[True]["variant"]
    if len(best) == 2:
        summary["fp8_speedup"] = round(best[True]["tokens_per_s"] / best[False]["tokens_per_s"], 3)
    layers = next((row for row in measured if row["compile"] == "layers" and not row["fp8"]), None)
    if layers is not None:  # what the trainer runs on CUDA today (compile: auto)
        summary["layers_bf16_tokens_per_s"] = layers["tokens_per_s"]
    return summary


def measure_variant(args: argparse.Namespace) -> dict[str, Any]:
    """One variant in this process (``--part variant``, what :func:`throughput` runs each time)."""
    device = torch.device(args.device)
    step_args = argparse.Namespace(shape=args.shape, tokens=args.tokens, rows=args.rows, draft_vocab=args.draft_vocab,
                                   ttt_length=7, steps=args.steps, warmup=args.warmup)
    return run_variant(step_args, StepVariant.parse(args.variant), device, args.peak_tflops, None)


def _variant_in_child(args: argparse.Namespace, text: str, timeout_s: float, peak: float | None) -> dict[str, Any]:
    """``text`` measured in a child process: a variant that hangs in compilation is cut at
    ``timeout_s``, and one that breaks its CUDA context (or its dynamo caches, or fragments the
    memory) does not take the next variants with it."""
    with tempfile.TemporaryDirectory() as tmp:
        row_file = Path(tmp) / "row.json"
        argv = ["step-modes", "--part", "variant", "--variant", text,
                "--device", args.device, "--shape", args.shape, "--tokens", str(args.tokens), "--rows", str(args.rows),
                "--draft-vocab", str(args.draft_vocab), "--steps", str(args.steps), "--warmup", str(args.warmup),
                "--row-out", str(row_file)]
        if peak:
            argv += ["--peak-tflops", str(peak)]
        # perf_hints: why inductor declined to capture CUDA graphs, if it did.
        env = {**os.environ, "TORCH_LOGS": os.environ.get("TORCH_LOGS", "perf_hints")}
        try:
            proc = run_python_module("benchmarks.bench_train", argv, env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"variant": text, "error": f"timeout: no result within {timeout_s:.0f} s (compilation included)"}
        if proc.returncode != 0 or not row_file.exists():
            # The exception's own line (an inductor error's is followed by pages of IR).
            raised = [line for line in proc.stderr.splitlines() if re.match(r"^[\w.]+(Error|Exception)\b", line)]
            return {"variant": text, "error": f"exit {proc.returncode}: {proc.stderr[-3000:]}",
                    "raised": raised[-1][:1000] if raised else None}
        row = json.loads(row_file.read_text())
        hints = [line[:300] for line in proc.stderr.splitlines() if "cudagraph" in line.lower()]
        if hints:
            row["cudagraph_notes"] = hints[:5]
        return row


def throughput(args: argparse.Namespace, started: float) -> dict[str, Any]:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    peak = measure_matmul_tflops(device) if cuda else None
    setup = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
             "shape": args.shape, "tokens_per_row": args.tokens, "rows": args.rows, "draft_vocab": args.draft_vocab,
             "steps": args.steps, "warmup": args.warmup,
             "bf16_matmul_tflops_measured": round(peak, 1) if peak else None}
    if cuda:
        torch.cuda.empty_cache()  # the children need the memory, not this process
    rows: dict[str, dict[str, Any]] = {}
    for text in args.variants:
        spent = time.monotonic() - started
        left = args.deadline_s - spent
        if left < MIN_VARIANT_S:
            rows[text] = {"variant": text, "skipped": f"deadline: {spent:.0f} of {args.deadline_s:.0f} s spent"}
            continue
        row = _variant_in_child(args, text, min(args.variant_budget_s, left), peak)
        row["after_s"] = round(time.monotonic() - started, 1)
        rows[text] = row
        print(json.dumps(row), flush=True)
        if args.out:
            update_section(args.out, SECTION, {**summarize(rows), "step_setup": setup})
    return {**summarize(rows), "step_setup": setup}


# -- quality --------------------------------------------------------------------------------------


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def quality(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.bench_train import (
        REFERENCE_TARGET,
        TRAIN_DATA,
        extract_reference,
        held_out_accuracy,
        make_recipe,
    )
    from pipelines.train.trainer import run_training
    from tests.support.paths import TRAIN_SLICE

    device = torch.device(args.device)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="step-modes-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        # The full record set where it is (a development machine, HSSTORE_TRAIN_DATA); the GPU box
        # gets only the repository, whose bundled slice then serves, split the same way.
        data = TRAIN_DATA if TRAIN_DATA.exists() else TRAIN_SLICE
        num_records = sum(1 for line in data.read_text().splitlines() if line.strip())
        held_out_records = min(args.held_out_records, num_records // 5)
        records = min(args.records, num_records - held_out_records)
        train_store, held_out = workdir / "ref-bf16", workdir / "ref-held-out"
        t0 = time.monotonic()
        if not train_store.exists():
            extract_reference(train_store, data, records, args.max_length, "bf16", args.device)
        if not held_out.exists():
            extract_reference(held_out, data, held_out_records, args.max_length, "bf16", args.device, skip=records)
        recipe_args = argparse.Namespace(device=args.device, draft_vocab=args.quality_draft_vocab,
                                         token_budget=args.quality_token_budget, read_threads=4, rows=1,
                                         lr=args.lr, steps=args.quality_steps)
        setup = {"target": "examples/reference-target", "data": data.name,
                 "records": records, "held_out_records": held_out_records, "max_length": args.max_length,
                 "token_budget": args.quality_token_budget, "draft_vocab": args.quality_draft_vocab,
                 "extract_s": round(time.monotonic() - t0, 1)}
        runs: dict[str, Any] = {}
        for name, fp8 in (("bf16", False), ("fp8", True)):
            out = workdir / f"quality-{name}"
            shutil.rmtree(out, ignore_errors=True)
            recipe = make_recipe(train_store, REFERENCE_TARGET, out, recipe_args, max_steps=args.quality_steps,
                                 fp8=fp8, verify_weights=False)
            summary = run_training(recipe)
            runs[name] = {"held_out_acc": held_out_accuracy(Path(summary["checkpoint"]), held_out,
                                                            args.quality_token_budget, device),
                          "train_tokens": summary["tokens"], "steps": summary["steps"],
                          "final_loss": summary["final_loss"], "tokens_per_s": round(summary["tokens_per_s"]),
                          "compile": summary["compile"]}  # the mode the run used (auto resolved by the trainer)
            print(name, runs[name], flush=True)
            if args.out:  # each run as it lands: a call cut short keeps the first
                update_section(args.out, SECTION, {"heldout_quality": {**setup, "runs": runs}})
        bf16, fp8_acc = mean(runs["bf16"]["held_out_acc"]), mean(runs["fp8"]["held_out_acc"])
        result = {
            "fp8_heldout_acc_rel_delta": round((fp8_acc - bf16) / bf16, 4) if bf16 else None,
            "fp8_heldout_acc_depth0_rel_delta": round(
                (runs["fp8"]["held_out_acc"][0] - runs["bf16"]["held_out_acc"][0]) / runs["bf16"]["held_out_acc"][0], 4)
            if runs["bf16"]["held_out_acc"][0] else None,
            "heldout_quality": {**setup, "runs": runs},
        }
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.out:
        update_section(args.out, SECTION, result)
    return result


# -- main -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["throughput", "quality", "both", "variant"], default="both",
                        help="variant: one --variant in this process, its row to --row-out (what throughput runs)")
    parser.add_argument("--quick", action="store_true", help="CPU smoke: the reference shape, eager, a tiny quality run")
    parser.add_argument("--device", default=None, help="default cuda if present (cpu with --quick)")
    parser.add_argument("--out", type=Path, default=None, help="merge the results into this JSON's 'train' section")
    throughput_group = parser.add_argument_group("throughput")
    throughput_group.add_argument("--variants", nargs="+", default=None, help=f"default {' '.join(GPU_VARIANTS)}")
    throughput_group.add_argument("--shape", default=None, help="qwen3-8b (default) or reference")
    throughput_group.add_argument("--tokens", type=int, default=None, help="tokens per packed row (8192)")
    throughput_group.add_argument("--rows", type=int, default=1)
    throughput_group.add_argument("--draft-vocab", type=int, default=None, help="32000")
    throughput_group.add_argument("--steps", type=int, default=None, help="timed steps per variant (10)")
    throughput_group.add_argument("--warmup", type=int, default=None, help="untimed steps first (3: compile, record)")
    throughput_group.add_argument("--deadline-s", type=float, default=300.0,
                                  help="start no variant that could end after this many seconds of the part")
    throughput_group.add_argument("--variant-budget-s", type=float, default=150.0,
                                  help="one variant's child process is stopped after this long, compilation included")
    throughput_group.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    throughput_group.add_argument("--row-out", type=Path, default=None, help=argparse.SUPPRESS)
    throughput_group.add_argument("--peak-tflops", type=float, default=None, help=argparse.SUPPRESS)
    quality_group = parser.add_argument_group("quality")
    quality_group.add_argument("--records", type=int, default=None, help="training records (400)")
    quality_group.add_argument("--held-out-records", type=int, default=None,
                               help="held-out records (76), at most a fifth of the records there are")
    quality_group.add_argument("--max-length", type=int, default=None)
    quality_group.add_argument("--quality-steps", type=int, default=None, help="steps per run (120)")
    quality_group.add_argument("--quality-token-budget", type=int, default=None)
    quality_group.add_argument("--quality-draft-vocab", type=int, default=2048)
    quality_group.add_argument("--lr", type=float, default=1e-3)
    quality_group.add_argument("--workdir", default=None, help="keep the stores here (default: a temp dir, removed)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.device = args.device or ("cpu" if quick or not torch.cuda.is_available() else "cuda")
    args.variants = args.variants or (QUICK_VARIANTS if quick else GPU_VARIANTS)
    args.shape = args.shape or ("reference" if quick else "qwen3-8b")
    args.tokens = args.tokens or (256 if quick else 8192)
    args.draft_vocab = args.draft_vocab or (512 if quick else 32000)
    args.steps = args.steps or (2 if quick else 10)
    args.warmup = args.warmup or (1 if quick else 3)
    args.records = args.records or (6 if quick else 400)
    args.held_out_records = args.held_out_records or (4 if quick else 76)
    args.max_length = args.max_length or (128 if quick else 2048)
    args.quality_steps = args.quality_steps or (2 if quick else 120)
    args.quality_token_budget = args.quality_token_budget or (256 if quick else 8192)
    if quick:
        args.quality_draft_vocab = min(args.quality_draft_vocab, 256)
    started = time.monotonic()
    if args.part == "variant":
        write_results(args.row_out, measure_variant(args))
        return 0
    if args.part in ("throughput", "both"):
        throughput(args, started)
    if args.part in ("quality", "both"):
        quality(args)
    return 0
