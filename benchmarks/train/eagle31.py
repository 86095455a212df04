"""EAGLE-3 vs EAGLE-3.1 on the reference target at equal steps (issue 30, "EAGLE-3.1").

Trains two drafts from the same store with the reference recipe (``recipes/reference/
train-eagle3.yaml``), identical in everything (seed, data order, schedule, vocabulary) but
``draft.fc_norm`` and ``draft.norm_output`` (EAGLE-3.1: an RMSNorm per aux layer before fc, the
final-normed hidden fed to the next TTT depth), then measures each one's acceptance length by
really decoding against the target: the EAGLE-2 tree 8/5/31 (top_k/depth/total), temperature 0,
batch size 1, the bundled evaluation prompts. Writes ``--out`` (default
``benchmarks/results/eagle31.json``)::

    {"eagle3_al_tree_t0": x, "eagle31_al_tree_t0": x, "steps": n, ...details}

The store is the reference extraction (``hsstore extract recipes/reference/extract.yaml``, default
``runs/reference-extract``); with ``--extract-limit N`` a missing store is extracted first from the
bundled training records (N of them, local executor).

CPU, small (minutes on 2 cores)::

    python -m benchmarks.bench_train eagle31 --extract-limit 40 --steps 60 --limit 8 --max-new-tokens 48 \
        --store runs/eagle31-store --workdir runs/eagle31 --out benchmarks/results/eagle31-cpu.json

CUDA (one GPU; the store extracted beforehand, or add --extract-limit 160)::

    python -m benchmarks.bench_train eagle31 --device cuda --steps 600 --limit 50 --max-new-tokens 128 \
        --workdir runs/eagle31 --out benchmarks/results/eagle31.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT

VARIANTS = {"eagle3": (False, False), "eagle31": (True, True)}  # name -> (fc_norm, norm_output)
TREE = {"draft_top_k": 8, "draft_depth": 5, "total_draft_tokens": 31, "temperature": 0.0}


def ensure_store(store: Path, target: str, limit: int | None, device: str, extra: list[str]) -> None:
    """Extract the reference store when it is missing and ``limit`` allows it."""
    import hsstore
    from hsstore.errors import StoreNotFoundError

    try:
        hsstore.open_store(str(store))
        return
    except StoreNotFoundError:
        pass
    if limit is None:
        raise SystemExit(
            f"{store}: no store; run `hsstore extract recipes/reference/extract.yaml` or pass "
            "--extract-limit N"
        )
    from pipelines.extract import ExtractRecipe, run_extraction
    from pipelines.recipe import load_recipe

    recipe = load_recipe(
        ExtractRecipe,
        str(REPO_ROOT / "recipes" / "reference" / "extract.yaml"),
        [
            f"target={target}",
            f"data=[{REPO_ROOT / 'examples' / 'data' / 'draft_train_slice.jsonl'}]",
            f"store={store}",
            f"limit={limit}",
            "executor=local",
            f"model.device={device}",
            "model.dtype=" + ("bfloat16" if device == "cuda" else "float32"),
            *extra,
        ],
    )
    run_extraction(recipe)


def train(args: argparse.Namespace, name: str, fc_norm: bool, norm_output: bool) -> dict[str, Any]:
    from pipelines.recipe import load_recipe
    from pipelines.train import TrainRecipe, run_training

    overrides = [
        f"store={args.store}",
        f"target={args.target}",
        f"output_dir={args.workdir / name}",
        f"max_steps={args.steps}",
        f"device={args.device}",
        f"seed={args.seed}",
        f"draft.fc_norm={str(fc_norm).lower()}",
        f"draft.norm_output={str(norm_output).lower()}",
        f"checkpoint_every={max(args.steps, 1)}",
        *args.set,
    ]
    recipe = load_recipe(TrainRecipe, str(REPO_ROOT / "recipes" / "reference" / "train-eagle3.yaml"), overrides)
    start = time.perf_counter()
    summary = run_training(recipe)
    summary["train_seconds"] = time.perf_counter() - start
    return summary


def evaluate(args: argparse.Namespace, name: str, checkpoint: str) -> dict[str, Any]:
    from pipelines.evaluate import EvaluateRecipe, run_evaluation
    from pipelines.recipe import build_recipe

    recipe = build_recipe(
        EvaluateRecipe,
        {
            "target": args.target,
            "draft": checkpoint,
            "prompts": args.prompts,
            "output_dir": str(args.workdir / f"{name}-evaluate"),
            "limit": args.limit,
            "max_new_tokens": args.max_new_tokens,
            "settings": [TREE],
            "dtype": "bfloat16" if args.device == "cuda" else "float32",
            "device": args.device,
            "seed": args.seed,
            "baseline": False,
            "warmup_tokens": 8,
        },
    )
    return run_evaluation(recipe)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=Path, default=REPO_ROOT / "runs" / "reference-extract")
    parser.add_argument("--target", default=str(REPO_ROOT / "examples" / "reference-target"))
    parser.add_argument("--prompts", default=str(REPO_ROOT / "examples" / "data" / "eval_prompts.jsonl"))
    parser.add_argument("--workdir", type=Path, default=REPO_ROOT / "runs" / "eagle31")
    parser.add_argument("--steps", type=int, default=300, help="training steps of each draft")
    parser.add_argument("--limit", type=int, default=50, help="evaluation prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extract-limit", type=int, default=None, help="extract a missing store from N records")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="train recipe override (both drafts)")
    parser.add_argument("--extract-set", action="append", default=[], metavar="KEY=VALUE", help="extract recipe override (with --extract-limit)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "eagle31.json")
    args = parser.parse_args(argv)

    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    ensure_store(args.store, args.target, args.extract_limit, args.device, args.extract_set)
    results: dict[str, Any] = {"steps": args.steps}
    details: dict[str, Any] = {}
    for name, (fc_norm, norm_output) in VARIANTS.items():
        summary = train(args, name, fc_norm, norm_output)
        evaluation = evaluate(args, name, summary["checkpoint"])
        setting = evaluation["settings"][0]
        results[f"{name}_al_tree_t0"] = setting["acceptance_length"]
        details[name] = {
            "fc_norm": fc_norm,
            "norm_output": norm_output,
            "checkpoint": str(summary["checkpoint"]),
            "train_seconds": summary["train_seconds"],
            "final_metrics": {k: v for k, v in summary.items() if k not in ("checkpoint",)},
            "accept_rate_per_depth": setting.get("accept_rate_per_depth"),
            "greedy_agreement": setting.get("greedy_agreement"),
        }
        print(f"{name}: acceptance length (tree 8/5/31, t=0) {setting['acceptance_length']:.3f}", flush=True)
    results["details"] = details
    results["benchmark"] = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "store": str(args.store),
        "prompts": args.prompts,
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "recipe": "recipes/reference/train-eagle3.yaml",
        "overrides": args.set,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k.endswith("_t0") or k == "steps"}))
    return 0

