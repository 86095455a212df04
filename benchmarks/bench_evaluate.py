"""Acceptance length and wall-time speedup of a draft on the reference target (issue 5, "Benchmark").

Runs ``pipelines.evaluate.run_evaluation`` on the same prompts for chains of 3/5/7 and the EAGLE-2
trees 8/5/31 and 10/7/60 (top_k/depth/total_draft_tokens), each greedy and at temperature 1.0,
with target-only decoding of the same prompts as the speedup baseline (batch size 1). Prints a
markdown table and writes everything to ``--out`` (JSON). Greedy settings also report how many
outputs equal target-only greedy and where the others first diverge: identical in float32; in
bf16 (the CUDA default) a near-tie argmax can flip in the tree forward's different reduction order.

CPU (small config, ~minutes on 2 cores)::

    python -m benchmarks.bench_evaluate --draft runs/reference-eagle3/checkpoints/final \
        --out benchmarks/results/evaluate-cpu.json

CUDA (the default config there: 100 prompts, 256 new tokens, bf16)::

    python -m benchmarks.bench_evaluate --draft runs/reference-eagle3/checkpoints/final \
        --device cuda --out benchmarks/results/evaluate-h200.json
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, run_modes, write_results

CHAINS = (3, 5, 7)
TREES = ((8, 5, 31), (10, 7, 60))


def settings(
    temperatures: list[float], chains: tuple[int, ...], trees: tuple
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for temperature in temperatures:
        out += [{"num_draft_tokens": n, "temperature": temperature} for n in chains]
        out += [
            {
                "draft_top_k": k,
                "draft_depth": d,
                "total_draft_tokens": t,
                "temperature": temperature,
            }
            for k, d, t in trees
        ]
    return out


def markdown(results: dict[str, Any]) -> str:
    rows = [
        "| setting | acceptance length | accept rate per depth | tok/s | target-only tok/s | speedup "
        "| draft s | target s | greedy = target-only |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in results["settings"]:
        rates = " ".join(
            f"{r:.2f}" if r is not None else "-" for r in s["acceptance_rate_per_depth"]
        )
        agreement = s.get("greedy_agreement")
        if agreement:
            where = [d["first_divergence"] for d in agreement["diverged"]]
            agree = f"{agreement['identical']}/{agreement['num_prompts']}"
            if where:
                agree += f" (first divergence at tokens {sorted(where)[:8]})"
        else:
            agree = "n/a (sampled)"
        base = s.get("target_only", {})
        rows.append(
            f"| {s['name']} | {s['acceptance_length']:.3f} | {rates} | {s['tokens_per_second']:.1f} "
            f"| {base.get('tokens_per_second', 0.0):.1f} | {s.get('speedup', 0.0):.2f}x "
            f"| {s['draft_seconds']:.1f} | {s['target_seconds']:.1f} | {agree} |"
        )
    return "\n".join(rows)


def decode_settings(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--draft", required=True, help="project checkpoint or exported eagle3/eagle4 dir"
    )
    parser.add_argument("--target", default=str(REPO_ROOT / "examples" / "reference-target"))
    parser.add_argument(
        "--prompts", default=str(REPO_ROOT.parent / "shared" / "data" / "eval_prompts.jsonl")
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument(
        "--dtype", default=None, help="default: float32 on the CPU, bfloat16 on CUDA"
    )
    parser.add_argument(
        "--limit", type=int, default=None, help="prompts (default: 16 CPU, 100 CUDA)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="default: 64 CPU, 256 CUDA"
    )
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--chains", type=int, nargs="*", default=list(CHAINS))
    parser.add_argument(
        "--trees",
        nargs="*",
        default=[f"{k}/{d}/{t}" for k, d, t in TREES],
        help="top_k/depth/total",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the full results as JSON")
    args = parser.parse_args(argv)

    import torch

    from pipelines.evaluate import EvaluateRecipe, run_evaluation
    from pipelines.recipe import build_recipe

    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    trees = tuple(tuple(int(x) for x in spec.split("/")) for spec in args.trees)
    with tempfile.TemporaryDirectory(prefix="bench-evaluate-") as workdir:
        recipe = build_recipe(
            EvaluateRecipe,
            {
                "target": args.target,
                "draft": args.draft,
                "prompts": args.prompts,
                "output_dir": workdir,
                "limit": args.limit or (100 if cuda else 16),
                "max_new_tokens": args.max_new_tokens or (256 if cuda else 64),
                "save_outputs": False,
                "settings": settings(args.temperatures, tuple(args.chains), trees),
                "dtype": args.dtype or ("bfloat16" if cuda else "float32"),
                "device": "cuda" if cuda else "cpu",
                "seed": args.seed,
                "warmup_tokens": 16,
            },
        )
        start = time.perf_counter()
        results = run_evaluation(recipe)
        elapsed = time.perf_counter() - start
    results["benchmark"] = {
        "seconds": elapsed,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "machine": platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    print(
        f"draft {args.draft} on {args.target}: {results['num_prompts']} prompts, "
        f"max_new_tokens {recipe.max_new_tokens}, {recipe.dtype} on {results['device']} "
        f"({elapsed:.0f} s)\n"
    )
    print(markdown(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_results(args.out, results)
    return 0


# Modes: ``python -m benchmarks.bench_evaluate MODE --help``; without a mode, :func:`decode_settings` runs.
MODES = {
    "reference-draft": "benchmarks.evaluate.reference_draft",
    "ceiling": "benchmarks.evaluate.ceiling",
}


def main(argv: list[str] | None = None) -> int:
    return run_modes(argv, decode_settings, MODES, prog="python -m benchmarks.bench_evaluate")


if __name__ == "__main__":
    sys.exit(main())
