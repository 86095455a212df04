"""EAGLE-3 vs EAGLE-3.1 on the reference target at equal steps (issue 30, "EAGLE-3.1").

Trains two drafts from the same store with one recipe (default ``recipes/reference/
train-eagle3.yaml``; ``--recipe`` another), identical in everything (seed, data order, schedule,
vocabulary) but ``draft.fc_norm`` and ``draft.norm_output`` (EAGLE-3.1: an RMSNorm per aux layer
before fc, the final-normed hidden fed to the next TTT depth). Then, for each draft: its per-depth
accuracy on a held-out store (the offline proxy, when ``--heldout-store`` exists), and its
acceptance length really decoded against the target (benchmarks/evaluate/acceptance.py: the
EAGLE-2 tree 8/5/31 at temperature 0 by default, float32, batch size 1, the bundled evaluation
prompts). Writes ``--out`` (default ``benchmarks/results/eagle31.json``)::

    {"eagle3_al_tree_t0": x, "eagle31_al_tree_t0": x, "steps": n, ...details}

The stores: ``--store`` (default ``runs/reference-extract``); with ``--extract-limit N`` a missing
one is extracted first from ``--data`` (default the bundled training slice), whose records are
split by a hash of their id into training and held-out (``--heldout-fraction``) sets.

CPU, small (minutes on 2 cores)::

    python -m benchmarks.bench_train eagle31 --extract-limit 40 --steps 60 --limit 8 --max-new-tokens 48 \
        --store runs/eagle31-store --workdir runs/eagle31 --out benchmarks/results/eagle31-cpu.json

On a GPU the training runs there and the decoding here (``--stage train`` then ``--stage
evaluate`` with the checkpoints brought back under ``--workdir``): tools/gpu_eagle31.sh.
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
HELDOUT_SAMPLES = 256


def ensure_stores(args: argparse.Namespace) -> None:
    """Extract the training and held-out stores when they are missing and ``--extract-limit`` allows."""
    import hsstore
    from hsstore.errors import StoreNotFoundError

    try:
        hsstore.open_store(str(args.store))
        return
    except StoreNotFoundError:
        pass
    if args.extract_limit is None:
        raise SystemExit(
            f"{args.store}: no store; run `hsstore extract recipes/reference/extract.yaml` or pass "
            "--extract-limit N"
        )
    from benchmarks.bench_vs_specforge import split_records

    args.workdir.mkdir(parents=True, exist_ok=True)
    train_records, heldout_records = split_records(args.data, args.workdir, args.heldout_fraction)
    extract(args, train_records, args.store, args.extract_limit)
    if args.heldout_store is not None:
        extract(args, heldout_records, args.heldout_store, None)


def extract(args: argparse.Namespace, records: Path, store: Path, limit: int | None) -> None:
    from pipelines.extract import ExtractRecipe, run_extraction
    from pipelines.recipe import load_recipe

    overrides = [
        f"target={args.target}", f"data=[{records}]", f"store={store}", "executor=local",
        f"model.device={args.device}", "model.dtype=" + ("bfloat16" if args.device == "cuda" else "float32"),
        *args.extract_set,
    ]
    if limit:
        overrides.append(f"limit={limit}")
    run_extraction(load_recipe(ExtractRecipe, str(REPO_ROOT / "recipes" / "reference" / "extract.yaml"), overrides))


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
    recipe = load_recipe(TrainRecipe, str(args.recipe), overrides)
    start = time.perf_counter()
    summary = run_training(recipe)
    summary["train_seconds"] = time.perf_counter() - start
    return summary


def heldout_accuracy(args: argparse.Namespace, checkpoint: Path) -> list[float] | None:
    """Per-depth TTT accuracy on the held-out store (None when there is none)."""
    if args.heldout_store is None or not (args.heldout_store / "manifest.json").exists():
        return None
    from benchmarks.evaluate.acceptance import heldout_accuracy as proxy_accuracy

    return proxy_accuracy(checkpoint, store=args.heldout_store, target=Path(args.target), device=args.device,
                          max_samples=HELDOUT_SAMPLES)


def stage_train(args: argparse.Namespace) -> dict[str, Any]:
    ensure_stores(args)
    results: dict[str, Any] = {"steps": args.steps, "details": {}}
    for name, (fc_norm, norm_output) in VARIANTS.items():
        summary = train(args, name, fc_norm, norm_output)
        results["details"][name] = {
            "fc_norm": fc_norm,
            "norm_output": norm_output,
            "checkpoint": str(Path(summary["checkpoint"]).relative_to(args.workdir)),
            "train_seconds": summary["train_seconds"],
            "final_metrics": {k: v for k, v in summary.items() if k != "checkpoint"},
            "heldout_acc": heldout_accuracy(args, Path(summary["checkpoint"])),
        }
    return results


def stage_evaluate(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Decode every draft of ``results`` (checkpoints relative to ``--workdir``) against the target."""
    from benchmarks.evaluate.acceptance import SETTINGS, acceptance_lengths

    settings = [s for s in SETTINGS if s["name"] in args.settings.split(",")]
    for name, detail in results["details"].items():
        began = time.perf_counter()
        scores = acceptance_lengths(
            args.workdir / detail["checkpoint"], target=Path(args.target), prompts=Path(args.prompts),
            out=args.workdir / f"{name}-evaluate", limit=args.limit, max_new_tokens=args.max_new_tokens,
            device=args.eval_device or args.device, settings=settings,
        )
        detail["decode_seconds"] = round(time.perf_counter() - began, 1)
        for key, value in scores.items():  # al_tree_t0 -> eagle3_al_tree_t0 (the keys)
            results[f"{name}_{key}"] = value
            print(f"{name}: acceptance length ({key.removeprefix('al_')}) {value:.3f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=("all", "train", "evaluate"), default="all")
    parser.add_argument("--store", type=Path, default=REPO_ROOT / "runs" / "reference-extract")
    parser.add_argument("--heldout-store", type=Path, default=None, help="held-out store (extracted with --extract-limit)")
    parser.add_argument("--data", type=Path, default=REPO_ROOT / "examples" / "data" / "draft_train_slice.jsonl")
    parser.add_argument("--heldout-fraction", type=float, default=0.05)
    parser.add_argument("--target", default=str(REPO_ROOT / "examples" / "reference-target"))
    parser.add_argument("--recipe", type=Path, default=REPO_ROOT / "recipes" / "reference" / "train-eagle3.yaml")
    parser.add_argument("--prompts", default=str(REPO_ROOT / "examples" / "data" / "eval_prompts.jsonl"))
    parser.add_argument("--workdir", type=Path, default=REPO_ROOT / "runs" / "eagle31")
    parser.add_argument("--steps", type=int, default=300, help="training steps of each draft")
    parser.add_argument("--limit", type=int, default=50, help="evaluation prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--settings", default="tree_t0", help="comma-separated decode settings (acceptance.SETTINGS)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--eval-device", default=None, help="decode on another device (default --device)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extract-limit", type=int, default=None, help="extract a missing store from N records")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="train recipe override (both drafts)")
    parser.add_argument("--extract-set", action="append", default=[], metavar="KEY=VALUE", help="extract recipe override (with --extract-limit)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "eagle31.json")
    args = parser.parse_args(argv)

    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.stage == "evaluate":
        results = json.loads(args.out.read_text())
    else:
        results = stage_train(args)
        results["trained_on"] = {
            "device": args.device,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "store": str(args.store),
            "heldout_store": str(args.heldout_store) if args.heldout_store else None,
            "recipe": str(args.recipe.relative_to(REPO_ROOT)) if args.recipe.is_relative_to(REPO_ROOT) else str(args.recipe),
            "overrides": args.set,
            "argv": sys.argv[1:] if argv is None else argv,
        }
    if args.stage != "train":
        stage_evaluate(args, results)
        results["decoded_on"] = {
            "device": args.eval_device or args.device,
            "python": platform.python_version(),
            "prompts": args.prompts,
            "limit": args.limit,
            "max_new_tokens": args.max_new_tokens,
            "settings": args.settings.split(","),
            "dtype": "float32",
            "date": time.strftime("%Y-%m-%d"),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in results.items() if "_al_" in k or k == "steps"}))
    return 0
