"""Issue 31's extraction aims on one GPU: the bare Hugging Face forward, ``hsstore extract`` eager
and compiled (Ray, one actor, bf16), the compiled features against eager ones on the same batches,
and the start of a ~1M-token job. Writes the ``extract`` section of
``benchmarks/results/gpu-limit-h200.json`` (``report --write`` merges it in, leaving ``train``).

Steps, each in its own process so that every GPU step starts from a clean device (through_ray.py's
steps, reused): ``prepare`` (the Qwen3-8B shape with random bf16 weights saved as a model
directory, a word-level tokenizer, ``--tokens`` of 1,024-2,048-token text records); ``bare``
(``model.model(input_ids)``, no mask, over exactly the batches the extraction plans); the run
``bf16-1`` (``model.compile: false``); the run ``bf16-1-compiled-background`` (``model.compile: true``
as the default starts it: eager units while the layers compile in the background, with an inductor
cache as cold as the machine's): the start and the job's wall (through Ray unless ``--executor``
says otherwise; ``--executor auto``, the recipes' default, runs a one-GPU job in process); the run ``bf16-1-compiled`` (ready
only once compiled: every unit compiled): the steady state; ``compare`` (the compiled store's first
unit against the eager capture code on the same batches, in process).

Tokens/s of a run are its real tokens over its extracting time (the summary's ``extract_seconds``:
from the workers ready, models loaded, warmed up and compiled, to the last commit): the steady
state. The start is reported apart: ``model_load_seconds``, the warm-up (the compile), the first
forward from the job's start, and the job's wall time (``run_extraction``'s, from the same start;
the process's, Python's imports and Ray's shutdown included, is beside it). Each run gets a fresh
``HSSTORE_CACHE_DIR``, so its lineage hashes the 16 GB of weights afresh (no digest remembered
from an earlier run) and the fast start is measured with the whole hash beside it; the page cache
does hold the weights (``prepare`` just wrote them), for the hash and the model load alike.

    # one H200, from the repository root, after `bash .gpu/setup.sh` (~6-7 min):
    PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks.bench_extract gpu-limit run --out $OUT
    # here, with the folder that came back:
    python -m benchmarks.bench_extract gpu-limit report OUT/gpu-limit-extract.json --write
    # CPU smoke (tiny model, in process, inductor's C++ kernels: a few minutes):
    python -m benchmarks.bench_extract gpu-limit run --shape small --device cpu --executor local \\
        --tokens 1500 --min-length 64 --max-length 200 --max-length-cap 256 --token-budget 512 \\
        --unit-tokens 1024 --out /tmp/out
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT
from benchmarks.extract import through_ray
from benchmarks.extract.through_ray import log, store_path

RESULTS = REPO_ROOT / "benchmarks" / "results" / "gpu-limit-h200.json"
OUT_NAME = "gpu-limit-extract.json"
EAGER, COMPILED, DEFAULT = "bf16-1", "bf16-1-compiled", "bf16-1-compiled-background"
# The default start with the weights read by from_pretrained itself (model.weights_loader:
# transformers), beside DEFAULT's checkpoint reader in the same call.
DEFAULT_HF_LOAD = "bf16-1-compiled-background-hfload"
RUN_CHOICES = {EAGER: "eager", DEFAULT_HF_LOAD: "default-hfload", DEFAULT: "default", COMPILED: "compiled"}  # --runs
# What each extraction run reports beside its tokens/s (the summary's start-up fields).
START_FIELDS = ("wall_seconds", "process_seconds", "extract_seconds", "prepare_seconds", "executor_start_seconds",
                "worker_start_seconds", "model_load_seconds", "host_buffers_seconds", "warmup_seconds",
                "workers_ready_seconds", "first_unit_planned_seconds", "first_forward_seconds", "compiled",
                "compiled_graphs", "units_run_eager_while_compiling", "compile_seconds", "fingerprint_seconds", "lineage_wait_seconds", "head_seconds", "tail_seconds",
                "gpu_forward_seconds", "padding_waste", "num_tokens_written")


def run(args: argparse.Namespace) -> None:
    """prepare, bare, eager, compiled, compare; the JSON is rewritten after each step."""
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    state: dict[str, Any] = {"machine": through_ray.machine_facts(args), "bare": None, "runs": {}, "compared": None}
    through_ray.step(args, "prepare", "--tokens", str(args.tokens), "--min-length", str(args.min_length),
                     "--max-length", str(args.max_length))
    gpus = 1 if args.device == "cuda" else 0

    def attempt(name: str, action: Any) -> None:
        if time.time() - started > args.deadline_s:
            log(f"skipped {name}: past --deadline-s {args.deadline_s}")
            return
        try:
            action()
        except (SystemExit, Exception) as err:  # noqa: BLE001 - one failed step must not lose the others
            log(f"{name} failed: {err}")
        write(out / OUT_NAME, state, args, started)

    def extraction(name: str) -> None:
        # The hash from scratch, and a compile as cold as a new machine's whatever ran before.
        with tempfile.TemporaryDirectory(prefix="hsstore-hash-cache-") as cache, \
                tempfile.TemporaryDirectory(prefix="hsstore-inductor-") as inductor:
            env = {**os.environ, "HSSTORE_CACHE_DIR": cache, "TORCHINDUCTOR_CACHE_DIR": inductor}
            state["runs"][name] = through_ray.extract(args, name, env=env, codec="bf16", workers=1, gpus_per_worker=gpus,
                                                      limit=None)

    if not args.skip_bare:
        attempt("bare", lambda: state.update(bare=through_ray.step(args, "bare")))
    # DEFAULT before COMPILED: its compile finds the inductor cache cold. An 8B bf16 store of 1M
    # tokens is 33 GB: each is removed once measured (COMPILED's after the comparison).
    chosen = args.runs.split(",")
    for name in (EAGER, DEFAULT_HF_LOAD, DEFAULT, COMPILED):
        if RUN_CHOICES[name] in chosen:
            attempt(name, lambda name=name: extraction(name))
            if name != COMPILED:
                shutil.rmtree(store_path(args, name), ignore_errors=True)
    if COMPILED in state["runs"]:
        attempt("compare", lambda: state.update(compared=through_ray.step(args, "compare", mode="gpu-limit")))
    shutil.rmtree(work / "stores", ignore_errors=True)
    results = write(out / OUT_NAME, state, args, started)
    print(json.dumps(results["extract"], indent=2))


def compare(args: argparse.Namespace) -> None:
    """The compiled store against the eager capture code on its first unit's batches, with the
    target in bf16 (the issue's figure) and in float32: the truth both bf16 forwards are compared
    with, as tests/pipelines/extract/test_compiled_layers.py does on the reference target."""
    errors, compared = through_ray.same_batches_error(args, COMPILED, None, references=("bfloat16", "float32"))
    result = {
        "max_feature_rel_err": errors["store_vs_bfloat16"],
        "compiled_vs_float32_rel_err": errors["store_vs_float32"],
        "eager_vs_float32_rel_err": errors["bfloat16_vs_float32"],
        "samples_compared": compared,
    }
    log(f"compiled vs eager, same batches: max relative error {result['max_feature_rel_err']:.2e}; vs float32: "
        f"compiled {result['compiled_vs_float32_rel_err']:.2e}, eager {result['eager_vs_float32_rel_err']:.2e} "
        f"({compared} samples)")
    print(json.dumps(result))


def write(path: Path, state: dict[str, Any], args: argparse.Namespace, started: float) -> dict[str, Any]:
    """The issue's ``extract`` keys from what ran so far (None for a step that did not), and the
    runs' details beside them."""
    eager, compiled = state["runs"].get(EAGER), state["runs"].get(COMPILED)
    bare = state["bare"] or {}
    # The start of the default configuration (compiled in the background on CUDA).
    head = state["runs"].get(DEFAULT) or compiled or eager or {}

    def tps(run: dict[str, Any] | None) -> float | None:
        return run["tokens_per_second"] if run else None

    extract = {
        "bare_hf_tokens_per_s": bare.get("bare_tokens_per_s"),
        "eager_tokens_per_s": tps(eager),
        "compiled_tokens_per_s": tps(compiled),
        "max_feature_rel_err": (state["compared"] or {}).get("max_feature_rel_err"),
        "job_wall_seconds_1m_tokens": head.get("wall_seconds"),
        "first_forward_seconds": head.get("first_forward_seconds"),
        "model_load_seconds": head.get("model_load_seconds"),
    }
    results = {
        "extract": extract,
        "details": {
            "num_tokens": head.get("num_tokens_written") or bare.get("num_tokens"),
            "compiled_vs_bare": ratio(tps(compiled), bare.get("bare_tokens_per_s")),
            "eager_vs_bare": ratio(tps(eager), bare.get("bare_tokens_per_s")),
            "compiled_vs_eager": ratio(tps(compiled), tps(eager)),
            "job_wall_vs_extracting": ratio(head.get("wall_seconds"), head.get("extract_seconds")),
            "model_load_seconds_from_pretrained": (state["runs"].get(DEFAULT_HF_LOAD) or {}).get("model_load_seconds"),
            # The yardstick for max_feature_rel_err: each bf16 forward against the float32 one on the
            # same batches (within bf16 tolerance: compiled no further from float32 than eager, the
            # CPU test's bound 1.5 x eager's + 2e-3).
            **{key: (state["compared"] or {}).get(key) for key in
               ("compiled_vs_float32_rel_err", "eager_vs_float32_rel_err", "samples_compared")},
            "runs": {name: {k: run.get(k) for k in ("tokens_per_second", *START_FIELDS)} for name, run in state["runs"].items()},
            "bare": state["bare"],
            "note": "tokens/s: real tokens over the extracting time (workers ready to the last commit); the start "
            "(model load, warm-up with the first compile, first forward from the job's start) apart. job wall: "
            "run_extraction's wall time, the same origin as first_forward_seconds (process_seconds adds Python's "
            "imports and Ray's shutdown). max_feature_rel_err: the compiled store vs the eager capture code on the "
            "same batches (largest per-token relative L2 error, aux and final states). Each run hashed the weights "
            "afresh (its own HSSTORE_CACHE_DIR); the weights were in the page cache.",
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("func", "out", "work", "command")},
        "machine": state["machine"],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "wall_seconds": time.time() - started,
    }
    path.write_text(json.dumps(results, indent=2) + "\n")
    return results


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def report(args: argparse.Namespace) -> None:
    """Print the aims beside the measured figures; ``--write`` merges the run into RESULTS."""
    measured = json.loads(Path(args.json).read_text())
    extract, details = measured["extract"], measured["details"]
    aims = [
        ("compiled / bare HF forward", details.get("compiled_vs_bare"), ">= 1.10"),
        ("eager / bare HF forward", details.get("eager_vs_bare"), ""),
        ("max feature rel err, compiled vs eager", extract.get("max_feature_rel_err"), "bf16 rounding"),
        ("the same vs float32: compiled (eager)", details.get("compiled_vs_float32_rel_err"),
         f"<= 1.5 x eager's + 2e-3 (eager {fmt(details.get('eager_vs_float32_rel_err'))})"),
        ("first forward s (model load s)", extract.get("first_forward_seconds"),
         f"<= load + 10 s (load {fmt(extract.get('model_load_seconds'))})"),
        ("job wall / extracting", details.get("job_wall_vs_extracting"), "<= 1.4"),
    ]
    print("| what | measured | aim |\n|---|---:|---|")
    for label, value, aim in aims:
        print(f"| {label} | {fmt(value)} | {aim} |")
    # Where the start goes, run by run: from the job's start (at), or how long (s).
    steps = [("prepared (at)", "prepare_seconds"), ("executor started (s)", "executor_start_seconds"),
             ("first worker up (at)", "worker_start_seconds"), ("model load (s)", "model_load_seconds"),
             ("host buffers (s)", "host_buffers_seconds"), ("warm-up (s; -compiled: the compile included)", "warmup_seconds"),
             ("units eager while compiling", "units_run_eager_while_compiling"),
             ("workers ready (at)", "workers_ready_seconds"), ("first unit planned (at)", "first_unit_planned_seconds"),
             ("first forward (at)", "first_forward_seconds"), ("lineage hashed beside it (s)", "fingerprint_seconds"),
             ("job wall (s)", "wall_seconds"), ("extracting (s)", "extract_seconds")]
    runs = details.get("runs", {})
    print("\n| start | " + " | ".join(runs) + " |\n|---|" + "---:|" * len(runs))
    for label, key in steps:
        print(f"| {label} | " + " | ".join(fmt(run.get(key)) for run in runs.values()) + " |")
    if args.write:
        path = Path(args.results)
        results = json.loads(path.read_text()) if path.exists() else {}
        # A run of some of the extractions (--runs) leaves the figures of the others as an
        # earlier run measured them, and says which and when; the train section is left as it is.
        earlier_details = results.get("extract_details", {})
        kept = not_measured_here(extract, results.get("extract", {}))
        results["extract"] = {**extract, **kept}
        # A figure already carried once keeps the date it was measured.
        dates = earlier_details.get("carried_from_earlier_runs", {})
        carried = {key: dates.get(key, earlier_details.get("date")) for key in kept}
        details = {**details, **not_measured_here(details, earlier_details)}
        details["runs"] = {**earlier_details.get("runs", {}), **details.get("runs", {})}
        results["extract_details"] = {**details, "machine": measured["machine"], "date": measured["date"],
                                      "settings": measured["settings"], "carried_from_earlier_runs": carried}
        path.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote the extract section of {path}")


def not_measured_here(measured: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
    """The earlier figures of the keys this run left None (the extractions ``--runs`` skipped)."""
    return {key: earlier[key] for key, value in measured.items() if value is None and earlier.get(key) is not None}


def fmt(value: Any) -> str:
    if value is None:
        return "not run"
    return f"{value:,.0f}" if isinstance(value, float) and value >= 100 else f"{value:.3g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_extract gpu-limit", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["run", "compare", "report"])
    parser.add_argument("json", nargs="?", help="report: the gpu-limit-extract.json a run wrote")
    parser.add_argument("--write", action="store_true", help="report: merge the extract section into --results")
    parser.add_argument("--results", default=str(RESULTS), help="report --write: the results file")
    through_ray.add_workload_arguments(parser, work="/tmp/hsstore-work/gpu-limit", tokens=1_000_000, deadline_s=420)
    parser.add_argument("--runs", default="eager,default,compiled",
                        help=f"which extractions run (eager: {EAGER}, default: {DEFAULT}, default-hfload: {DEFAULT_HF_LOAD} "
                        f"(default's start with from_pretrained reading the weights), compiled: {COMPILED}; "
                        "the start is default's, else compiled's)")
    parser.add_argument("--skip-bare", action="store_true",
                        help="no bare forward (runs compared with each other only; report --write keeps the earlier bare figure)")
    parser.add_argument("--split-records", type=int, default=200, help=argparse.SUPPRESS)  # through_ray.step passes it
    args = parser.parse_args(argv)
    unknown = set(args.runs.split(",")) - set(RUN_CHOICES.values())
    if unknown:
        parser.error(f"--runs: unknown {', '.join(sorted(unknown))} (choose from {', '.join(RUN_CHOICES.values())})")
    if args.command == "report" and not args.json:
        parser.error("report needs the gpu-limit-extract.json a run wrote")
    {"run": run, "compare": compare, "report": report}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
