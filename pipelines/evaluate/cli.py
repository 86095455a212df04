"""``hsstore evaluate RECIPE [--set KEY=VALUE]...``: argparse only; torch loads in the handler."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pipelines.recipe import add_recipe_arguments


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "evaluate",
        help="measure a draft's acceptance length by speculative decoding against the target",
        description=(
            "Decode the recipe's prompts with the target verifying the draft's proposals (chain "
            "or EAGLE-2 tree, greedy or sampled, batch size 1) and report acceptance length, "
            "per-depth acceptance, draft/target time and the speedup over target-only decoding. "
            "Writes evaluation_results.json and .txt into output_dir."
        ),
    )
    add_recipe_arguments(parser, "recipes/reference/evaluate.yaml", "--set limit=10 --set draft=runs/x/final")
    parser.add_argument("--json", action="store_true", help="print the results JSON at the end")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipelines.evaluate.metrics import report_text
    from pipelines.evaluate.recipe import EvaluateRecipe
    from pipelines.evaluate.runner import run_evaluation
    from pipelines.recipe import load_recipe

    recipe = load_recipe(EvaluateRecipe, args.recipe, args.overrides)
    results = run_evaluation(recipe)
    print(json.dumps(results, indent=2) if args.json else report_text(results), end="")
    return 0
